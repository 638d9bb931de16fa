"""Scheduler invariants under any interleaving of arrivals, steps, completions and cancellations.

Model-free: a stand-in executor does what the engine does to the KV pool (a real CacheManager and
BlockAllocator): rows on the first prompt chunk, slots per chunk and per decode token, the method's
eviction down to the MemoryOracle's resident counts, rows released on finish, abort and preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparsecompile.methods.eviction import EvictionMemoryOracle
from sparsecompile.runtime.cache_manager import CacheManager, KVLayout
from sparsecompile.runtime.memory_oracle import PROMPT_BUFFER, DenseMemoryOracle
from sparsecompile.serving.outputs import RequestMetrics, RequestRejected, SamplingParams
from sparsecompile.serving.request import Request, RequestStatus
from sparsecompile.serving.scheduler import Scheduler

LAYERS, PAGE, PAGES, MAX_LEN = 2, 4, 48, 64
LAYOUT = KVLayout(LAYERS, 1, 4, PAGE, torch.float32, torch.device("cpu"))


class BufferedOracle(EvictionMemoryOracle):
    """SnapKV-like, and each prompt keeps ``10 * prompt_len`` bytes outside the pool until its last chunk (a KIVI
    composition's full-precision prompt), with room for one ``MAX_LEN`` prompt."""

    def prompt_buffer_bytes(self, prompt_len: int) -> int:
        return 10 * prompt_len


def make_oracle(kind: str):
    if kind == "dense":
        return DenseMemoryOracle(LAYOUT)
    if kind == "buffered":
        oracle = BufferedOracle(LAYOUT, lambda n: [min(n, 12), min(n, 8)])
        oracle.buffer_budget = oracle.prompt_buffer_bytes(MAX_LEN)
        return oracle
    if kind == "eviction":  # SnapKV-like: compact the prompt to 12 slots, then append
        return EvictionMemoryOracle(LAYOUT, lambda n: [min(n, 12), min(n, 8)])
    # H2O-like: budget 12, evict back to it every 3 decode tokens
    return EvictionMemoryOracle(LAYOUT, lambda n: [min(n, 12)] * LAYERS, decode_budget=lambda n: 12, interval=3)


class Executor:
    """What the engine does to the pool for a scheduler output."""

    def __init__(self, oracle) -> None:
        self.oracle = oracle
        self.manager = CacheManager(LAYOUT, PAGES, 12, MAX_LEN // PAGE + 2)
        self.siblings: list[Request] = []  # n > 1: the siblings forked (or queued) when a first prompt ended

    def _set(self, request: Request, counts: list[int]) -> None:
        m, row = self.manager, request.row
        now = m.slot_count_array([row])[0]
        m.prepare_writes([row], np.minimum(now, counts)[None, :])  # a fork's shared pages: copy-on-write
        grow = np.maximum(now, counts)
        m.ensure_slots([row], grow[None, :])  # raises OutOfPages if the scheduler over-committed
        for layer, c in enumerate(counts):
            if c < grow[layer]:
                m.truncate(row, layer, int(c))

    def release(self, request: Request) -> None:
        if request.row is not None:
            self.manager.release_sequence(request.row)
            request.row = None

    def run(self, scheduler: Scheduler, plan, stop_now: set[str]) -> None:
        for r in plan.preempted:
            self.release(r)
        for r in plan.decode:
            n = len(r.prefill_ids)
            self._set(r, [s + 1 for s in self.oracle.resident_slots_per_layer(n, r.num_decoded)])
            scheduler.decode_done(r)
            self._set(r, self.oracle.resident_slots_per_layer(n, r.num_decoded))
            self._emit(scheduler, r, stop_now)
        room = scheduler.capacity.get(PROMPT_BUFFER, 0)
        if room and plan.prefill:  # the step's buffers (padded to its widest row) and the other started prompts'
            need = [self.oracle.prompt_buffer_bytes(len(c.request.prefill_ids)) for c in plan.prefill]
            step = [c.request for c in plan.prefill]
            held = sum(self.oracle.prompt_buffer_bytes(len(r.prefill_ids)) for r in scheduler.running
                       if r.status is RequestStatus.PREFILLING and r.row is not None and r not in step)
            assert len(need) * max(need) + held <= room
        for chunk in plan.prefill:
            r = chunk.request
            if r.row is None:
                r.row = self.manager.add_sequence()
            self._set(r, [chunk.stop] * LAYERS)
            seated = r.forks
            scheduler.chunk_done(chunk)
            if chunk.final:
                self._set(r, self.oracle.resident_slots_per_layer(len(r.prefill_ids), 0))
                self._fork(scheduler, r, seated)
                self._emit(scheduler, r, stop_now)

    def _fork(self, scheduler: Scheduler, r: Request, seated: int) -> None:
        """The engine's first sample of an ``n > 1`` request: siblings fork its row (or queue); every sibling whose
        seat its admission reserved joins."""
        if r.params.n == 1 or r.output_ids or "#" in r.request_id or r.params.max_tokens == 1:
            return
        for k in range(1, r.params.n):
            child = Request(f"{r.request_id}#{k}", list(r.prompt_ids), r.params, RequestMetrics(0.0))
            child.output_ids.append(7)
            joined = scheduler.add_fork(child, r)
            assert joined or k > seated, (k, seated)
            if joined:
                child.row = self.manager.fork_sequence(r.row)
            self.siblings.append(child)

    def _emit(self, scheduler: Scheduler, r: Request, stop_now: set[str]) -> None:
        r.output_ids.append(7)
        if len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= MAX_LEN or r.request_id in stop_now:
            scheduler.finish(r, "length")
            self.release(r)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ids = 0
        self.admitted: dict[str, Request] = {}
        self.stop_now: set[str] = set()

    @rule(kind=st.sampled_from(["dense", "eviction", "interval", "buffered"]),
          mode=st.sampled_from(["chunked", "aligned", "whole"]),
          budget=st.integers(4, 40), seqs=st.integers(1, 4), while_decoding=st.none() | st.integers(1, 12))
    @precondition(lambda self: not hasattr(self, "scheduler"))
    def configure(self, kind: str, mode: str, budget: int, seqs: int, while_decoding: int | None) -> None:
        self.oracle = make_oracle(kind)
        self.executor = Executor(self.oracle)
        self.scheduler = Scheduler(self.oracle, PAGES, max_num_seqs=seqs, max_num_batched_tokens=max(budget, seqs),
                                   prefill_chunk_size=8, prefill_mode=mode, max_model_len=MAX_LEN,
                                   max_prefill_tokens_while_decoding=while_decoding)

    @rule(prompt=st.integers(1, 70), max_tokens=st.integers(1, 30), n=st.sampled_from([1, 1, 2, 3]))
    @precondition(lambda self: hasattr(self, "scheduler"))
    def arrive(self, prompt: int, max_tokens: int, n: int) -> None:
        self.ids += 1
        r = Request(f"r{self.ids}", [5] * prompt, SamplingParams(max_tokens=max_tokens, n=n), RequestMetrics(0.0))
        try:
            self.scheduler.add(r)
        except RequestRejected:
            # rejected only when it can never run: too long, or its peak exceeds the whole pool
            cost = self.oracle.admission_cost(prompt, min(max_tokens, MAX_LEN - prompt))["kv_pages"]
            assert prompt >= MAX_LEN or cost > PAGES
            return
        self.admitted[r.request_id] = r

    @rule()
    @precondition(lambda self: hasattr(self, "scheduler"))
    def step(self) -> None:
        plan = self.scheduler.schedule()
        assert plan.num_tokens <= self.scheduler.max_num_batched_tokens or len(plan.prefill) == 1
        cap = self.scheduler.max_prefill_tokens_while_decoding
        if plan.decode and cap is not None:  # prompt work beside decodes: within the cap (one fixed-size chunk may
            assert sum(c.stop - c.start for c in plan.prefill) <= cap or len(plan.prefill) == 1  # exceed it)
        assert self.scheduler._seats() <= self.scheduler.max_num_seqs
        self.executor.run(self.scheduler, plan, self.stop_now)

    @rule(data=st.data())
    @precondition(lambda self: hasattr(self, "scheduler") and self.admitted)
    def cancel(self, data) -> None:
        r = self.admitted[data.draw(st.sampled_from(sorted(self.admitted)))]
        self.scheduler.finish(r, "abort")
        self.executor.release(r)

    @rule(data=st.data())
    @precondition(lambda self: hasattr(self, "scheduler") and self.admitted)
    def stop_early(self, data) -> None:
        self.stop_now.add(data.draw(st.sampled_from(sorted(self.admitted))))

    @invariant()
    def pages_within_reservations(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        m, s = self.executor.manager, self.scheduler
        used = m.allocator.num_used
        assert used <= s.reserved["kv_pages"] <= PAGES
        held = {p for row in m.live_rows for layer in range(LAYERS) for p in m.pages_of(row, layer)}
        assert len(held) == used  # every allocated page is held by a live row (forks share pages)
        assert s.reserved["kv_pages"] == sum(r.reserved.get("kv_pages", 0) for r in s.running)

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for _ in range(5000):  # every admitted request finishes
            if not self.scheduler.has_unfinished:
                break
            self.step()
        assert not self.scheduler.has_unfinished
        assert all(r.status is RequestStatus.FINISHED for r in [*self.admitted.values(), *self.executor.siblings])
        assert self.executor.manager.allocator.num_free == PAGES
        assert self.scheduler.reserved["kv_pages"] == 0
        assert self.scheduler.reserved.get(PROMPT_BUFFER, 0) == 0


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_oversized_request_is_rejected_with_the_reason() -> None:
    s = Scheduler(DenseMemoryOracle(LAYOUT), PAGES, max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8,
                  prefill_mode="chunked", max_model_len=MAX_LEN)
    s.add(Request("fits", [1] * 60, SamplingParams(max_tokens=3), RequestMetrics(0.0)))  # 2 x 16 of 48 pages
    with pytest.raises(RequestRejected, match="context is 64 tokens"):
        s.add(Request("long", [1] * 64, SamplingParams(), RequestMetrics(0.0)))
    small_pool = Scheduler(DenseMemoryOracle(LAYOUT), 10, max_num_seqs=2, max_num_batched_tokens=16,
                           prefill_chunk_size=8, prefill_mode="chunked", max_model_len=MAX_LEN)
    with pytest.raises(RequestRejected, match="kv_cache_memory"):
        small_pool.add(Request("huge", [1] * 40, SamplingParams(max_tokens=1), RequestMetrics(0.0)))


def test_decode_pressure_preempts_the_newest_and_recomputes_its_output() -> None:
    s = Scheduler(DenseMemoryOracle(LAYOUT), 12, max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8,
                  prefill_mode="chunked", max_model_len=MAX_LEN)
    ex = Executor(s.oracle)
    ex.manager = CacheManager(LAYOUT, 12, 4, 8)
    a = Request("a", [1] * 8, SamplingParams(max_tokens=10), RequestMetrics(0.0))
    b = Request("b", [2] * 8, SamplingParams(max_tokens=10), RequestMetrics(0.0))
    s.add(a)
    s.add(b)
    preempted = []
    for _ in range(100):
        if not s.has_unfinished:
            break
        plan = s.schedule()
        preempted += plan.preempted
        ex.run(s, plan, set())
    # both grow to 18 tokens = 10 pages each, the pool has 12: the newest admission (b) is preempted and
    # re-prefills its prompt plus the tokens it had generated
    assert preempted and all(r is b for r in preempted)
    assert a.metrics.num_preemptions == 0 and b.metrics.num_preemptions == len(preempted)
    assert len(b.prefill_ids) > 8 and b.prefill_ids[:8] == b.prompt_ids
    assert a.status is b.status is RequestStatus.FINISHED and len(b.output_ids) == 10
    assert ex.manager.allocator.num_free == 12


def test_steps_that_decode_carry_at_most_the_capped_prompt_tokens() -> None:
    """``max_prefill_tokens_while_decoding``: while a request decodes, a new prompt goes in chunks of the cap; with
    nothing decoding it takes the whole budget."""
    s = Scheduler(DenseMemoryOracle(LAYOUT), PAGES, max_num_seqs=2, max_num_batched_tokens=32, prefill_chunk_size=32,
                  prefill_mode="chunked", max_model_len=MAX_LEN, max_prefill_tokens_while_decoding=5)
    ex = Executor(s.oracle)
    s.add(Request("a", [1] * 30, SamplingParams(max_tokens=20), RequestMetrics(0.0)))
    first = s.schedule()
    assert [(c.start, c.stop) for c in first.prefill] == [(0, 30)] and not first.decode  # alone: the whole budget
    ex.run(s, first, set())
    s.add(Request("b", [2] * 22, SamplingParams(max_tokens=2), RequestMetrics(0.0)))
    chunks = []
    while not chunks or chunks[-1][1] < 22:
        plan = s.schedule()
        assert len(plan.decode) == 1
        chunks += [(c.start, c.stop) for c in plan.prefill]
        ex.run(s, plan, set())
    assert chunks == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 22)]


def test_prompt_buffers_serialize_long_prompts_and_keep_short_ones_together() -> None:
    """Room for one ``MAX_LEN`` prompt's buffers: two long prompts are prefilled one after the other (the second is
    admitted once the first's last chunk ran), short prompts share steps, and a short prompt does not share a step
    with a long one whose width would pad it past the room."""
    oracle = make_oracle("buffered")
    s = Scheduler(oracle, PAGES, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=64,
                  prefill_mode="chunked", max_model_len=MAX_LEN)
    assert s.capacity[PROMPT_BUFFER] == 10 * MAX_LEN
    ex = Executor(oracle)
    long_a, long_b = (Request(k, [1] * 40, SamplingParams(max_tokens=2), RequestMetrics(0.0)) for k in "ab")
    shorts = [Request(f"s{i}", [2] * 6, SamplingParams(max_tokens=2), RequestMetrics(0.0)) for i in range(3)]
    for r in (long_a, long_b, *shorts):
        s.add(r)
    steps = []
    while s.has_unfinished:
        plan = s.schedule()
        steps.append([c.request.request_id for c in plan.prefill])
        ex.run(s, plan, set())
    assert steps[0] == ["a"]  # b's 400 bytes do not fit beside a's (640 of room): b waits, and the queue behind it
    assert steps[1] == ["b"]  # a ended its prompt: its buffer went back
    assert sorted(steps[2]) == ["s0", "s1", "s2"]  # 3 x 60 bytes: together
    assert s.reserved.get(PROMPT_BUFFER, 0) == 0
