"""Chains, prefix blocks and the scheduler's ledger under any interleaving of admit / finish / continue / fork /
evict / cancel / preempt: no leaked or double-owned page, reference counts that match the holders, and the pool
back to its start once everything is released.

Model-free: a real SparseController (vanilla, snapkv or h2o runtime, no model) and CacheManager; a stand-in
executor does to the pool what the engine does for each scheduler output (rows, slots per chunk and decode token,
copy-on-write before writes to shared pages, eviction down to the scheduler's resident model), and hands finished,
cancelled and preempted requests to ``KVReuse`` like the engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_llm import DigitTokenizer
from tiny_models import tiny_pair

from sparsecompile import LLM
from sparsecompile.config import EngineConfig
from sparsecompile.methods.registry import build_runtime
from sparsecompile.runtime.controller import SparseController
from sparsecompile.runtime.model_info import ModelInfo
from sparsecompile.serving.outputs import RequestMetrics, SamplingParams
from sparsecompile.serving.request import Request, RequestStatus
from sparsecompile.serving.reuse import KVReuse
from sparsecompile.serving.scheduler import Scheduler

LAYERS, PAGE, PAGES, MAX_LEN, SEQS, IDLE = 2, 4, 64, 64, 3, 4
INFO = ModelInfo("llama", LAYERS, 2, 1, 4, ("a", "b"), None)
KINDS = {"dense": ("vanilla", {}), "snapkv": ("snapkv", {"budget": 12, "window": 2}),
         "h2o": ("h2o", {"budget": 12, "interval": 3})}


def make(kind: str) -> tuple[SparseController, KVReuse, Scheduler]:
    name, options = KINDS[kind]
    controller = SparseController(build_runtime(name, options, INFO), LAYERS, 1, 4, torch.float32,
                                  torch.device("cpu"), EngineConfig(page_size=PAGE, prefill_chunk_size=8))
    controller.build_pool(PAGES, SEQS + IDLE + 1, MAX_LEN // PAGE + 2)
    reuse = KVReuse(controller, 1234, prefix_caching=kind == "dense", max_idle_chains=IDLE)
    scheduler = Scheduler(controller.oracle, PAGES, max_num_seqs=SEQS, max_num_batched_tokens=12,
                          prefill_chunk_size=8, prefill_mode=controller.runtime.prefill_mode, max_model_len=MAX_LEN,
                          reuse=reuse)
    return controller, reuse, scheduler


class Executor:
    """What the engine does to the pool for a scheduler output (see module docstring)."""

    def __init__(self, controller: SparseController, reuse: KVReuse, scheduler: Scheduler) -> None:
        self.controller, self.reuse, self.scheduler = controller, reuse, scheduler
        self.m = controller.manager
        self.rewrites = not controller.runtime.keeps_all_tokens  # eviction compacts / rescores resident slots

    def _grow(self, r: Request, new: int, rewrite: bool) -> None:
        before = self.m.slot_count_array([r.row])
        self.m.ensure_slots([r.row], before + new)
        self.m.prepare_writes([r.row], np.zeros_like(before) if rewrite else before)  # copy-on-write
        self.m.flush()

    def _shrink(self, r: Request, target: list[int], reserve: list[int] | None = None) -> None:
        """Truncate to ``target`` where it is below the count, keeping the pages of ``reserve`` slots (as decode
        eviction does)."""
        now = self.m.slot_count_array([r.row])[0]
        layers = [layer for layer, count in enumerate(target) if count < int(now[layer])]
        if layers:
            self.m.truncate_many([r.row] * len(layers), layers, [int(target[layer]) for layer in layers],
                                 None if reserve is None else [int(reserve[layer]) for layer in layers])

    def run(self, plan, stop_now: set[str]) -> list[Request]:
        for r in plan.preempted:
            self.reuse.preempted(r)
        self.scheduler.settle()  # as the engine: the victims' cached blocks reclaimed before the step allocates
        assert self.scheduler.free()["kv_pages"] >= 0
        finished = []
        for r in plan.decode:
            self._grow(r, 1, self.rewrites)
            self.scheduler.decode_done(r)
            now = self.m.slot_count_array([r.row])[0]
            o, n = self.scheduler.oracle, len(r.prefill_ids)
            if r.prompt_slots is not None:
                resident = o.resumed_resident_slots(r.prompt_slots, n, r.num_decoded)
                held = o.resumed_held_slots(r.prompt_slots, n, r.num_decoded)
            else:
                resident, held = o.resident_slots_per_layer(n, r.num_decoded), o.held_slots_per_layer(n, r.num_decoded)
            self._shrink(r, np.minimum(now, resident), held)
            finished += self._emit(r, stop_now)
        for chunk in plan.prefill:
            r = chunk.request
            if r.row is None:
                r.row = self.controller.add_sequences(1)[0]
            self._grow(r, chunk.stop - chunk.start, self.rewrites and chunk.final)
            if self.rewrites and (chunk.final or self.controller.oracle.chunk_eviction):
                kept = self.controller.oracle.kept(len(r.prefill_ids))
                self._shrink(r, np.minimum(self.m.slot_count_array([r.row])[0], kept))
            slots = self.m.slot_count_array([r.row])[0].tolist() if chunk.final and r.resumed is not None else None
            self.scheduler.chunk_done(chunk, slots)
            self.reuse.progress(r)
            if chunk.final:
                finished += self._emit(r, stop_now)
        return finished

    def _emit(self, r: Request, stop_now: set[str]) -> list[Request]:
        r.output_ids.append(3 + len(r.output_ids) % 4)
        if len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= MAX_LEN or r.request_id in stop_now:
            self.finish(r, "length")
            return [r]
        return []

    def finish(self, r: Request, reason: str) -> None:
        self.scheduler.finish(r, reason)
        self.reuse.finish(r, keep=reason != "abort")


class ReuseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ids = 0
        self.live: dict[str, Request] = {}
        self.history: dict[str, list[int]] = {}  # chain id -> prompt + output of its last finished request
        self.stop_now: set[str] = set()

    @rule(kind=st.sampled_from(sorted(KINDS)))
    @precondition(lambda self: not hasattr(self, "scheduler"))
    def configure(self, kind: str) -> None:
        self.controller, self.reuse, self.scheduler = make(kind)
        self.executor = Executor(self.controller, self.reuse, self.scheduler)

    def _arrive(self, prompt: list[int], chain_id: str, max_tokens: int) -> None:
        self.ids += 1
        r = Request(f"r{self.ids}", prompt, SamplingParams(max_tokens=max_tokens), RequestMetrics(0.0),
                    chain_id=chain_id)
        try:
            self.scheduler.add(r)
        except ValueError:
            return
        self.live[r.request_id] = r

    @rule(system=st.integers(0, 2), tail=st.lists(st.integers(3, 6), min_size=1, max_size=20),
          max_tokens=st.integers(1, 8))
    @precondition(lambda self: hasattr(self, "scheduler"))
    def new_conversation(self, system: int, tail: list[int], max_tokens: int) -> None:
        prefix = [[], [5] * 9, [4, 6] * 6][system]  # shared system prompts give prefix-cache hits
        self._arrive(prefix + tail, f"c{self.ids}", max_tokens)

    @rule(data=st.data(), extra=st.lists(st.integers(3, 6), min_size=0, max_size=12), mismatch=st.booleans(),
          max_tokens=st.integers(1, 8))
    @precondition(lambda self: hasattr(self, "scheduler") and self.history)
    def continue_conversation(self, data, extra: list[int], mismatch: bool, max_tokens: int) -> None:
        idle = sorted(set(self.reuse.chains.idle) & set(self.history))  # mostly chains that can be resumed
        chain_id = data.draw(st.sampled_from(idle if idle and data.draw(st.integers(0, 3)) else sorted(self.history)))
        prompt = self.history[chain_id] + extra
        if mismatch:
            prompt[0] = 9
        self._arrive(prompt, chain_id, max_tokens)

    @rule(times=st.integers(1, 6))
    @precondition(lambda self: hasattr(self, "scheduler"))
    def step(self, times: int = 1) -> None:
        for _ in range(times):
            plan = self.scheduler.schedule()
            assert len(self.scheduler.running) <= SEQS
            for r in self.executor.run(plan, self.stop_now):
                self._done(r)

    def _done(self, r: Request) -> None:
        del self.live[r.request_id]
        if r.finish_reason != "abort":
            self.history[r.chain_id] = r.prompt_ids + r.output_ids

    @rule(data=st.data())
    @precondition(lambda self: hasattr(self, "scheduler") and self.live)
    def cancel(self, data) -> None:
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.executor.finish(r, "abort")
        self._done(r)

    @rule(data=st.data())
    @precondition(lambda self: hasattr(self, "scheduler") and self.live)
    def stop_early(self, data) -> None:
        self.stop_now.add(data.draw(st.sampled_from(sorted(self.live))))

    @rule()
    @precondition(lambda self: hasattr(self, "scheduler") and len(self.scheduler.running) > 1)
    def preempt(self) -> None:
        victim = self.scheduler.running[-1]
        self.scheduler._preempt(victim)
        self.reuse.preempted(victim)

    @rule(data=st.data())
    @precondition(lambda self: hasattr(self, "scheduler") and len(self.reuse.chains) > 0)
    def fork(self, data) -> None:
        source = data.draw(st.sampled_from(sorted(self.reuse.chains.idle)))
        self.ids += 1
        self.reuse.fork_chain(source, f"f{self.ids}")
        self.history[f"f{self.ids}"] = self.history[source]

    @rule(pages=st.integers(1, 30), how=st.sampled_from(["reclaim", "drop", "reset"]))
    @precondition(lambda self: hasattr(self, "scheduler"))
    def evict(self, pages: int, how: str) -> None:
        if how == "reclaim":
            before = self.reuse.reclaimable_pages()
            freed = self.reuse.reclaim(pages, None)
            assert freed == before - self.reuse.reclaimable_pages() and (freed >= pages or freed == before)
        elif how == "drop" and len(self.reuse.chains):
            self.reuse.drop_chain(next(iter(self.reuse.chains.idle)))
        else:
            self.reuse.reset_prefix_cache()

    @invariant()
    def pages_and_ledger(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        m, s, reuse = self.controller.manager, self.scheduler, self.reuse
        holders = np.zeros(PAGES, dtype=np.int64)
        for row in m.live_rows:
            for layer in range(LAYERS):
                pages = m.pages_of(row, layer)
                assert len(set(pages)) == len(pages)
                np.add.at(holders, pages, 1)
        if reuse.prefix is not None:
            reuse.prefix.check()
            for block in reuse.prefix.blocks.values():
                np.add.at(holders, block.pages, 1)
        refcounts = m.allocator.refcounts(np.arange(PAGES))
        assert (refcounts == holders).all()  # nothing leaked, nothing held that the allocator does not count
        assert m.allocator.num_free == int((refcounts == 0).sum())
        rows = [r.row for r in s.running if r.row is not None] + [c.row for c in reuse.chains.idle.values()]
        assert len(rows) == len(set(rows)) and set(rows) == set(m.live_rows)  # one owner per row
        assert reuse.chains.idle_pages == sum(c.pages for c in reuse.chains.idle.values())
        assert s.reserved["kv_pages"] == sum(r.reserved.get("kv_pages", 0) for r in s.running)
        assert m.allocator.num_used <= s.reserved["kv_pages"] + reuse.reclaimable_pages()
        for r in s.running:  # reattached and hit pages count in the request's reservation
            if r.row is not None:
                held = sum(len(m.pages_of(r.row, layer)) for layer in range(LAYERS))
                assert held <= r.reserved["kv_pages"], (held, r.reserved)

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for _ in range(3000):
            if not self.scheduler.has_unfinished:
                break
            self.step()
        assert not self.scheduler.has_unfinished
        assert all(r.status is RequestStatus.FINISHED for r in self.live.values())
        self.reuse.release_idle()
        m = self.controller.manager
        assert m.allocator.num_free == PAGES and not m.live_rows
        assert self.reuse.reclaimable_pages() == 0 and self.scheduler.reserved["kv_pages"] == 0


TestReuseMachine = ReuseMachine.TestCase
TestReuseMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_prefix_caching_is_refused_for_eviction_methods() -> None:
    controller, _, _ = make("snapkv")
    with pytest.raises(ValueError, match="snapkv rewrites its pages.*chain_id"):
        KVReuse(controller, 1, prefix_caching=True)


# vanilla with chains and the prefix cache; KIVI compositions (no prefix cache: their pages are rewritten) with chains:
# a chain keeps its residual ring and quantized pages, forks copy the ring, preemption and eviction hand pages back
RANDOM_RUNS = [("vanilla", {}, 0), ("snapkv+kivi", {"budget": 24, "window": 4, "residual": 8, "group_size": 4}, 1),
               ("h2o+kivi", {"budget": 24, "residual": 8, "group_size": 4}, 1)]


@pytest.mark.parametrize("method, options, seed", RANDOM_RUNS, ids=[r[0] for r in RANDOM_RUNS])
def test_engine_random_run_leaks_nothing(method: str, options: dict, seed: int) -> None:
    """A short random run of the real engine (tiny model, a small pool): conversations continue, mismatch, fork, get
    dropped, cancelled and preempted; pages and holders always agree, and the pool is whole again once everything
    idle is released (for KIVI: no row's prompt is still held in full precision)."""
    _, model = tiny_pair()
    prefix = method == "vanilla"
    llm = LLM(model, method, tokenizer=DigitTokenizer(), enable_prefix_caching=prefix, num_pages=40 if prefix else 60,
              max_model_len=80, max_num_seqs=3, max_num_batched_tokens=16, page_size=4, prefill_chunk_size=8,
              max_idle_chains=3, **options)
    engine = llm.llm_engine
    m, reuse = engine.manager, engine.reuse
    rng = np.random.default_rng(seed)
    history: dict[str, list[int]] = {}
    live: dict[str, str] = {}  # request id -> chain id
    for i in range(60):
        op = rng.choice(["new", "continue", "continue", "continue", "fork", "drop", "abort", "step", "step"])
        if op == "new" or (op == "continue" and not history):
            chain = f"c{i}"
            engine.add_request(f"r{i}", [5] * 8 + rng.integers(3, 90, int(rng.integers(1, 20))).tolist(),
                               SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 12))), chain_id=chain)
            live[f"r{i}"] = chain
        elif op == "continue":
            chain = rng.choice(sorted(history))
            prompt = history[chain] + rng.integers(3, 90, int(rng.integers(0, 8))).tolist()
            if rng.random() < 0.2:
                prompt[3] = 91
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 12))),
                               chain_id=chain)
            live[f"r{i}"] = chain
        elif op == "fork" and len(reuse.chains):
            source = rng.choice(sorted(reuse.chains.idle))
            engine.fork_chain(source, f"f{i}")
            history[f"f{i}"] = history[source]
        elif op == "drop" and len(reuse.chains):
            engine.drop_chain(rng.choice(sorted(reuse.chains.idle)))
        elif op == "abort" and live:
            engine.abort_request(rng.choice(sorted(live)))
        for out in engine.step():
            if out.finished:
                chain = live.pop(out.request_id)
                if out.outputs[0].finish_reason != "abort":
                    history[chain] = list(out.prompt_token_ids) + out.outputs[0].token_ids
        holders = np.zeros(m.num_pages, dtype=np.int64)
        for row in m.live_rows:
            for layer in range(m.layout.num_layers):
                np.add.at(holders, m.pages_of(row, layer), 1)
        if prefix:
            for block in reuse.prefix.blocks.values():
                np.add.at(holders, block.pages, 1)
            reuse.prefix.check()
        assert (m.allocator.refcounts(np.arange(m.num_pages)) == holders).all()
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.reuse.chain_hits and stats.reuse.chain_misses
    assert not prefix or (stats.reuse.prefix.hits and stats.num_preemptions)
    engine.release_idle()
    assert engine.stats().free_pages == m.num_pages
    assert set(m.live_rows) <= {engine.controller._pad_row}  # the decode padding row (compiled decode) holds nothing
    assert m.storage is None or not m.storage.held_rows


