"""Tensor parallelism on two GPUs (NCCL; skipped without 2 GPUs): compiled decode replayed as CUDA graphs with the
all-reduces inside the graph, for every method, token for token equal to one GPU (fp32 tiny model).

Two NCCL ranks are spawned the way torchrun starts them; each builds the tiny CPU model of ``tests/tp_cases.py``
and ``optimize(..., tp_size=2)`` moves its shard to ``cuda:<rank>``. The capture check (one
``sparsecompile::paged_attention`` per layer, no SDPA) and the q/k/v, gate/up fusion must still pass, with no
CUDA-graph skips. Then ``LLM(..., tensor_parallel_size=2)`` under the same job, and the spawned form from this
process.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from tp_cases import (
    CASES,
    ENGINE,
    SERVING,
    Tokenizer,
    as_torchrun_rank,
    generate_prompts,
    generate_tokens,
    llm_tokens,
    make_llm,
    run_ranks,
    tiny,
)

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2 or not (dist.is_available() and dist.is_nccl_available()),
                                reason="needs 2 GPUs and NCCL")

# NVLink multicast stays off on the test machines (NVLS, symmetric memory)
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
COMPILED = dict(compile=True, cuda_graphs=True)
SERVED = ("vanilla", "quest", "omnikv", "snapkv")


def _rank(rank: int, port: int, out: str) -> None:
    as_torchrun_rank(rank, 2, port)
    from torch._dynamo.utils import counters

    import sparsecompile
    from sparsecompile.models.hf_patch import patched_model

    seen: dict = {"generate": {}, "llm": {}, "backend": {}}
    for method in CASES:
        model = sparsecompile.optimize(tiny(), method, tp_size=2, **ENGINE, **COMPILED, **CASES[method])
        seen["device"] = str(next(model.parameters()).device)  # the CPU model's shard moved to this rank's GPU
        ids = generate_prompts().cuda()
        out_ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        seen["generate"][method] = out_ids[:, ids.shape[1]:].tolist()
        backend = patched_model(model).controller.decode_backend
        seen["backend"][method] = [backend.graphs_checked, backend.fused_groups]
    seen["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
    for method in SERVED:
        llm = make_llm(method, 2, cuda_graph_sizes=[4], **COMPILED)
        if llm.is_driver:
            seen["llm"][method] = llm_tokens(llm)
            llm.close()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(seen, handle)


def _one_gpu() -> dict:
    return {"generate": {m: generate_tokens(m, 1, device="cuda", **COMPILED) for m in CASES},
            "llm": {m: llm_tokens(make_llm(m, 1, device="cuda", cuda_graph_sizes=[4], **COMPILED)) for m in SERVED}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("tp_cuda") / "rank")
    reference, ranks = run_ranks(_rank, 2, out, timeout=420, while_running=_one_gpu)
    return {"ranks": ranks, "reference": reference}


@pytest.mark.parametrize("method", sorted(CASES))
def test_compiled_cuda_graph_decode_under_tp2_equals_one_gpu(runs, method):
    want = runs["reference"]["generate"][method]
    for rank, seen in enumerate(runs["ranks"]):
        assert seen["device"] == f"cuda:{rank}"
        assert seen["generate"][method] == want
        graphs_checked, fused = seen["backend"][method]
        assert graphs_checked >= 1 and fused == 2 * 2  # q/k/v and gate/up of each of the 2 layers
    assert all(seen["cudagraph_skips"] == 0 for seen in runs["ranks"])


@pytest.mark.parametrize("method", SERVED)
def test_llm_under_tp2_equals_one_gpu(runs, method):
    assert runs["ranks"][0]["llm"][method] == runs["reference"]["llm"][method]


def test_llm_spawns_its_gpu_worker(runs):
    from sparsecompile import LLM

    # a CPU model object with device="cuda": split, then rank r's shard moves to cuda:r
    llm = LLM(tiny(), "snapkv", tokenizer=Tokenizer(), device="cuda", tensor_parallel_size=2, cuda_graph_sizes=[4],
              **SERVING, **ENGINE, **COMPILED, **CASES["snapkv"])
    try:
        assert llm_tokens(llm) == runs["reference"]["llm"]["snapkv"]
    finally:
        llm.close()
    assert not dist.is_initialized()
