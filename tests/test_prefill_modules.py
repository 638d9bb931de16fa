"""A long prefill forward runs each Llama-style MLP over token chunks (``prefill_mlp_chunk``): same logits and tokens
as the unpatched model, the MLP called chunk by chunk, decode untouched, and ``restore`` unwraps it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_pair

import sparsecompile
from sparsecompile.config import EngineConfig, MethodConfigError


def _calls(model):
    """Token counts (batch x sequence) of each MLP call, per layer (hooks on the gate projection's input)."""
    seen = []

    def hook(mod, args, out):
        assert args[0].is_contiguous()  # chunks are row ranges of the flattened batch: views, never copies
        seen.append(args[0].shape[:-1].numel())

    for layer in model.model.layers:
        layer.mlp.gate_proj.register_forward_hook(hook)
    return seen


def test_chunked_mlp_prefill_equals_the_unpatched_model_and_restore_unwraps():
    reference, model = tiny_pair(seed=5)
    ids = torch.randint(3, model.config.vocab_size, (2, 40))
    with torch.no_grad():
        want_logits = reference(ids).logits[:, -1]
    want = reference.generate(ids, max_new_tokens=5, do_sample=False)
    sparsecompile.optimize(model, "vanilla", page_size=4, prefill_chunk_size=0, prefill_mlp_chunk=16)
    seen = _calls(model)
    with torch.no_grad():
        out = model(input_ids=ids, logits_to_keep=1)
    torch.testing.assert_close(out.logits[:, -1], want_logits, atol=1e-5, rtol=1e-5)
    out.past_key_values.release()
    layers = len(model.model.layers)
    assert seen == [16] * 5 * layers  # 2 x 40 prompt tokens, 16 rows of the flattened batch at a time
    seen.clear()
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), want)
    assert seen[:5 * layers] == [16] * 5 * layers and set(seen[5 * layers:]) == {2}  # decode: one call a step
    sparsecompile.restore(model)
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)


def test_prefill_mlp_chunk_zero_keeps_one_call_and_bad_values_are_refused():
    _, model = tiny_pair(seed=6)
    sparsecompile.optimize(model, "vanilla", page_size=4, prefill_chunk_size=0, prefill_mlp_chunk=0)
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)
    for bad in (-1, 2.5, True):
        with pytest.raises(MethodConfigError, match="prefill_mlp_chunk"):
            EngineConfig(prefill_mlp_chunk=bad)
    with pytest.raises(MethodConfigError, match="fuse_pointwise must be True or False"):
        EngineConfig(fuse_pointwise="yes")


@pytest.fixture
def fuse_on_cpu(monkeypatch):
    """The fused ops where the suite runs (their CPU kernels are the references: HF's formulas), each call counted."""
    from sparsecompile.models import prefill_modules

    calls = {"rms_norm": 0, "silu_mul": 0}

    def counted(name, op):
        def run(*args):
            calls[name] += 1
            return op(*args)
        return run

    monkeypatch.setattr(prefill_modules, "FUSED_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(prefill_modules, "rms_norm", counted("rms_norm", prefill_modules.rms_norm))
    monkeypatch.setattr(prefill_modules, "silu_mul", counted("silu_mul", prefill_modules.silu_mul))
    return calls


def _wrapped(model):
    kinds = [m.__dict__.get("_sparsecompile_prefill_module") for m in model.modules()]
    return kinds.count("norm"), kinds.count("mlp")


@pytest.mark.parametrize("arch,norms,fused_mlps", [
    ("llama", 5, True),          # two norms a layer and the final one; SiLU MLPs
    ("qwen3", 9, True),          # + the q / k head norms of both layers
    ("gemma3_text", 0, False),   # (1 + weight) norms and a GELU MLP: their own forwards, the MLP still chunked
])
def test_fused_pointwise_wraps_what_computes_the_formulas_and_equals_unfused(fuse_on_cpu, arch, norms, fused_mlps):
    reference, model = tiny_pair(arch, seed=7)
    reference.to(torch.bfloat16)
    model.to(torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (2, 24))
    options = dict(page_size=4, prefill_chunk_size=0, prefill_mlp_chunk=16)
    with sparsecompile.patched(reference, "vanilla", fuse_pointwise=False, **options), torch.no_grad():
        assert _wrapped(reference) == (0, 2)
        want = reference(input_ids=ids, logits_to_keep=1)
        want.past_key_values.release()
    assert fuse_on_cpu == {"rms_norm": 0, "silu_mul": 0}
    sparsecompile.optimize(model, "vanilla", **options)
    assert _wrapped(model) == (norms, 2)
    with torch.no_grad():
        got = model(input_ids=ids, logits_to_keep=1)
    got.past_key_values.release()
    assert torch.equal(got.logits, want.logits)  # the references' roundings are HF's own: bit for bit
    assert fuse_on_cpu["rms_norm"] == norms
    assert fuse_on_cpu["silu_mul"] == (2 * 3 if fused_mlps else 0)  # 48 tokens in runs of 16, two layers
    model.float()
    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=1).past_key_values.release()
    assert fuse_on_cpu["rms_norm"] == norms  # fp32 runs the model's own ops
    sparsecompile.restore(model)
    assert _wrapped(model) == (0, 0) and all("forward" not in m.__dict__ for m in model.modules())
