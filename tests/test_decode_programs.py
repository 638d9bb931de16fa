"""Precompiled decode programs (``serving/decode_programs.py``): ``warmup(programs=True)`` exports and compiles the
decode step, a later ``optimize()`` + ``generate()`` of that geometry runs the package instead of tracing.

One AOTInductor compile of a tiny 2-layer model on CPU (about half a minute on two cores). The "compiled" step is
the eager one here (``compile_step`` patched): what is tested is the program, not dynamo."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_pair

import sparsecompile
import sparsecompile.runtime.decode_unit as decode_unit
from sparsecompile.models.hf_patch import patched_model
from sparsecompile.serving.decode_programs import LiveWeights, PrecompiledDecode, base_key, directory


@pytest.mark.slow
def test_a_later_process_runs_the_precompiled_program_token_for_token(tmp_path, monkeypatch, sparsecompile_log):
    monkeypatch.setenv("SPARSECOMPILE_CACHE", str(tmp_path))
    monkeypatch.setattr(decode_unit, "compile_step", lambda fn, backend: fn)
    _, model = tiny_pair("llama")
    ids = torch.randint(3, 90, (1, 37), generator=torch.Generator().manual_seed(3))
    options = {"budget": 24, "compile": True, "cuda_graphs": False}  # h2o: decode eviction over method buffers
    sparsecompile.optimize(model, "h2o", **options)
    expected = model.generate(ids, max_new_tokens=9, do_sample=False)
    sparsecompile.warmup(model, (1,), prompt_len=ids.shape[1], max_new_tokens=9, programs=True)
    controller = patched_model(model).controller
    packages = list((directory() / base_key(model, controller)).glob("*.pt2"))
    assert len(packages) == 1

    sparsecompile.restore(model)  # as a new process would: a new KV core, the same options
    sparsecompile.optimize(model, "h2o", **options)
    step = patched_model(model).controller._compiled_decode
    assert isinstance(step, PrecompiledDecode)
    fallback, compiled = [], step.fallback
    step.fallback = lambda *args: fallback.append(args[1].rows.shape[0]) or compiled(*args)
    out = model.generate(ids, max_new_tokens=9, do_sample=False)
    assert out.tolist() == expected.tolist()
    assert not fallback and [r for r in step.runners.values() if r is not None]

    pair = model.generate(ids.repeat(2, 1), max_new_tokens=9, do_sample=False)  # no program at batch 2
    assert set(fallback) == {2} and pair.tolist() == expected.repeat(2, 1).tolist()

    # a damaged cache entry is passed over with a warning: the compiled step runs, generate() does not fail
    (info,) = (directory() / base_key(model, controller)).glob("*.json")
    info.write_text("{truncated")
    sparsecompile.restore(model)
    sparsecompile.optimize(model, "h2o", **options)
    again = model.generate(ids, max_new_tokens=9, do_sample=False)
    assert "not using the precompiled decode program" in sparsecompile_log.text
    assert again.tolist() == expected.tolist()


def test_live_weights_fuse_projections_without_copies():
    """A fused projection's constant is a view of the colocated parts (no copy), else their concatenation."""
    _, model = tiny_pair("llama")
    attn = model.model.layers[0].self_attn
    live = LiveWeights(model)
    name = "lm.model.layers.0.self_attn.q_proj+k_proj+v_proj.weight"
    separate = live[name]
    torch.testing.assert_close(separate, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    sparsecompile.optimize(model, "vanilla", compile=True, cuda_graphs=False)  # colocates the projections
    fused = LiveWeights(model)[name]
    assert fused.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    torch.testing.assert_close(fused, separate)
    assert "lm.model.layers.0.self_attn.q_proj+k_proj.weight" not in live and "lm.nothing.weight" not in live
