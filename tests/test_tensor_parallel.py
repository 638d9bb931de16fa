"""Tensor parallelism on CPU: two gloo ranks over a tiny random model with 4 KV heads (tests/tp_cases.py).

Two multi-process sessions (each process imports torch + transformers, the bulk of the time):

* ``runs``: two processes started the way torchrun starts them (RANK / WORLD_SIZE / MASTER_* set). Both run
  ``optimize(..., tp_size=2)`` + ``generate()`` and ``LLM(..., tensor_parallel_size=2)`` (rank 0 drives, rank 1
  serves inside its constructor) for every method with a budget that compresses; then the refusal of
  indivisible KV heads, and rank 1 raising mid-step. The one-rank tokens are computed here meanwhile.
* ``LLM(..., tensor_parallel_size=2)`` in this process, which spawns its worker; then rank 0 raising mid-step.

Every method's tokens must equal the one-rank run's (fp32: the all-reduces only reorder fp32 sums).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from tp_cases import CPU_CASES, as_torchrun_rank, fault_after, generate_tokens, llm_tokens, make_llm, run_ranks, tiny

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")


def one_rank_tokens() -> dict:
    return {"generate": {m: generate_tokens(m, 1) for m in CPU_CASES},
            "llm": {m: llm_tokens(make_llm(m, 1)) for m in CPU_CASES}}


def _rank(rank: int, port: int, out: str) -> None:
    """One rank of a 2-process job, as torchrun starts it; writes what it saw to ``out.<rank>``."""
    as_torchrun_rank(rank, 2, port)
    torch.set_num_threads(1)
    import sparsecompile
    from sparsecompile.methods.snapkv import SnapKVRuntime

    seen: dict = {"generate": {}, "llm": {}}
    for method in CPU_CASES:
        seen["generate"][method] = generate_tokens(method, 2)
    for method in CPU_CASES:
        llm = make_llm(method, 2)
        if llm.is_driver:
            seen["llm"][method] = llm_tokens(llm)
            llm.close()
        else:
            seen["llm"][method] = "worker"
    try:
        sparsecompile.optimize(tiny(hidden_size=48, num_attention_heads=6, num_key_value_heads=3), "vanilla",
                               tp_size=2)
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("tp") / "rank")
    reference, ranks = run_ranks(_rank, 2, out, timeout=300, while_running=one_rank_tokens)
    return {"ranks": ranks, "reference": reference}


@pytest.mark.parametrize("method", sorted(CPU_CASES))
def test_generate_under_tp2_equals_tp1(runs, method):
    want = runs["reference"]["generate"][method]
    assert [seen["generate"][method] for seen in runs["ranks"]] == [want, want]


@pytest.mark.parametrize("method", sorted(CPU_CASES))
def test_llm_under_tp2_equals_tp1(runs, method):
    assert runs["ranks"][0]["llm"][method] == runs["reference"]["llm"][method]
    assert runs["ranks"][1]["llm"][method] == "worker"  # rank 1 served rank 0's steps in its constructor


def test_indivisible_kv_heads_are_refused_on_every_rank(runs):
    for seen in runs["ranks"]:
        assert "3 KV heads" in seen["indivisible"] and "tp_size" in seen["indivisible"]


def test_a_worker_raising_mid_step_stops_every_rank_with_its_reason(runs):
    driver, worker = runs["ranks"][0]["failure"], runs["ranks"][1]["failure"]
    assert worker == "RuntimeError: injected fault on rank 1"
    assert driver.startswith("TensorParallelError") and "rank 1: RuntimeError: injected fault on rank 1" in driver


def test_llm_spawns_its_worker_and_a_driver_failure_stops_it(runs, monkeypatch):
    from sparsecompile.methods.quest import QuestRuntime
    from sparsecompile.runtime.distributed import TensorParallelError

    llm = make_llm("quest", 2)
    (worker,) = llm._tensor_parallel.workers.processes
    assert llm_tokens(llm) == runs["reference"]["llm"]["quest"]
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


# ---------------------------------------------------------------------------------------------------- one process
class _Controller:
    layout = "the layout"

    def __init__(self) -> None:
        self.calls: list = []

    def reserve(self, batch: int, length: int) -> str:
        self.calls.append(("reserve", batch, length))
        return "reserved"

    def attend(self) -> str:
        return "attended"

    def release_rows(self, rows: list[int]) -> None:
        self.calls.append(("release_rows", rows))

    def decode(self) -> None:
        raise ValueError("boom")


def test_every_public_controller_call_is_sent_then_guarded():
    from sparsecompile.runtime.distributed import (
        DistributedController,
        FailureBoard,
        Session,
        TensorParallelError,
        TPGroup,
    )

    store = dist.HashStore()
    session = Session(TPGroup(0, 2, "unused"), "gloo", None, FailureBoard(store, 0, 2), owns_process_group=False)
    stopped, sent = [], []
    session.on_failure.append(lambda: stopped.append(True))
    local = _Controller()
    proxy = DistributedController(local, session, send=lambda name, args, kwargs: sent.append((name, args)))
    assert proxy.reserve(2, 9) == "reserved" and proxy.layout == "the layout" and proxy.attend() == "attended"
    assert sent == [("reserve", (2, 9))] and local.calls == [("reserve", 2, 9)]
    with pytest.raises(ValueError, match="boom"):  # this rank's own error, after telling the others
        proxy.decode()
    assert stopped == [True] and FailureBoard(store, 1, 2).peer_failure() == "rank 0: ValueError: boom"
    proxy.release_rows([3])  # cleanup still frees this rank's pages, without sending
    assert local.calls[-1] == ("release_rows", [3]) and sent[-1][0] == "decode"
    with pytest.raises(TensorParallelError, match="rank 0: ValueError: boom"):
        proxy.reserve(1, 1)


def test_refusals_that_need_no_process_group():
    from tiny_models import tiny_pair

    import sparsecompile

    _, phi3 = tiny_pair("phi3")
    with pytest.raises(sparsecompile.UnsupportedModelError, match="plan entries .*qkv_proj.*not supported"):
        sparsecompile.optimize(phi3, "vanilla", tp_size=2)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        sparsecompile.optimize(tiny(), "vanilla", tp_size=2)


def test_llm_refuses_indivisible_heads_before_starting_workers(tmp_path, monkeypatch):
    """A model object or a local directory whose heads a tensor_parallel_size cannot split is refused before any
    worker starts (each worker would load the model first, then refuse: seconds to minutes per rank)."""
    import multiprocessing

    from tiny_tokenizer import save_tiny_model, tiny_tokenizer

    import sparsecompile
    from sparsecompile import parallel

    def no_spawn(*args, **kwargs):
        raise AssertionError("workers started")

    monkeypatch.setattr(parallel, "_spawn", no_spawn)
    save_tiny_model(tmp_path)
    for source, tokenizer in ((tiny(), tiny_tokenizer()), (str(tmp_path), None)):
        with pytest.raises(sparsecompile.UnsupportedModelError, match="cannot be split evenly over 3"):
            sparsecompile.LLM(source, tokenizer=tokenizer, tensor_parallel_size=3)
        assert not multiprocessing.active_children()


def test_each_rank_fills_kvzip_lead_ins_from_the_tokenizer_it_loads(tmp_path):
    """A rank built from a path loads its own tokenizer: KVzip's repeat / continue prompts become its token ids."""
    from tiny_tokenizer import save_tiny_model

    from sparsecompile.methods.kvzip import CONTINUE_TEXT, REPEAT_TEXT
    from sparsecompile.models.hf_patch import patched_model
    from sparsecompile.parallel import Replica

    save_tiny_model(tmp_path)
    model, tokenizer = Replica(str(tmp_path), "kvzip", {"budget": 8}).build()
    config = patched_model(model).controller.runtime.config
    assert list(config.repeat_ids) == tokenizer.encode(REPEAT_TEXT, add_special_tokens=False)
    assert list(config.continue_ids) == tokenizer.encode(CONTINUE_TEXT, add_special_tokens=False)
