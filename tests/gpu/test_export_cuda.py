"""Exported artifacts on CUDA (skipped without a GPU): every method, exported from the Llama-3.1-8B shape with
random weights, loaded in a fresh process, generates the eager engine's greedy tokens; decode runs as CUDA-graph
replays captured at load.

The model is the 8B shape cut to 2 layers and kept in fp32 so that greedy ties cannot flip between the eager
engine and the inductor-lowered programs (bf16 speed and full depth: ``benchmarks/export.py``). Methods whose
decode program is the same (snapkv, pyramidkv and vanilla only append) reuse one compiled package; expect about
six AOTInductor compiles. On a fresh H200 the first method took 253 s (2026-12-01, then in the exported form):
the tests are independent (own artifact directory, own model per worker; packages are shared through the
atomic ``$SPARSECOMPILE_CACHE/aoti``), so ``next.sh`` runs them side by side (``pytest -n 4``). Each prints its
export and load phases (``-rA`` shows them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(max_num_seqs=4, max_model_len=1024, page_size=16, prefill_chunk_size=128)
# budgets below the prompts: the eviction methods evict, the selection methods select
METHODS = {
    "vanilla": {},
    "snapkv": {"budget": 96, "window": 16},
    "pyramidkv": {"budget": 96, "window": 16},
    "streamingllm": {"budget": 96},
    "h2o": {"budget": 96},
    "quest": {"budget": 96, "dense_layers": 1, "dense_below": 0},
    "omnikv": {"budget": 96, "filter_layers": "0", "dense_below": 0},
}
PROMPT_LENGTHS = (300, 180, 45, 260, 130)
MAX_TOKENS = 16

_LOAD = r"""
import json, sys
import sparsecompile
llm = sparsecompile.load(sys.argv[1])
prompts = json.loads(sys.argv[2])
outs = llm.generate(prompts, sparsecompile.SamplingParams(temperature=0, max_tokens=int(sys.argv[3])), use_tqdm=False)
graphs = sorted(llm.llm_engine.controller._compiled_decode.graphs)
print("RESULT " + json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "graphs": graphs,
                              "modeling": [m for m in sys.modules if "modeling_llama" in m],
                              "load_s": llm.llm_engine.load_timings}))
"""


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from decode import LLAMA_8B

    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": 2}),
                                                dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from tiny_models import word_tokenizer

    return _model(), word_tokenizer(128256)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_fresh_process_serves_the_8b_shape_artifact_token_for_token(method, model_and_tokenizer, tmp_path):
    import sparsecompile

    model, tokenizer = model_and_tokenizer
    path = sparsecompile.export(model, tmp_path / method, method, tokenizer=tokenizer, **ENGINE, **METHODS[method])
    shipped = [f for f in json.loads((path / "manifest.json").read_text())["files"] if f.startswith("kernels/")]
    assert any(f.endswith(".cubin") for f in shipped), "the trial load shipped no Triton kernel"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cold-triton"),  # only what the artifact ships
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _LOAD, str(path), json.dumps(_prompts()),
                           str(MAX_TOKENS)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded = json.loads(next(ln[7:] for ln in done.stdout.splitlines() if ln.startswith("RESULT ")))
    print(f"{method}: export_s {json.loads((path / 'manifest.json').read_text())['export_seconds']}; "
          f"load_s {loaded['load_s']}")
    assert loaded["modeling"] == []
    assert loaded["graphs"] == [1, 2, 4], "a decode bucket was not captured as a CUDA graph at load"
    eager = sparsecompile.LLM(model, method, tokenizer=tokenizer, compile=False, **ENGINE, **METHODS[method])
    params = sparsecompile.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].token_ids for o in eager.generate(_prompts(), params, use_tqdm=False)]
    sparsecompile.restore(model)
    assert loaded["tokens"] == expected


def test_the_weights_reader_through_pinned_buffers(tmp_path):
    from test_export_parts import check_weights_reader

    check_weights_reader(tmp_path, "cuda")


def test_the_exported_form_serves_without_aoti(model_and_tokenizer, tmp_path):
    """The fallback form: torch.export programs; the decode program compiled at load, warm from the shipped cache
    artifacts (no inductor compile misses), and replayed from CUDA graphs."""
    import sparsecompile

    model, tokenizer = model_and_tokenizer
    path = sparsecompile.export(model, tmp_path / "exported", "snapkv", tokenizer=tokenizer, form="exported",
                                **ENGINE, **METHODS["snapkv"])
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    llm = sparsecompile.load(path)
    # a hit of AOTAutograd's cache loads the inductor graph without counting an FX-graph-cache hit (torch 2.11)
    hits = counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
    assert hits >= 3 and not counters["inductor"]["fxgraph_cache_miss"], dict(counters)
    params = sparsecompile.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    assert sorted(llm.llm_engine.controller._compiled_decode.graphs) == [1, 2, 4]
    del llm
    eager = sparsecompile.LLM(model, "snapkv", tokenizer=tokenizer, compile=False, **ENGINE, **METHODS["snapkv"])
    assert got == [o.outputs[0].token_ids for o in eager.generate(_prompts(), params, use_tqdm=False)]
    sparsecompile.restore(model)
