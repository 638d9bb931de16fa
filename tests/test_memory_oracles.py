"""MemoryOracles of every method, without a model: hand-computed figures, and the oracle against the pages a
real CacheManager allocates when the method's host hooks (prepare_step / commit_step, which size, evict and
truncate) run a prompt and its decode steps.

The replay skips the forward and ``finish_step`` (which only move data between slots): slot counts and pages
are decided on the host, from lengths and budgets alone, so the replay's page ledger is the engine's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecompile.methods import build_runtime
from sparsecompile.methods.eviction import EvictionMemoryOracle
from sparsecompile.methods.omnikv import OmniKVMemoryOracle
from sparsecompile.methods.pyramidkv import pyramid_budgets
from sparsecompile.methods.quest import QuestMemoryOracle
from sparsecompile.runtime.cache_manager import CacheManager, KVLayout
from sparsecompile.runtime.memory_oracle import DenseMemoryOracle, MemoryOracle
from sparsecompile.runtime.model_info import ModelInfo
from sparsecompile.runtime.step import StepState

L, KV_HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4
CPU = torch.device("cpu")


def model_info(layers: int = L) -> ModelInfo:
    return ModelInfo("toy", layers, 2 * KV_HEADS, KV_HEADS, HEAD_DIM, tuple(f"layer{i}" for i in range(layers)), None)


def layout(layers: int = L, page: int = PAGE, dtype: torch.dtype = torch.float32) -> KVLayout:
    return KVLayout(layers, KV_HEADS, HEAD_DIM, page, dtype, CPU)


def oracle(method: str, layers: int = L, page: int = PAGE, **options) -> MemoryOracle:
    return build_runtime(method, options, model_info(layers)).memory_oracle(layout(layers, page))


def pages(slots_per_layer: list[int], page: int = PAGE) -> int:
    return sum(-(-s // page) for s in slots_per_layer)


# ---------------------------------------------------------------------------------------------- replay
class Replay:
    """Page ledger of one sequence run through a method's host hooks on a real CacheManager.

    Attributes:
        prefill_peak: most pages held at once during the prompt (after a chunk's pages, before its eviction).
        resident: slot counts per layer after the prompt and after each decode step (``[generated][layer]``).
        held: pages held after the prompt and after each decode step (``[generated]``; decode eviction keeps the
            pages of ``budget + interval`` slots).
        step_pages: pages allocated by each decode step (``[generated]``, step ``g`` goes from ``g`` to ``g + 1``).
        peak: most pages held at once over the whole run.
    """

    def __init__(self, method: str, options: dict, prompt_len: int, max_new: int, *, layers: int = L,
                 page: int = PAGE, chunk: int | None = None) -> None:
        self.runtime = build_runtime(method, options, model_info(layers))
        capacity = -(-(prompt_len + max_new + 1) // page)
        self.manager = CacheManager(layout(layers, page), layers * capacity + 8, 2, capacity + 1)
        self.runtime.setup(self.manager)
        self.row = self.manager.add_sequence()
        self.prefill_peak = self.peak = 0
        chunk = chunk or prompt_len
        for start in range(0, prompt_len, chunk):
            stop = min(prompt_len, start + chunk)
            self._step(start, stop - start, is_prefill=True, is_last_chunk=stop == prompt_len)
        self.prefill_peak = self.peak
        self.resident = [self.manager.slot_counts(self.row)]
        self.held = [self.manager.allocator.num_used]
        self.step_pages = []
        for g in range(max_new):
            self.step_pages.append(self._step(prompt_len + g, 1, is_prefill=False, is_last_chunk=False))
            self.resident.append(self.manager.slot_counts(self.row))
            self.held.append(self.manager.allocator.num_used)
        self.manager.release_sequence(self.row)
        assert self.manager.allocator.num_used == 0

    def _step(self, start: int, tokens: int, *, is_prefill: bool, is_last_chunk: bool) -> int:
        """One forward's host side, as the controller runs it; returns the pages it allocated."""
        m, rows = self.manager, [self.row]
        step = StepState.build(rows, torch.ones(1, tokens, dtype=torch.bool), torch.arange(start, start + tokens)[None],
                               is_prefill=is_prefill, is_last_chunk=is_last_chunk, device=CPU)
        before = m.allocator.num_used
        m.ensure_slots(rows, m.slot_count_array(rows) + tokens)  # the controller makes room first
        allocated = m.allocator.num_used - before
        self.peak = max(self.peak, m.allocator.num_used)
        self.runtime.prepare_step(m, step)
        self.runtime.commit_step(m, step)  # eviction truncates here and frees pages
        assert m.allocator.num_used == sum(len(m.pages_of(self.row, layer)) for layer in range(m.layout.num_layers))
        if is_prefill:  # prefill keeps no spare pages
            assert m.allocator.num_used == pages(m.slot_counts(self.row), m.layout.page_size)
        return allocated


def check_against_replay(method: str, options: dict, prompt_len: int, max_new: int, *, layers: int = L,
                         page: int = PAGE, chunk: int | None = None, exact_peak: bool = True) -> Replay:
    """Every oracle answer against the replay of the same sequence."""
    o = oracle(method, layers, page, **options)
    o.prefill_chunk = chunk
    run = Replay(method, options, prompt_len, max_new, layers=layers, page=page, chunk=chunk)
    for g in range(max_new + 1):
        assert o.resident_slots_per_layer(prompt_len, g) == run.resident[g], g
        assert o.pages_for(o.held_slots_per_layer(prompt_len, g)) == run.held[g], g
    for g in range(max_new):
        assert o.step_cost(prompt_len, g, 1) == {"kv_pages": run.step_pages[g]}, g
    admission = o.admission_cost(prompt_len, max_new)["kv_pages"]
    assert admission >= run.peak
    if exact_peak:
        assert admission == run.peak
    assert o.pages_for(o.peak_slots_per_layer(prompt_len, 0)) >= run.prefill_peak
    return run


# ---------------------------------------------------------------------------------------------- dense
def test_dense_peak_is_prompt_plus_new_per_layer():
    o = DenseMemoryOracle(layout())
    assert o.peak_slots_per_layer(10, 6) == [16] * L
    assert o.resident_slots_per_layer(10, 3) == [13] * L
    assert o.admission_cost(10, 6) == {"kv_pages": 3 * 4} and o.admission_cost(10, 7) == {"kv_pages": 3 * 5}
    assert o.admission_cost(1, 0) == {"kv_pages": 3}


def test_pages_for_rounds_up_per_layer():
    o = DenseMemoryOracle(layout())
    assert o.pages_for([0, 0, 0]) == 0
    assert o.pages_for([1, 4, 5]) == 1 + 1 + 2  # not ceil(10 / 4) = 3: pages are never shared between layers
    assert o.pages_for([16, 17, 3]) == 4 + 5 + 1
    assert DenseMemoryOracle(layout(page=16)).pages_for([16, 17, 3]) == 1 + 2 + 1


def test_dense_step_cost_is_one_page_per_layer_at_page_boundaries():
    o = DenseMemoryOracle(layout())
    costs = [o.step_cost(10, g, 1)["kv_pages"] for g in range(12)]
    # resident 10 + g; the token written at slot 12, 16, 20 opens a page in each of the 3 layers
    assert costs == [0, 0, 3, 0, 0, 0, 3, 0, 0, 0, 3, 0]
    assert o.step_cost(10, 0, 7) == {"kv_pages": 3 * 2}  # a 7-token step: 10 -> 17 slots, 3 -> 5 pages
    assert o.step_cost(8, 0, 1) == {"kv_pages": 3}  # a full last page: the next token needs a new one


def test_resources_and_fits():
    o = DenseMemoryOracle(layout())
    assert o.resources(37) == {"kv_pages": 37}
    assert o.fits({"kv_pages": 37}, o.resources(37)) and not o.fits({"kv_pages": 38}, o.resources(37))
    assert not o.fits({"index_bytes": 1}, {"kv_pages": 100})  # a resource without a budget has none of it
    assert o.fits({}, {"kv_pages": 0})


@pytest.mark.parametrize("method,options,cls", [
    ("vanilla", {}, DenseMemoryOracle),
    ("quest", {"budget": 16}, QuestMemoryOracle),
    ("omnikv", {"budget": 8}, OmniKVMemoryOracle),
])
def test_full_kv_methods_answer_like_dense(method, options, cls):
    o, dense = oracle(method, **options), DenseMemoryOracle(layout())
    assert isinstance(o, cls)
    for n, new in [(1, 1), (10, 6), (37, 100), (64, 0)]:
        assert o.peak_slots_per_layer(n, new) == dense.peak_slots_per_layer(n, new)
        assert o.admission_cost(n, new) == dense.admission_cost(n, new)
        assert [o.step_cost(n, g, 1) for g in range(9)] == [dense.step_cost(n, g, 1) for g in range(9)]
    check_against_replay(method, options, 13, 10)


def test_quest_bytes_per_page():
    # page of 4 tokens x 2 KV heads x (K + V) x 8 channels; metadata: min and max key per KV head and channel
    for dtype, kv, metadata in [(torch.float16, 4 * 2 * 2 * 8 * 2, 2 * 2 * 8 * 2), (torch.float32, 512, 128)]:
        o = build_runtime("quest", {"budget": 16}, model_info()).memory_oracle(layout(dtype=dtype))
        assert o.metadata_bytes_per_page == metadata and o.bytes_per_page == kv + metadata
        assert o.admission_cost(10, 6) == {"kv_pages": 3 * 4}  # still counted in pages: the metadata rides along


def test_omnikv_index_bytes_per_sequence():
    # selected slots [width] plus prompt length, selected count and one read count per layer, all int64
    assert oracle("omnikv", budget=64).index_bytes_per_sequence(1000) == 8 * (64 + 2 + L)
    assert oracle("omnikv").index_bytes_per_sequence(1000) == 8 * (2048 + 2 + L)  # default budget
    assert oracle("omnikv", ratio=0.5).index_bytes_per_sequence(1000) == 8 * (1000 + 2 + L)  # block-table wide


# ---------------------------------------------------------------------------------------------- streamingllm, snapkv
@pytest.mark.parametrize("method,options", [("streamingllm", {"budget": 12, "sinks": 4}),
                                            ("snapkv", {"budget": 12, "window": 4})])
def test_prompt_shorter_than_budget_is_kept_whole(method, options):
    o = oracle(method, **options)
    assert o.peak_slots_per_layer(9, 0) == [9] * L and o.resident_slots_per_layer(9, 0) == [9] * L
    assert o.resident_slots_per_layer(12, 0) == [12] * L  # exactly the budget: nothing evicted
    assert o.resident_slots_per_layer(9, 2) == [11] * L


@pytest.mark.parametrize("method,options", [("streamingllm", {"budget": 12, "sinks": 4}),
                                            ("snapkv", {"budget": 12, "window": 4})])
def test_prefill_holds_the_whole_prompt_then_the_budget(method, options):
    o = oracle(method, **options)
    assert o.peak_slots_per_layer(100, 0) == [100] * L  # compaction runs after the prompt's last chunk only
    o.prefill_chunk = 16  # chunking does not change that for these methods
    assert o.peak_slots_per_layer(100, 0) == [100] * L
    assert o.resident_slots_per_layer(100, 0) == [12] * L
    assert o.admission_cost(100, 5) == {"kv_pages": 3 * 25}


def test_snapkv_decode_only_appends():
    o = oracle("snapkv", budget=12, window=4)
    assert [o.resident_slots_per_layer(100, g)[0] for g in (0, 1, 7, 50)] == [12, 13, 19, 62]
    assert o.peak_slots_per_layer(100, 200) == [212] * L  # decode outgrows the prompt
    assert o.step_cost(100, 0, 1) == {"kv_pages": 3}  # 12 slots fill 3 pages: slot 13 opens a fourth per layer
    assert o.step_cost(100, 1, 1) == {"kv_pages": 0}


def test_streamingllm_decode_stays_at_the_budget():
    # StreamingLLM drops its oldest non-sink token after every decode step that reaches budget + 1 slots,
    # so between steps a layer holds the budget and each step briefly holds one slot more.
    o = oracle("streamingllm", budget=12, sinks=4)
    assert [o.resident_slots_per_layer(100, g)[0] for g in (0, 1, 50)] == [12, 12, 12]
    assert [o.resident_slots_per_layer(9, g)[0] for g in (0, 2, 3, 4, 40)] == [9, 11, 12, 12, 12]
    assert o.peak_slots_per_layer(9, 40) == [13] * L  # budget + the step's new token
    # 12 slots = 3 full pages: the first decode step's new token opens a 4th page per layer, which the row keeps (it
    # holds 13 slots again at every later step): later steps take no page
    assert o.step_cost(100, 0, 1) == {"kv_pages": 3} and o.step_cost(100, 30, 1) == {"kv_pages": 0}
    assert [o.held_slots_per_layer(100, g)[0] for g in (0, 1, 30)] == [12, 13, 13]
    assert oracle("streamingllm", budget=13, sinks=4).step_cost(100, 30, 1) == {"kv_pages": 0}  # 14 fits 4 pages


@pytest.mark.parametrize("method,options", [
    ("streamingllm", {"budget": 12, "sinks": 4}),
    ("streamingllm", {"budget": 13, "sinks": 2}),
    ("snapkv", {"budget": 12, "window": 4}),
    ("snapkv", {"ratio": 0.3, "window": 2}),
    ("pyramidkv", {"budget": 12, "window": 2, "beta": 3}),
])
@pytest.mark.parametrize("prompt_len", [5, 12, 40])
def test_eviction_oracles_match_the_replay(method, options, prompt_len):
    check_against_replay(method, options, prompt_len, 9, exact_peak=method != "pyramidkv")
    check_against_replay(method, options, prompt_len, 9, chunk=7, exact_peak=method != "pyramidkv")


# ---------------------------------------------------------------------------------------------- ratio
@given(n=st.integers(1, 5000), ratio=st.floats(0.01, 1.0))
@settings(max_examples=60, deadline=None)
def test_ratio_budget_is_int_n_times_ratio(n, ratio):
    want = int(n * ratio)  # as kvpress rounds it
    stream = oracle("streamingllm", ratio=ratio, sinks=4)
    assert stream.resident_slots_per_layer(n, 0) == [min(n, max(want, 5))] * L  # never below sinks + 1
    snap = oracle("snapkv", ratio=ratio, window=8)
    assert snap.resident_slots_per_layer(n, 0) == [min(n, max(want, 8))] * L  # never below the window
    h2o = oracle("h2o", ratio=ratio, recent=3)
    assert h2o.resident_slots_per_layer(n, 0) == [min(n, max(want, 3))] * L


def test_ratio_figures():
    assert oracle("snapkv", ratio=0.25, window=4).resident_slots_per_layer(103, 0) == [25] * L
    assert oracle("snapkv", ratio=0.1, window=4).resident_slots_per_layer(30, 0) == [4] * L  # 3 < window
    assert oracle("h2o", ratio=0.5).resident_slots_per_layer(33, 0) == [16] * L
    assert oracle("streamingllm", ratio=0.3).resident_slots_per_layer(47, 0) == [14] * L


# ---------------------------------------------------------------------------------------------- pyramidkv
def test_pyramidkv_layer_budgets():
    # B=40, beta=4: lo = 10, hi = 70; 4 layers step by (70 - 10) / 3 = 20
    o = oracle("pyramidkv", layers=4, budget=40, window=4, beta=4)
    assert o.resident_slots_per_layer(1000, 0) == [70, 50, 30, 10]
    assert o.resident_slots_per_layer(1000, 5) == [75, 55, 35, 15]  # decode appends
    assert o.peak_slots_per_layer(1000, 5) == [1000] * 4  # the prompt is held whole until its last chunk
    assert o.peak_slots_per_layer(100, 60) == [130, 110, 100, 100]  # per layer: prompt or kept + decode
    # n=60: hi clipped to n - window = 56, lo = 80 - 56 = 24; 56, 45.33, 34.67, 24 rounded to sum 160
    assert o.resident_slots_per_layer(60, 0) == [56, 45, 35, 24]
    # n=30 < B: hi = 26 < lo = 54, every layer falls back to B and keeps the whole prompt
    assert o.resident_slots_per_layer(30, 0) == [30] * 4


@given(n=st.integers(1, 3000), budget=st.integers(4, 300), beta=st.floats(1.0, 30.0), layers=st.integers(1, 8))
@settings(max_examples=80, deadline=None)
def test_pyramidkv_mean_budget(n, budget, beta, layers):
    o = oracle("pyramidkv", layers=layers, budget=budget, window=4, beta=beta)
    kept = o.resident_slots_per_layer(n, 0)
    budgets = pyramid_budgets(budget, n, 4, beta, layers)
    assert sum(budgets) == layers * budget  # the mean over layers is the budget
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))  # layer 0 keeps the most
    assert kept == [min(n, b) for b in budgets]
    if n >= max(budgets):
        assert sum(kept) == layers * budget
    assert max(o.peak_slots_per_layer(n, 0)) == n


