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
