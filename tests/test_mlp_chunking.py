"""A long prefill forward runs each Llama-style MLP over token chunks (``prefill_mlp_chunk``): same logits and tokens
as the unpatched model, the MLP called chunk by chunk, decode untouched, and ``restore`` unwraps it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_pair

import sparsecompile
from sparsecompile.config import EngineConfig, MethodConfigError


def _calls(model):
    """Token counts of each down_proj call, per layer (hooks)."""
    seen = []
    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[-2]))
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
    assert seen == [16, 16, 8] * layers  # 40 prompt tokens, 16 at a time
    seen.clear()
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), want)
    assert seen[:3 * layers] == [16, 16, 8] * layers and set(seen[3 * layers:]) == {1}  # decode: one call a token
    sparsecompile.restore(model)
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)


def test_prefill_mlp_chunk_zero_keeps_one_call_and_bad_values_are_refused():
    _, model = tiny_pair(seed=6)
    sparsecompile.optimize(model, "vanilla", page_size=4, prefill_chunk_size=0, prefill_mlp_chunk=0)
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)
    for bad in (-1, 2.5, True):
        with pytest.raises(MethodConfigError, match="prefill_mlp_chunk"):
            EngineConfig(prefill_mlp_chunk=bad)
