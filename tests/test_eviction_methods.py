"""Eviction methods (streamingllm, snapkv, pyramidkv, h2o) on tiny models: options and errors, kept sets
against the reference formulas recomputed here from captured queries and keys, the H2O recurrence,
kept counts, physical memory, the MemoryOracle and the compiled decode step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import left_padded_batch, tiny_pair

import sparsecompile
from sparsecompile import MethodConfigError
from sparsecompile.methods import build_runtime
from sparsecompile.models.hf_patch import patched_model
from sparsecompile.runtime.controller import EngineConfig, SparseController
from sparsecompile.runtime.model_info import ModelInfo

LENGTHS = (23, 9, 17)
TOL = 1e-5


# ---------------------------------------------------------------------------------------------- helpers
def capture(model) -> list[tuple]:
    """Record ``(layer, row ids, positions, query, key, is_prefill)`` of every attention call of a patched model."""
    controller = patched_model(model).controller
    calls, attend = [], controller.attend

    def recording(layer, query, key, value, scale, window):
        step = controller.step
        calls.append((layer, list(step.row_ids), step.positions.clone(), query.clone(), key.clone(),
                      step.is_prefill))
        return attend(layer, query, key, value, scale, window)

    controller.attend = recording
    return calls


def tokens_of(calls, row: int, layer: int, prefill_only: bool = True):
    """One row's tokens at a layer: positions ``[n]``, queries ``[q_heads, n, d]``, keys ``[kv_heads, n, d]`` (the
    first generate() of a fresh model: batch row ``i`` is cache row ``i``; a chunk of a padded batch may hold only
    some of the rows)."""
    pos, qs, ks = [], [], []
    for lay, rows, positions, q, k, prefill in calls:
        if lay != layer or (prefill_only and not prefill) or row not in rows:
            continue
        i = rows.index(row)
        ok = positions[i] >= 0
        pos.append(positions[i][ok])
        qs.append(q[i][:, ok])
        ks.append(k[i][:, ok])
    return torch.cat(pos), torch.cat(qs, 1), torch.cat(ks, 1)


def generate(model, lengths=LENGTHS, new=1, seed=5):
    ids, mask = left_padded_batch(lengths, seed=seed)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True)
    return out["cache"] if "cache" in out else out["past_key_values"]


def retained(cache, layer: int) -> list[list[set[int]]]:
    return [[set(p.tolist()) for p in heads] for heads in sparsecompile.retained_positions(cache, layer)]


def check_topk(kept: set[int], scores: torch.Tensor, positions: torch.Tensor, k: int, protected: set[int]) -> None:
    """``kept`` = ``protected`` plus the top-``k`` of ``scores`` over ``positions``, up to ties within TOL."""
    assert protected <= kept
    others = kept - protected
    assert len(others) == k
    if k == 0:
        return
    kth = scores.sort(descending=True).values[k - 1]
    by_pos = dict(zip(positions.tolist(), scores.tolist()))
    assert all(by_pos[p] >= kth - TOL for p in others)  # nothing kept below the k-th score...
    assert {p for p, s in by_pos.items() if s > kth + TOL} <= others  # ...nothing clearly above it dropped


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("method,options,match", [
    ("snapkv", {"budget": 64, "ratio": 0.5}, "exactly one of budget .* or ratio.*got both"),
    ("h2o", {}, "exactly one of budget .* or ratio.*got neither"),
    ("pyramidkv", {"ratio": 0.0}, r"ratio must be in \(0, 1\]"),
    ("streamingllm", {"ratio": 1.5}, r"ratio must be in \(0, 1\]"),
    ("snapkv", {"budget": 16}, "budget=16 is smaller than window=32.*pass budget >= 32"),
    ("pyramidkv", {"budget": 8, "window": 9}, "smaller than window=9"),
    ("streamingllm", {"budget": 4}, "budget=4 is smaller than sinks \\+ 1 = 5"),
    ("h2o", {"budget": 8, "recent": 16}, "budget=8 is smaller than recent=16"),
    ("snapkv", {"budget": 64, "kernel": 4}, "kernel must be odd"),
    ("snapkv", {"budget": 64, "pooling": "mean"}, "pooling must be 'max' or 'avg'"),
    ("h2o", {"budget": 64, "interval": 0}, "interval must be a positive integer"),
    ("pyramidkv", {"budget": 64, "beta": 0.5}, "beta must be >= 1"),
    ("snapkv", {"budget": 0}, "budget must be a positive number of tokens"),
])
def test_bad_options_are_clear_errors(method, options, match):
    _, model = tiny_pair()
    with pytest.raises(MethodConfigError, match=match):
        sparsecompile.optimize(model, method, **options)


def test_cli_flags_for_every_option():
    from sparsecompile.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--method", "pyramidkv", "--budget", "512",
                                      "--ratio", "0.25", "--window", "16", "--kernel", "5", "--pooling", "avg",
                                      "--beta", "10", "--sinks", "2", "--recent", "64", "--interval", "4"])
    got = {k: getattr(args, f"method_{k}") for k in ("budget", "ratio", "window", "kernel", "pooling", "beta",
                                                     "sinks", "recent", "interval")}
    assert got == {"budget": 512, "ratio": 0.25, "window": 16, "kernel": 5, "pooling": "avg", "beta": 10.0,
                   "sinks": 2, "recent": 64, "interval": 4}


# ---------------------------------------------------------------------------------------------- kept sets
@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_keeps_reference_topk(pooling):
    _, model = tiny_pair("llama", seed=7)
    budget, window, kernel = 12, 4, 3
    sparsecompile.optimize(model, "snapkv", budget=budget, window=window, kernel=kernel, pooling=pooling,
                           page_size=4, prefill_chunk_size=5)
    calls = capture(model)
    cache = generate(model)
    for layer in range(2):
        kept = retained(cache, layer)
        for row, n in enumerate(LENGTHS):
            pos, q, k = tokens_of(calls, row, layer)
            if n <= budget:  # a short prompt is not compressed
                assert kept[row] == [set(range(n))] * 2
                continue
            scores = _snapkv_reference(q, k, pos, window, kernel, pooling)
            for h in range(2):
                check_topk(kept[row][h], scores[h], pos[: n - window], budget - window, set(pos[n - window:].tolist()))
    cache.release()


def _snapkv_reference(q, k, pos, window, kernel, pooling):
    """SnapKV (kvpress GQA convention): ``[kv_heads, n - window]`` scores of the older prompt positions."""
    q_heads, n, dim = q.shape
    group = q_heads // k.shape[0]
    keys = k.repeat_interleave(group, 0).float()
    logits = q[:, n - window:].float() @ keys.transpose(1, 2) / math.sqrt(dim)
    causal = pos[None, :] <= pos[n - window:, None]
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)  # fp32
    s = probs[:, :, : n - window].sum(1)  # [q_heads, n - window]
    if pooling == "max":
        s = F.max_pool1d(s[None], kernel, stride=1, padding=kernel // 2)[0]
    else:
        s = F.avg_pool1d(s[None], kernel, stride=1, padding=kernel // 2, count_include_pad=True)[0]
    return s.view(k.shape[0], group, -1).mean(1)


def test_pyramidkv_layer_budgets_and_kept_sets():
    _, model = tiny_pair("llama", seed=8, num_hidden_layers=4)
    budget, window, kernel, beta, n = 13, 2, 3, 3.0, 40
    sparsecompile.optimize(model, "pyramidkv", budget=budget, window=window, kernel=kernel, beta=beta,
                           page_size=4, prefill_chunk_size=7)
    calls = capture(model)
    cache = generate(model, lengths=(n, 30))
    # kvpress formula: lo = B / beta, hi = 2B - lo (not clipped here), linear from layer 0 (hi) to the last (lo)
    lo, hi = budget / beta, 2 * budget - budget / beta
    exact = [hi - layer * (hi - lo) / 3 for layer in range(4)]
    counts = [len(retained(cache, layer)[0][0]) for layer in range(4)]
    assert sum(counts) == 4 * budget  # the mean over layers is exactly the budget
    assert all(abs(c - x) < 1 for c, x in zip(counts, exact)) and counts == sorted(counts, reverse=True)
    for layer in range(4):
        pos, q, k = tokens_of(calls, 0, layer)
        scores = _snapkv_reference(q, k, pos, window, kernel, "max")
        for h, kept in enumerate(retained(cache, layer)[0]):
            check_topk(kept, scores[h], pos[: n - window], counts[layer] - window, set(pos[n - window:].tolist()))
    cache.release()


def test_streamingllm_keeps_sinks_and_recent_through_decode():
    _, model = tiny_pair("qwen3", seed=9)
    budget, sinks, new = 10, 2, 7
    sparsecompile.optimize(model, "streamingllm", budget=budget, sinks=sinks, page_size=4, prefill_chunk_size=5)
    calls = capture(model)
    cache = generate(model, new=new)
    for row in range(len(LENGTHS)):
        seen = tokens_of(calls, row, 0, prefill_only=False)[0].tolist()  # prompt + the new-1 decoded tokens
        want = set(seen) if len(seen) <= budget else set(seen[:sinks] + seen[-(budget - sinks):])
        for layer in range(2):
            assert retained(cache, layer)[row] == [want, want]
    cache.release()


def test_ratio_budget_counts():
    _, model = tiny_pair("llama", seed=10)
    sparsecompile.optimize(model, "snapkv", ratio=0.5, window=4, page_size=4, prefill_chunk_size=6)
    cache = generate(model)
    kept = [len(heads[0]) for heads in retained(cache, 1)]
    assert kept == [max(4, n // 2) for n in LENGTHS]  # int(n * ratio), never below the window
    cache.release()


# ---------------------------------------------------------------------------------------------- H2O
DIM = 16


class ToyModel:
    """One layer, one head: token id ``t`` has key ``keys[t]`` and query ``queries[t]`` (logits are dummies)."""

    def __init__(self, controller, queries, keys):
        self.controller, self.queries, self.keys = controller, queries, keys

    def __call__(self, input_ids, inputs_embeds, position_ids, logits_to_keep):
        q, k = self.queries[input_ids][:, None], self.keys[input_ids][:, None]
        self.controller.attend(0, q, k, torch.zeros_like(k), 1.0, 0)
        return torch.zeros(*input_ids.shape, 4)


def _toy_run(method, options, queries, keys, prompt, decode, chunk=1):
    """Run a toy prompt (token ids = positions) then decode steps; retained positions after every step."""
    info = ModelInfo("toy", 1, 1, 1, DIM, ("toy",), None)
    runtime = build_runtime(method, options, info)
    controller = SparseController(runtime, 1, 1, DIM, torch.float32, torch.device("cpu"),
                                  EngineConfig(page_size=2, prefill_chunk_size=chunk, compile=False))
    controller.reserve(1, prompt, decode)
    rows = controller.add_sequences(1)
    history, commit = [], runtime.commit_step

    def recording(manager, step):
        commit(manager, step)
        history.append(set(manager.retained_positions(rows[0], 0)[0].tolist()))

    runtime.commit_step = recording
    model = ToyModel(controller, queries, keys)
    ids = torch.arange(prompt)[None]
    controller.prefill(model, rows, ids, None, ids, torch.ones_like(ids, dtype=torch.bool), 1)
    for t in range(prompt, prompt + decode):
        controller.decode(model, rows, torch.tensor([[t]]), torch.tensor([[t]]))
    return history, controller


def test_h2o_hand_worked_example():
    """B=4 with two protected recent tokens. Each query puts (almost) all its attention on the marked
    positions, so scores are counts: e.g. after position 7 the scores are {0: 3, 1: 2, 5: 2.5, 6: .5, 7: 0};
    6 and 7 are recent, 0 and 5 the heavy hitters, and 1 (an old heavy hitter) is evicted."""
    looks_at = [[0], [0], [1], [0], [1], [5], [5], [5, 6], [6], [8]]  # equal shares of each query's attention
    keys = torch.eye(DIM)
    queries = torch.stack([20 * keys[targets].sum(0) for targets in looks_at])
    history, _ = _toy_run("h2o", {"budget": 4, "recent": 2}, queries, keys, prompt=8, decode=2)
    assert history == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 3, 4}, {0, 1, 4, 5}, {0, 1, 5, 6},
                       {0, 5, 6, 7}, {0, 5, 7, 8}, {0, 5, 8, 9}]


def test_streamingllm_toy_steps():
    history, _ = _toy_run("streamingllm", {"budget": 4, "sinks": 1}, torch.randn(9, DIM), torch.randn(9, DIM),
                          prompt=6, decode=3, chunk=4)
    assert history == [set(range(4)), {0, 3, 4, 5}, {0, 4, 5, 6}, {0, 5, 6, 7}, {0, 6, 7, 8}]


@pytest.mark.parametrize("interval", [1, 3])
def test_h2o_chunked_prefill_and_decode_follow_the_recurrence(interval):
    _, model = tiny_pair("llama", seed=11)
    budget, recent, new = 9, 3, 8
    sparsecompile.optimize(model, "h2o", budget=budget, recent=recent, interval=interval, page_size=4,
                           prefill_chunk_size=6)
    calls = capture(model)
    runtime = patched_model(model).controller.runtime
    history, commit = [], runtime.commit_step

    def recording(manager, step):
        commit(manager, step)
        history.append([[[set(p.tolist()) for p in manager.retained_positions(r, layer)] for r in step.row_ids]
                        for layer in range(2)])

    runtime.commit_step = recording
    cache = generate(model, new=new)
    steps = [c for c in calls if c[0] == 0]
    assert len(steps) == len(history)
    for layer in range(2):
        for row in range(len(LENGTHS)):
            for head in range(2):
                _simulate_h2o(calls, history, layer, row, head, budget, recent, interval)
    cache.release()


def test_decode_views_cover_the_slot_bound_only(monkeypatch):
    """Decode views of a method that evicts while decoding hold only the table entries of its bound (budget plus
    one interval's slots; the table stays as wide as a chunked prefill made it): the recurrence test above checks the
    scores and kept sets over such views."""
    from sparsecompile.runtime.slot_access import SlotAccess

    widths, build = [], SlotAccess.build_view

    def recording(self, layer, step, selection=None, max_slots=None):
        view = build(self, layer, step, selection, max_slots)
        if not step.is_prefill:
            widths.append((view.index.shape[-1], self.block_table.shape[-1]))
        return view

    monkeypatch.setattr(SlotAccess, "build_view", recording)
    _, model = tiny_pair("llama", seed=11)
    sparsecompile.optimize(model, "h2o", budget=9, recent=3, page_size=4, prefill_chunk_size=6)
    assert patched_model(model).controller.runtime.decode_slot_bound() == 10
    generate(model, new=4).release()
    assert widths and all(width == 3 < table for width, table in widths), widths
    no_bound = (("h2o", {"ratio": 0.5}), ("snapkv", {"budget": 8, "window": 2}), ("vanilla", {}))
    for method, options in no_bound:
        sparsecompile.restore(model)
        sparsecompile.optimize(model, method, **options)
        assert patched_model(model).controller.runtime.decode_slot_bound() is None


def _simulate_h2o(calls, history, layer, row, head, budget, recent, interval):
    """The H2O recurrence with plain tensors: append with score 0, add each query's fp32 softmax (mean over the
    query group) over the resident visible keys, evict to ``recent`` newest + top scores; compare every step."""
    resident: dict[int, tuple[torch.Tensor, float]] = {}  # position -> (key, score)
    layer_calls = [c for c in calls if c[0] == layer]
    for step, (_, rows, positions, q, k, prefill) in enumerate(layer_calls):
        if row not in rows:  # a chunk of a padded batch without this row's tokens
            continue
        i = rows.index(row)
        ok = positions[i] >= 0
        qpos = positions[i][ok]
        q_rows = q[i][:, ok]  # [q_heads, t, d]
        group = q_rows.shape[0] // k.shape[1]
        for p, key in zip(qpos.tolist(), k[i, head][ok]):
            resident[p] = (key, 0.0)
        if not resident:  # left padding: nothing of this row yet
            assert history[step][layer][i][head] == set()
            continue
        order = sorted(resident)
        keys = torch.stack([resident[p][0] for p in order]).float()
        for t, p in enumerate(qpos.tolist()):
            visible = torch.tensor([r <= p for r in order])
            logits = q_rows[head * group:(head + 1) * group, t].float() @ keys.T / math.sqrt(keys.shape[1])
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).mean(0)
            for r, pr in zip(order, probs.tolist()):
                resident[r] = (resident[r][0], resident[r][1] + pr)
        over = len(resident) > budget if prefill else len(resident) >= budget + interval
        got = history[step][layer][i][head]
        if over:
            newest = set(order[-recent:])
            older = [r for r in order if r not in newest]
            scores = torch.tensor([resident[r][1] for r in older])
            check_topk(got, scores, torch.tensor(older), budget - recent, newest)
            resident = {r: resident[r] for r in got}  # continue from the engine's set (identical up to ties)
        assert got == set(resident), (layer, row, head, step)


# ---------------------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("method,options", [("streamingllm", {"budget": 8}), ("snapkv", {"budget": 8, "window": 2}),
                                            ("pyramidkv", {"budget": 8, "window": 2, "beta": 2}),
                                            ("h2o", {"budget": 8, "interval": 3})])
def test_memory_is_freed_and_matches_the_oracle(method, options):
    lengths, new = (40, 31), 6
    _, dense = tiny_pair("llama", seed=12)
    sparsecompile.optimize(dense, "vanilla", page_size=4)
    full = sparsecompile.kv_stats(cache := generate(dense, lengths))
    cache.release()
    _, model = tiny_pair("llama", seed=12)
    sparsecompile.optimize(model, method, page_size=4, prefill_chunk_size=8, **options)
    controller = patched_model(model).controller
    cache = generate(model, lengths, new=new)
    stats, manager = sparsecompile.kv_stats(cache), controller.manager
    tokens = sum(len(h) for layer in range(2) for row in retained(cache, layer) for h in row)
    assert stats.resident_bytes == tokens * 16 * 2 * 4  # head_dim 16, K and V, fp32
    assert stats.free_pages == manager.num_pages - stats.allocated_pages == manager.allocator.num_free
    kept = 0
    for row, n in zip(cache.rows, lengths):
        counts = manager.slot_counts(row)
        assert counts == controller.oracle.resident_slots_per_layer(n, new - 1)
        assert all(c <= p for c, p in zip(counts, controller.oracle.peak_slots_per_layer(n, new - 1)))
        kept += sum(counts)
    per_token = 2 * 16 * 2 * 4  # KV heads x head_dim x (K, V) x fp32
    assert full.resident_bytes == sum(lengths) * 2 * per_token
    assert stats.resident_bytes == kept * per_token  # e.g. (8 + 5) x 2 layers x 2 rows of (40 + 31) x 2
    oracle = controller.oracle  # decode eviction keeps the pages of budget + interval slots
    assert stats.allocated_pages == sum(oracle.pages_for(oracle.held_slots_per_layer(n, new - 1)) for n in lengths)
    assert stats.allocated_pages >= sum(math.ceil(c / 4) for r in cache.rows for c in manager.slot_counts(r))
    assert stats.allocated_pages < full.allocated_pages
    cache.release()
    assert manager.allocator.num_free == manager.num_pages


def test_oracle_formulas():
    from sparsecompile.runtime.cache_manager import KVLayout

    layout = KVLayout(2, 2, 16, 4, torch.float32, torch.device("cpu"))
    info = ModelInfo("toy", 2, 4, 2, 16, ("a", "b"), None)
    h2o = build_runtime("h2o", {"budget": 100, "interval": 8}, info).memory_oracle(layout)
    assert h2o.peak_slots_per_layer(1000, 0) == [1000, 1000]  # chunk size unknown: the whole prompt
    h2o.prefill_chunk = 256
    assert h2o.peak_slots_per_layer(1000, 0) == [356, 356] and h2o.peak_slots_per_layer(1000, 50) == [356, 356]
    assert h2o.resident_slots_per_layer(1000, 0) == [100, 100]
    assert h2o.resident_slots_per_layer(1000, 7) == [107, 107] and h2o.resident_slots_per_layer(1000, 8) == [100] * 2
    assert h2o.resident_slots_per_layer(50, 57) == [107, 107] and h2o.resident_slots_per_layer(50, 58) == [100] * 2
    snap = build_runtime("snapkv", {"budget": 100}, info).memory_oracle(layout)
    assert snap.peak_slots_per_layer(1000, 30) == [1000, 1000] and snap.resident_slots_per_layer(1000, 30) == [130] * 2
    assert snap.admission_cost(1000, 30) == {"kv_pages": 2 * 250} and snap.step_cost(1000, 0, 1) == {"kv_pages": 2}
    pyr = build_runtime("pyramidkv", {"budget": 100, "window": 4, "beta": 4}, info).memory_oracle(layout)
    assert pyr.resident_slots_per_layer(1000, 0) == [175, 25]
    stream = build_runtime("streamingllm", {"ratio": 0.1}, info).memory_oracle(layout)
    assert stream.resident_slots_per_layer(1000, 500) == [100, 100] and stream.peak_slots_per_layer(90, 5) == [90] * 2


# ---------------------------------------------------------------------------------------------- compile
@pytest.mark.slow
def test_h2o_compiled_decode_equals_eager_one_graph():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, eager = tiny_pair("llama", seed=6)
    _, model = tiny_pair("llama", seed=6)
    options = dict(budget=8, recent=3, page_size=4)
    sparsecompile.optimize(eager, "h2o", compile=False, **options)
    sparsecompile.optimize(model, "h2o", compile=True, **options)
    for length in (19, 12, 7):  # longest first: the pool grows before the decode step compiles
        ids = torch.randint(3, 96, (2, length), generator=torch.Generator().manual_seed(length))
        want = eager.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
        assert torch.equal(model.generate(input_ids=ids, max_new_tokens=10, do_sample=False), want)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    assert not counters["recompiles"]


def test_pyramid_budgets_fall_back_like_kvpress():
    from sparsecompile.methods.pyramidkv import pyramid_budgets

    assert pyramid_budgets(512, 3000, 32, 20, 30) == [512] * 30  # 512 / 20 < window: uniform
    assert pyramid_budgets(64, 50, 8, 20, 4) == [64] * 4  # prompt shorter than the budget
    out = pyramid_budgets(1000, 3000, 32, 20, 30)
    assert sum(out) == 30 * 1000 and out[0] == 1950 and out[-1] == 50 and np.all(np.diff(out) <= 0)