ROW_REUSE = {"kvzip": {"budget": 24}, "h2o+kivi": {"budget": 24, "residual": 8, "group_size": 4},
             "snapkv+kivi": {"budget": 24, "window": 4, "residual": 8, "group_size": 4}}


def _conversations(seed: int) -> list[tuple]:
    """A random script: new conversations, continuations, forks, and throwaway prompts (``junk``) to abort after 1-3
    engine steps, mid-prompt or mid-decode."""
    rng = np.random.default_rng(seed)
    ops, chains = [], 0
    for _ in range(14):
        op = rng.choice(["new", "continue", "continue", "fork", "junk", "junk"])
        if op == "new" or chains == 0:
            ops.append(("new", f"c{chains}", rng.integers(3, 90, int(rng.integers(4, 20))).tolist()))
            chains += 1
        elif op == "continue":
            extra = rng.integers(3, 90, int(rng.integers(1, 12))).tolist()
            ops.append(("continue", f"c{int(rng.integers(0, chains))}", extra))
        elif op == "fork":
            ops.append(("fork", f"c{int(rng.integers(0, chains))}", f"c{chains}"))
            chains += 1
        else:
            ops.append(("junk", int(rng.integers(1, 4)), rng.integers(3, 90, int(rng.integers(9, 40))).tolist()))
    return ops


