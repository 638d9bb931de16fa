"""Tensor parallelism on CPU: two gloo ranks over a tiny random model with 4 KV heads.

Two multi-process sessions (each process imports torch + transformers, the bulk of the time):

* ``torchrun_ranks``: two processes started the way torchrun starts them (RANK / WORLD_SIZE / MASTER_* set).
  Both run ``optimize(..., tp_size=2)`` + ``generate()`` and ``LLM(..., tensor_parallel_size=2)`` (rank 0
  drives, rank 1 serves inside its constructor) for every method with a budget that compresses; then the
  refusal of indivisible KV heads, and rank 1 raising mid-step.
* ``LLM(..., tensor_parallel_size=2)`` in this process, which spawns its worker; then rank 0 raising mid-step.

Every method's tokens must equal the one-rank run's (fp32: the all-reduce only reorders fp32 sums).
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

ARCH = dict(num_attention_heads=8, num_key_value_heads=4)  # 2 query heads per KV head; 2 KV heads per rank
ENGINE = dict(page_size=4, prefill_chunk_size=16)
# budgets below the prompt lengths, so every method selects or evicts (and ranks must agree on what)
CASES = {
    "vanilla": {},
    "snapkv": {"budget": 14, "window": 4},
    "pyramidkv": {"budget": 14, "window": 4},
    "h2o": {"budget": 12},
    "streamingllm": {"budget": 12},
    "quest": {"budget": 8, "dense_layers": 0},
    "omnikv": {"budget": 8, "filter_layers": "0"},
}
SERVING = dict(max_num_seqs=3, max_num_batched_tokens=24)
LLM_PROMPT_LENGTHS = (21, 40, 9)
MAX_NEW = 6


class Tokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"{t} " for t in ids)


def tiny(**arch):
    from tiny_models import tiny_pair

    return tiny_pair("llama", **{**ARCH, **arch})[1]


def generate_prompts() -> torch.Tensor:
    return torch.randint(3, 96, (2, 26), generator=torch.Generator().manual_seed(0))


def llm_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in LLM_PROMPT_LENGTHS]


def generate_tokens(method: str, tp: int) -> list[list[int]]:
    import sparsecompile

    model = sparsecompile.optimize(tiny(), method, tp_size=tp, **ENGINE, **CASES[method])
    ids = generate_prompts()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
    return out[:, ids.shape[1]:].tolist()


def llm_tokens(llm) -> list[list[int]]:
    from sparsecompile import SamplingParams

    outs = llm.generate(llm_prompts(), SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(method: str, tp: int):
    from sparsecompile import LLM

    return LLM(tiny(), method, tokenizer=Tokenizer(), tensor_parallel_size=tp, **SERVING, **ENGINE, **CASES[method])


def fault_after(cls, hook: str, decode_steps: int, message: str):
    """Make ``cls.hook`` raise ``message`` in layer 1 of the ``decode_steps``-th decode step (mid-forward)."""
    original = getattr(cls, hook)
    seen = [0]

    def faulty(self, ctx, *args):
        if not ctx.step.is_prefill and ctx.layer == 1:
            seen[0] += 1
            if seen[0] == decode_steps:
                raise RuntimeError(message)
        return original(self, ctx, *args)

    setattr(cls, hook, faulty)


def one_rank_tokens() -> dict:
    return {"generate": {m: generate_tokens(m, 1) for m in CASES},
            "llm": {m: llm_tokens(make_llm(m, 1)) for m in CASES}}


# ---------------------------------------------------------------------------------------------------- torchrun
def _torchrun_rank(rank: int, port: int, out: str) -> None:
    """One rank of a 2-process job, as torchrun starts it; writes what it saw to ``out.<rank>``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import sparsecompile
    from sparsecompile.methods.snapkv import SnapKVRuntime

    seen: dict = {"generate": {}, "llm": {}}
    for method in CASES:
        seen["generate"][method] = generate_tokens(method, 2)
    for method in CASES:
        llm = make_llm(method, 2)
        if llm.is_driver:
            seen["llm"][method] = llm_tokens(llm)
            llm.close()
        else:
            seen["llm"][method] = "worker"
    try:
        sparsecompile.optimize(tiny(hidden_size=48, num_attention_heads=6, num_key_value_heads=3), "vanilla", tp_size=2)
    except sparsecompile.UnsupportedModelError as err:
        seen["indivisible"] = str(err)
    if rank == 1:
        fault_after(SnapKVRuntime, "on_attention_end", 3, "injected fault on rank 1")
    try:
        llm = make_llm("snapkv", 2)
        if llm.is_driver:
            llm_tokens(llm)
    except Exception as err:
        seen["failure"] = f"{type(err).__name__}: {err}"
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(seen, handle)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The two-rank job's observations, and the one-rank tokens (computed here while the ranks run)."""
    import torch.multiprocessing as mp

    out = str(tmp_path_factory.mktemp("tp") / "rank")
    context = mp.start_processes(_torchrun_rank, args=(_free_port(), out), nprocs=2, join=False,
                                 start_method="spawn")
    try:
        reference = one_rank_tokens()
    finally:
        for process in context.processes:
            process.join(300)
        alive = [p for p in context.processes if p.is_alive()]
        for p in alive:
            p.kill()
    assert not alive, "a rank hung"
    assert [p.exitcode for p in context.processes] == [0, 0]
    return {"ranks": [json.load(open(f"{out}.{rank}")) for rank in range(2)], "reference": reference}