# ---------------------------------------------------------------------------------------------- h2o
def test_h2o_decode_interval():
    o = oracle("h2o", budget=20, interval=5)
    resident = [o.resident_slots_per_layer(100, g)[0] for g in range(12)]
    # grows to budget + interval - 1 between steps; the step that reaches budget + interval drops to the budget
    assert resident == [20, 21, 22, 23, 24, 20, 21, 22, 23, 24, 20, 21]
    assert o.peak_slots_per_layer(100, 3) == [100] * L  # no chunk size known: the whole prompt
    assert oracle("h2o", budget=20, interval=1).resident_slots_per_layer(100, 7) == [20] * L
    # short prompt: kept whole, then decode grows it until the first eviction
    assert [o.resident_slots_per_layer(10, g)[0] for g in (0, 14, 15, 16)] == [10, 24, 20, 21]


def test_h2o_chunked_prefill_peak():
    o = oracle("h2o", budget=20, interval=5)
    o.prefill_chunk = 16  # evicts after every chunk: at most budget + one chunk
    assert o.peak_slots_per_layer(100, 3) == [36] * L
    assert o.peak_slots_per_layer(100, 30) == [36] * L  # decode's transient 25 stays below
    assert o.peak_slots_per_layer(30, 0) == [30] * L  # min(prompt, budget + chunk)
    o.prefill_chunk = 2
    assert o.peak_slots_per_layer(100, 3) == [23] * L  # now decode (20 + 3) sets the peak
    assert o.peak_slots_per_layer(100, 30) == [25] * L  # budget + interval, before the eviction


