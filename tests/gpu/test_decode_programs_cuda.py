"""CUDA-only (skipped without a GPU): a precompiled decode program (``serving/decode_programs.py``) replaces the
compiled step in a later ``optimize()`` + ``generate()``, with the CUDA graph it captures at its first step:
tokens equal the compiled step's (fp32, so greedy ties cannot differ), and the compiled step never runs. Quest's
``dense_below`` sits inside the generation, so it runs both of its decode variants' programs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import tiny_pair  # noqa: E402

import sparsecompile  # noqa: E402
from sparsecompile.models.hf_patch import patched_model  # noqa: E402
from sparsecompile.serving.decode_programs import PrecompiledDecode  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("method,options", [("vanilla", {}), ("h2o", {"budget": 48}),
                                            # 2 layers: none dense; 2 x 150 held tokens, then 2 x 161: both variants
                                            ("quest", {"budget": 48, "dense_layers": 0, "dense_below": 310})])
def test_a_precompiled_program_serves_generate_with_its_cuda_graph(method, options, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSECOMPILE_CACHE", str(tmp_path))
    _, model = tiny_pair()
    model = model.cuda()
    ids = torch.randint(3, 90, (2, 150), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    engine = dict(page_size=16, compile=True, cuda_graphs=True)
    sparsecompile.optimize(model, method, **engine, **options)
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    sparsecompile.warmup(model, (2,), prompt_len=150, max_new_tokens=12, programs=True)
    sparsecompile.restore(model)

    sparsecompile.optimize(model, method, **engine, **options)
    step = patched_model(model).controller._compiled_decode
    assert isinstance(step, PrecompiledDecode)
    step.fallback = lambda *args: pytest.fail("the compiled step ran")
    for _ in range(2):  # the first call captures the graph, the second replays it
        assert model.generate(ids, max_new_tokens=12, do_sample=False).tolist() == expected.tolist()
    runners = [r for r in step.runners.values() if r is not None]
    assert len(runners) == len(patched_model(model).controller.runtime.decode_variants)
    assert all(runner.graphs for runner in runners)