def _outputs(method: str, ops: list[tuple], aborts: bool) -> list[list[int]]:
    """Each conversation request's tokens, run one at a time (``aborts``: with the throwaway prompts)."""
    _, model = tiny_pair()
    llm = LLM(model, method, tokenizer=DigitTokenizer(), num_pages=200, max_model_len=120, max_num_seqs=3,
              max_num_batched_tokens=16, page_size=4, prefill_chunk_size=8, max_idle_chains=8, **ROW_REUSE[method])
    engine, history, outs = llm.llm_engine, {}, []

    def finish() -> dict:
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return done

    for k, (op, arg, ids) in enumerate(ops):
        if op == "junk":
            if aborts:
                engine.add_request(f"j{k}", ids, SamplingParams(temperature=0, max_tokens=2))
                for _ in range(arg):
                    engine.step()
                if engine.has_unfinished_requests():
                    engine.abort_request(f"j{k}")
                finish()
        elif op == "fork":
            if arg in history and arg in engine.reuse.chains.idle:
                engine.fork_chain(arg, ids)
                history[ids] = list(history[arg])
        else:
            prompt = ids if op == "new" else history.get(arg, []) + ids
            if len(prompt) + 6 <= 118:
                engine.add_request(f"r{k}", prompt, SamplingParams(temperature=0, max_tokens=6), chain_id=arg)
                out = finish()[f"r{k}"]
                history[arg] = list(out.prompt_token_ids) + out.outputs[0].token_ids
                outs.append(out.outputs[0].token_ids)
    return outs