@pytest.mark.parametrize("options", [{"budget": 20, "interval": 5}, {"budget": 12, "interval": 4, "recent": 2},
                                     {"budget": 9, "interval": 1}, {"ratio": 0.4, "interval": 3}])
@pytest.mark.parametrize("prompt_len,chunk", [(7, None), (50, None), (50, 16), (50, 3), (21, 8)])
def test_h2o_oracle_matches_the_replay(options, prompt_len, chunk):
    run = check_against_replay("h2o", options, prompt_len, 23, chunk=chunk, exact_peak=chunk is None)
    interval = options["interval"]
    budget = options.get("budget") or max(1, int(prompt_len * options["ratio"]))
    assert all(max(r) <= budget + interval - 1 for r in run.resident)  # between steps, never budget + interval


# ---------------------------------------------------------------------------------------------- properties
def _ids(value) -> str:
    return value if isinstance(value, str) else ",".join(f"{k}={v}" for k, v in value.items())


GROWING = [("vanilla", {}), ("quest", {"budget": 16}), ("omnikv", {"budget": 8}),
           ("snapkv", {"budget": 24, "window": 8}), ("pyramidkv", {"budget": 24, "window": 4, "beta": 3})]
EVICTING = [("streamingllm", {"budget": 24}), ("h2o", {"budget": 24, "interval": 6}),
            ("h2o", {"ratio": 0.3, "interval": 2})]