@pytest.fixture(scope="module")
def torchrun_ranks(runs) -> list[dict]:
    return runs["ranks"]


@pytest.fixture(scope="module")
def reference(runs) -> dict:
    return runs["reference"]


@pytest.mark.parametrize("method", sorted(CASES))
def test_generate_under_tp2_equals_tp1(torchrun_ranks, reference, method):
    assert torchrun_ranks[0]["generate"][method] == reference["generate"][method]
    assert torchrun_ranks[1]["generate"][method] == reference["generate"][method]


@pytest.mark.parametrize("method", sorted(CASES))
def test_llm_under_tp2_equals_tp1(torchrun_ranks, reference, method):
    assert torchrun_ranks[0]["llm"][method] == reference["llm"][method]
    assert torchrun_ranks[1]["llm"][method] == "worker"  # rank 1 served rank 0's steps in its constructor


def test_indivisible_kv_heads_are_refused_on_every_rank(torchrun_ranks):
    for seen in torchrun_ranks:
        assert "3 KV heads" in seen["indivisible"] and "tp_size" in seen["indivisible"]


def test_a_worker_raising_mid_step_stops_every_rank_with_its_reason(torchrun_ranks):
    driver, worker = torchrun_ranks[0]["failure"], torchrun_ranks[1]["failure"]
    assert worker == "RuntimeError: injected fault on rank 1"
    assert driver.startswith("TensorParallelError") and "rank 1: RuntimeError: injected fault on rank 1" in driver


# ---------------------------------------------------------------------------------------------------- spawned
def test_llm_spawns_its_worker_and_a_driver_failure_stops_it(reference, monkeypatch):
    from sparsecompile.methods.quest import QuestRuntime
    from sparsecompile.runtime.distributed import TensorParallelError

    llm = make_llm("quest", 2)
    run = llm._tensor_parallel
    (worker,) = run.workers.processes
    assert llm_tokens(llm) == reference["llm"]["quest"]
    assert worker.is_alive()
    monkeypatch.setattr(QuestRuntime, "build_decode_selection", QuestRuntime.build_decode_selection)  # restored
    fault_after(QuestRuntime, "build_decode_selection", 2, "injected fault on rank 0")
    with pytest.raises(RuntimeError, match="injected fault on rank 0"):
        llm_tokens(llm)
    worker.join(10)
    assert not worker.is_alive()  # stopped by rank 0, not left waiting in a collective
    with pytest.raises(TensorParallelError, match="rank 0: RuntimeError: injected fault on rank 0"):
        llm_tokens(llm)
    llm.close()
    assert not dist.is_initialized()