@pytest.mark.parametrize("method, seed", [("kvzip", 0), ("kvzip", 17), ("h2o+kivi", 1), ("h2o+kivi", 5),
                                          ("snapkv+kivi", 0)])
def test_aborted_prompts_leave_nothing_to_a_rows_next_owner(method: str, seed: int) -> None:
    """Row ids are reused: a prompt aborted between its chunks (engine steps) must leave no per-row state to the
    row's next owner, often a fork. Conversations (new, continued, forked) run one request at a time, once alone and
    once with throwaway prompts aborted after 1-3 steps in between: every conversation request gets the same
    tokens. Before 2026-12-04 (fifteenth session) KVzip kept an aborted prompt's ids for its re-read and h2o+kivi
    its full-precision chunks (memory held past the row: ~4 GiB for a 32K prompt on the 8B shape), and a fork that
    took the row re-read or attended them with its next prompt: 8 and 13 of seeds 0-39 diverged (these among them).
    After the fix, seeds 0-39 of kvzip, kvzip+kivi, h2o, h2o+kivi, snapkv+kivi, streamingllm+kivi, pyramidkv, kivi and
    vanilla all agree."""
    ops = _conversations(seed)
    assert _outputs(method, ops, aborts=True) == _outputs(method, ops, aborts=False)