@pytest.mark.parametrize("method,options", GROWING + EVICTING, ids=_ids)
@given(n=st.integers(1, 400), steps=st.integers(0, 60), page=st.sampled_from([1, 4, 16]))
@settings(max_examples=40, deadline=None)
def test_step_costs_sum_to_held_growth(method, options, n, steps, page):
    """Held pages only grow during decode (decode eviction keeps the pages of budget + interval slots): the steps'
    costs add up to the pages gained, none is negative, and held covers resident."""
    o = oracle(method, page=page, **options)
    costs = [o.step_cost(n, g, 1)["kv_pages"] for g in range(steps)]
    assert min(costs, default=0) >= 0
    before, after = o.held_slots_per_layer(n, 0), o.held_slots_per_layer(n, steps)
    assert all(a >= b for a, b in zip(after, before))
    assert all(h >= r for h, r in zip(after, o.resident_slots_per_layer(n, steps)))
    assert sum(costs) == o.pages_for(after) - o.pages_for(before)


@pytest.mark.parametrize("method,options", GROWING + EVICTING, ids=_ids)
@given(n=st.integers(1, 400), new=st.integers(1, 60), page=st.sampled_from([1, 4, 16]))
@settings(max_examples=40, deadline=None)
def test_admission_covers_every_step(method, options, n, new, page):
    """The admission reservation covers the pages held after any step and what any step holds mid-way."""
    o = oracle(method, page=page, **options)
    admitted = o.admission_cost(n, new)["kv_pages"]
    assert o.pages_for(o.peak_slots_per_layer(n, 0)) <= admitted
    for g in range(new + 1):
        held = o.held_slots_per_layer(n, g)
        assert o.pages_for(o.resident_slots_per_layer(n, g)) <= o.pages_for(held) <= admitted
        if g < new:
            cost = o.step_cost(n, g, 1)["kv_pages"]
            assert cost >= 0 and o.pages_for(held) + cost <= admitted


@pytest.mark.parametrize("method,options", GROWING + EVICTING, ids=_ids)
@given(n=st.integers(1, 120), new=st.integers(0, 40), page=st.sampled_from([1, 4, 8]))
@settings(max_examples=12, deadline=None)
def test_oracle_matches_the_replay(method, options, n, new, page):
    check_against_replay(method, options, n, new, page=page, exact_peak=method not in ("pyramidkv",))


def test_eviction_oracle_is_what_the_runtimes_build():
    for method in ("streamingllm", "snapkv", "pyramidkv", "h2o"):
        assert isinstance(oracle(method, budget=64), EvictionMemoryOracle)


STORED = [("kivi", {"group_size": 4, "residual": 8}), ("snapkv+kivi", {"budget": 24, "window": 8, "group_size": 4,
                                                                         "residual": 8}),
          ("streamingllm+kivi", {"budget": 24, "group_size": 4, "residual": 8}),
          ("h2o+kivi", {"budget": 24, "recent": 8, "group_size": 4, "residual": 8}),
          ("kvzip+kivi", {"budget": 24, "group_size": 4, "residual": 8, "selection": "uniform"}),
          ("kvzip", {"budget": 24, "selection": "uniform"})]


@pytest.mark.parametrize("method,options", GROWING + EVICTING + STORED, ids=_ids)
def test_measured_prompt_slots_follow_the_same_formulas(method, options):
    """Serving measures a row's slots when its prompt ends and then reserves by the ``resumed_*`` formulas: given the
    model's own count they answer as the fresh-prompt ones (a KIVI composition's oracle once answered them without
    its policy's decode eviction, so h2o+kivi's reservation grew by a page per page of tokens past its budget and the
    engine preempted a lone request from a pool sized for it; and without kvzip's re-read, under-reserving)."""
    info = ModelInfo("toy", L, 2 * KV_HEADS, KV_HEADS, 16, tuple(f"layer{i}" for i in range(L)), None)
    o = build_runtime(method, options, info).memory_oracle(KVLayout(L, KV_HEADS, 16, 4, torch.float32, CPU))
    for n in (3, 20, 57, 130):
        after = o.resident_slots_per_layer(n, 0)
        for g in range(0, 70, 3):
            assert o.resumed_resident_slots(after, n, g) == o.resident_slots_per_layer(n, g), (n, g)
            assert o.resumed_held_slots(after, n, g) == o.held_slots_per_layer(n, g), (n, g)
        assert o.resumed_peak_slots([0] * L, n, n) == o.peak_slots_per_layer(n, 0) or method in ("kvzip", "kvzip+kivi")
    if "+" in method:  # the re-read's extra tokens and the chunk-wise bound come from the policy too
        for resident, suffix in (([5] * L, 40), ([30] * L, 3)):
            assert o.resumed_peak_slots(resident, 100, suffix) == o.base.resumed_peak_slots(resident, 100, suffix)


@pytest.mark.parametrize("method,options", GROWING + EVICTING + STORED, ids=_ids)
@given(lists=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 90)), min_size=1, max_size=5),
       uniform=st.booleans(), n=st.integers(1, 200), g=st.integers(0, 60), new=st.integers(1, 3))
@settings(max_examples=25, deadline=None)
def test_per_layer_shortcuts_answer_as_every_layer(method, options, lists, uniform, n, g, new):
    """The scheduler asks these per running request and step, so layers alike take a shortcut (one layer's answer
    for all) and an eviction oracle memoizes its budgets per prompt length: each answers as the layer-by-layer
    formula and as a fresh oracle (memo empty) does, for prompt lengths asked in turn and again."""
    info = ModelInfo("toy", L, 2 * KV_HEADS, KV_HEADS, 16, tuple(f"layer{i}" for i in range(L)), None)

    def build() -> MemoryOracle:
        return build_runtime(method, options, info).memory_oracle(KVLayout(L, KV_HEADS, 16, PAGE, torch.float32, CPU))

    o = build()
    resident = [lists[0][0]] * L if uniform else [lists[i % len(lists)][0] for i in range(L)]
    held = [max(r, lists[0][1]) for r in resident] if uniform else [max(r, lists[i % len(lists)][1])
                                                                    for i, r in enumerate(resident)]
    grown = [max(h, s + new) for s, h in zip(resident, held)]
    assert o.growth_cost(resident, held, new) == {"kv_pages": pages(grown) - pages(held)}
    assert o.pages_for(resident) == pages(resident)
    for m in (n, n + 37, 1 + n // 3, n, n + 37):  # the last two from the memo
        fresh = build()
        assert o.resident_slots_per_layer(m, g) == fresh.resident_slots_per_layer(m, g)
        assert o.held_slots_per_layer(m, g) == fresh.held_slots_per_layer(m, g)
        assert o.peak_slots_per_layer(m, g) == fresh.peak_slots_per_layer(m, g)
        assert o.resumed_held_slots(resident, m, g) == [fresh.resumed_held_slots([r], m, g)[0] for r in resident]
        assert o.resumed_resident_slots(resident, m, g) == [fresh.resumed_resident_slots([r], m, g)[0]
                                                              for r in resident]
