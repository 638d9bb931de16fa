"""Ops of the eviction methods: ``snapkv_scores`` and ``h2o_accumulate`` against loop-by-loop math, ``move_slots``
(decode eviction's hole filling) against a pair-by-pair copy, their Triton kernels (interpreter on CPU) against the
torch references at toy sizes, and opcheck."""

from __future__ import annotations

import math

import pytest
import torch

from sparsecompile.kernels import (
    evict_lowest,
    evict_lowest_reference,
    h2o_accumulate,
    h2o_accumulate_logits,
    h2o_accumulate_logits_reference,
    h2o_accumulate_reference,
    move_slots,
    move_slots_reference,
    paged_attention_logits,
    snapkv_scores,
    snapkv_scores_reference,
)
from sparsecompile.kernels.library import triton_available

NUM_PAGES, HEADS, PAGE, DIM, GROUP = 10, 2, 4, 16, 3


def _pool(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_PAGES + 1, HEADS, PAGE, DIM, generator=g)
    pos = torch.randint(-1, 40, (NUM_PAGES + 1, HEADS, PAGE), generator=g, dtype=torch.int32)
    return k, pos


def _case(block_size, entries, queries, seed=0):
    """A view in which no slot appears twice for one KV head, across rows too (as real views: the CUDA
    ``h2o_accumulate`` adds without atomics, so two rows sharing a slot would race there)."""
    g = torch.Generator().manual_seed(seed + 7)
    batch = 2
    blocks = NUM_PAGES * PAGE // block_size
    assert batch * entries <= blocks, "rows take disjoint blocks of the pool"
    per_head = torch.stack([torch.randperm(blocks, generator=g)[:batch * entries] for _ in range(HEADS)])
    index = per_head.view(HEADS, batch, entries).transpose(0, 1).contiguous().to(torch.int32)
    lengths = torch.randint(0, entries * block_size + 1, (batch, HEADS), generator=g, dtype=torch.int32)
    query = torch.randn(batch, HEADS * GROUP, queries, DIM, generator=g)
    qpos = torch.randint(-1, 45, (batch, queries), generator=g)
    return query, index, lengths, qpos


def _naive_mass(query, k_pool, pos_pool, index, lengths, qpos, block_size, scale, window):
    """``{(b, qh, column): summed probability}`` and the column -> global slot map, in float64 loops."""
    batch, q_heads, queries, _ = query.shape
    mass, slot_of = {}, {}
    for b in range(batch):
        for qh in range(q_heads):
            h = qh // GROUP
            for t in range(queries):
                cols, logits = [], []
                for j in range(int(lengths[b, h])):
                    slot = int(index[b, h, j // block_size]) * block_size + j % block_size
                    slot_of[b, h, j] = slot
                    page, off = divmod(slot, PAGE)
                    p, q_p = int(pos_pool[page, h, off]), int(qpos[b, t])
                    if p < 0 or p > q_p or (window and p <= q_p - window):
                        continue
                    cols.append(j)
                    logits.append(float(k_pool[page, h, off].double() @ query[b, qh, t].double()) * scale)
                if cols:
                    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                    for j, p in zip(cols, probs.tolist()):
                        mass[b, qh, j] = mass.get((b, qh, j), 0.0) + p
    return mass, slot_of


@pytest.mark.parametrize("block_size,entries", [(PAGE, 5), (1, 17)])
@pytest.mark.parametrize("window", [0, 5])
def test_snapkv_scores_match_naive(block_size, entries, window):
    k, pos = _pool()
    query, index, lengths, qpos = _case(block_size, entries, 4)
    got = snapkv_scores(query, k, pos, index, lengths, qpos, block_size, 0.3, window)
    assert got.shape == (2, HEADS * GROUP, entries * block_size) and got.dtype == torch.float32
    mass, _ = _naive_mass(query, k, pos, index, lengths, qpos, block_size, 0.3, window)
    want = torch.zeros_like(got, dtype=torch.float64)
    for (b, qh, j), value in mass.items():
        want[b, qh, j] = value
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,entries", [(PAGE, 5), (1, 17)])
def test_h2o_accumulate_matches_naive(block_size, entries):
    k, pos = _pool(1)
    query, index, lengths, qpos = _case(block_size, entries, 3, seed=1)
    scores = torch.rand(NUM_PAGES + 1, HEADS, PAGE)
    want = scores.double().clone()
    h2o_accumulate(scores, query, k, pos, index, lengths, qpos, block_size, 0.25, 0)
    mass, slot_of = _naive_mass(query, k, pos, index, lengths, qpos, block_size, 0.25, 0)
    for (b, qh, j), value in mass.items():
        h = qh // GROUP
        page, off = divmod(slot_of[b, h, j], PAGE)
        want[page, h, off] += value / GROUP  # mean over the query group
    torch.testing.assert_close(scores.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,entries,window", [(PAGE, 5, 0), (1, 17, 5)])
def test_h2o_accumulate_logits_equals_the_key_pass(block_size, entries, window):
    """Decode: the update from the attention's logits and lse equals the one that re-reads the keys."""
    k, pos = _pool(2)
    v = torch.randn_like(k)
    query, index, lengths, qpos = _case(block_size, entries, 1, seed=2)
    lengths[0, 1] = 0  # a list with nothing to see
    args = (k, pos, index, lengths, qpos, block_size, 0.25, window)
    want = torch.rand(NUM_PAGES + 1, HEADS, PAGE, generator=torch.Generator().manual_seed(1))
    got = want.clone()
    h2o_accumulate(want, query, *args)
    _, lse, logits = paged_attention_logits(query, k, v, pos, index, lengths, qpos, block_size, 0.25, window)
    h2o_accumulate_logits(got, logits, lse, index, lengths, block_size)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_opcheck_eviction_ops():
    k, pos = _pool()
    query, index, lengths, qpos = _case(PAGE, 5, 3)
    torch.library.opcheck(torch.ops.sparsecompile.snapkv_scores.default,
                          (query, k, pos, index, lengths, qpos, PAGE, 0.25, 0))
    torch.library.opcheck(torch.ops.sparsecompile.h2o_accumulate.default,
                          (torch.zeros(NUM_PAGES + 1, HEADS, PAGE), query, k, pos, index, lengths, qpos, PAGE, 0.25, 3))
    logits = torch.randn(query.shape[0], HEADS * GROUP, 5 * PAGE)
    torch.library.opcheck(torch.ops.sparsecompile.h2o_accumulate_logits.default,
                          (torch.zeros(NUM_PAGES + 1, HEADS, PAGE), logits, logits.logsumexp(-1, keepdim=True), index,
                           lengths, PAGE))


triton_only = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@triton_only
@pytest.mark.parametrize("block_size,entries,queries,window", [(PAGE, 5, 1, 0), (1, 17, 6, 5), (PAGE, 3, 7, 0)])
def test_triton_eviction_ops_match_reference(block_size, entries, queries, window):
    from sparsecompile.kernels.h2o_scores import h2o_accumulate_triton
    from sparsecompile.kernels.snapkv_scores import snapkv_scores_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, pos = (t.to(device) for t in _pool(3))
    query, index, lengths, qpos = (t.to(device) for t in _case(block_size, entries, queries, seed=3))
    args = (k, pos, index, lengths, qpos, block_size, 1 / math.sqrt(DIM), window)
    torch.testing.assert_close(snapkv_scores_triton(query, *args), snapkv_scores_reference(query, *args),
                               atol=1e-5, rtol=1e-5)
    want, got = (torch.rand(NUM_PAGES + 1, HEADS, PAGE, generator=torch.Generator().manual_seed(0)).to(device)
                 for _ in range(2))
    h2o_accumulate_reference(want, query, *args)
    h2o_accumulate_triton(got, query, *args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@triton_only
@pytest.mark.parametrize("block_size", [PAGE, 1])
def test_triton_h2o_accumulate_logits_matches_reference(block_size):
    """Lists of up to 400 slots (two 256-position tiles), disjoint across rows, some logits and one lse -inf."""
    from sparsecompile.kernels.h2o_scores import h2o_accumulate_logits_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    pages, batch, group = 200, 2, 4
    blocks = pages * PAGE // block_size
    index = torch.stack([torch.randperm(blocks, generator=g) for _ in range(HEADS)])  # [heads, blocks]
    index = index.view(HEADS, batch, -1).transpose(0, 1).contiguous().to(torch.int32)
    lengths = torch.randint(250, blocks // batch * block_size + 1, (batch, HEADS), generator=g, dtype=torch.int32)
    lengths[1, 0] = 3
    logits = torch.randn(batch, HEADS * group, index.shape[2] * block_size, generator=g)
    logits[..., ::7] = float("-inf")
    lse = logits.logsumexp(-1, keepdim=True)
    lse[0, 1] = float("-inf")
    want = torch.rand(pages, HEADS, PAGE, generator=g)
    got = want.clone().to(device)
    h2o_accumulate_logits_reference(want, logits, lse, index, lengths, block_size)
    h2o_accumulate_logits_triton(got, *(t.to(device) for t in (logits, lse, index, lengths)), block_size)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def _move_case(seed=0, pairs=3):
    """Pools, two rows' table rows (disjoint pages) and per-(row, head) pairs with disjoint sources and
    destinations (some pairs skipped with -1)."""
    g = torch.Generator().manual_seed(seed)
    pools = [torch.randn(NUM_PAGES + 1, HEADS, PAGE, DIM, generator=g) for _ in range(2)]
    pools.append(torch.randint(0, 99, (NUM_PAGES + 1, HEADS, PAGE), generator=g, dtype=torch.int32))
    pools.append(torch.rand(NUM_PAGES + 1, HEADS, PAGE, generator=g))
    table = torch.randperm(NUM_PAGES, generator=g)[:8].reshape(2, 4).to(torch.int32)
    slots = torch.stack([torch.stack([torch.randperm(4 * PAGE, generator=g)[:2 * pairs] for _ in range(HEADS)])
                         for _ in range(2)])
    src, dst = slots[..., :pairs].clone(), slots[..., pairs:].clone()
    src[0, 1, 0] = -1  # skipped pairs
    dst[1, 0, -1] = -1
    return pools, table, src, dst


def test_move_slots_copies_each_pair_in_every_pool():
    pools, table, src, dst = _move_case()
    want = [p.clone() for p in pools]
    for b in range(2):
        for h in range(HEADS):
            for s, d in zip(src[b, h].tolist(), dst[b, h].tolist()):
                if s >= 0 and d >= 0:
                    for pool in want:
                        pool[table[b, d // PAGE], h, d % PAGE] = pool[table[b, s // PAGE], h, s % PAGE]
    move_slots(pools, table, src, dst)
    for got, expected in zip(pools, want):
        assert torch.equal(got, expected)


def test_opcheck_move_slots():
    pools, table, src, dst = _move_case(1)
    torch.library.opcheck(torch.ops.sparsecompile.move_slots.default, (pools, table, src, dst))
    torch.library.opcheck(torch.ops.sparsecompile.move_slots.default, (pools[:3], table, src[..., :0], dst[..., :0]))


@triton_only
@pytest.mark.parametrize("narrow", [1, 2, 3, 4])  # one-value pools after K and V: 1-3 in one launch, 4 in two
def test_triton_move_slots_matches_reference(narrow):
    from sparsecompile.kernels.slot_move import move_slots_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pools, table, src, dst = _move_case(2)
    pools = (pools + [torch.rand_like(pools[3]), -pools[2]])[:2 + narrow]
    pools, table, src, dst = [t.to(device) for t in pools], table.to(device), src.to(device), dst.to(device)
    want = [p.clone() for p in pools]
    move_slots_reference(want, table, src, dst)
    move_slots_triton(pools, table, src, dst)
    for got, expected in zip(pools, want):
        assert torch.equal(got, expected)


def _evict_case(seed=0, width=13, first=0, pages_per_row=4):
    """Pools ``[k, v, pos, score]`` and three rows on disjoint pages (the op writes them): counts over the budget
    (one of them past ``width``), at it, and empty; protected windows; tied scores and empty slots (position -1)
    among the resident ones."""
    g = torch.Generator().manual_seed(seed)
    pages = 3 * pages_per_row + 1
    k = torch.randn(pages, HEADS, PAGE, DIM, generator=g)
    pos = torch.randperm(pages * HEADS * PAGE, generator=g).reshape(pages, HEADS, PAGE)
    pos = torch.where(torch.rand(pos.shape, generator=g) < 0.15, -1, pos).to(torch.int32)
    scores = torch.randint(0, 4, (pages, HEADS, PAGE), generator=g).float()  # small ints: ties
    table = torch.randperm(pages, generator=g)[:3 * pages_per_row].reshape(3, pages_per_row).to(torch.int32)
    counts = torch.tensor([9, 0, min(16, pages_per_row * PAGE)], dtype=torch.int32)
    budget = torch.tensor([8, 0, 16])
    budget[2] = counts[2] - 1
    recent = torch.tensor([3, 2, 0])
    return [k, -k, pos, scores], table, counts, budget, recent, first, width


def _evicted_by_search(pools, values, table, counts, budget, recent, first, width):
    """Slot by slot: in each evicting row, the newest position of the head, the first lowest value outside its
    window and past the ``first`` leading slots, then the tail slot copied into it."""
    out = [p.clone() for p in pools]
    for b in range(table.shape[0]):
        n = min(int(counts[b]), width)
        if int(counts[b]) <= int(budget[b]):
            continue
        for h in range(HEADS):
            slots = [(int(table[b, s // PAGE]), s % PAGE) for s in range(n)]
            positions = [int(pools[2][p, h, o]) for p, o in slots]
            newest = max(positions, default=-1)
            best, victim = math.inf, 0
            for s, (p, o) in enumerate(slots):
                if s < first or (positions[s] >= 0 and positions[s] > newest - int(recent[b])):
                    continue  # protected
                if float(pools[values][p, h, o]) < best:
                    best, victim = float(pools[values][p, h, o]), s
            tail = int(counts[b]) - 1
            if victim < tail:
                for pool in out:
                    pool[table[b, victim // PAGE], h, victim % PAGE] = pool[table[b, tail // PAGE], h, tail % PAGE]
    return out


@pytest.mark.parametrize("seed,first,values", [(0, 0, 3), (1, 0, 3), (2, 3, 3), (3, 2, 2)])
def test_evict_lowest_refills_the_first_lowest_value_outside_the_protected_slots(seed, first, values):
    """H2O's victim (lowest score outside the recent window: ``values`` 3) and StreamingLLM's (the oldest position
    past the sinks: the positions are the values, 2); rows at their budget and empty rows are left alone."""
    pools, *rest = _evict_case(seed, first=first)
    want = _evicted_by_search(pools, values, *rest)
    evict_lowest(pools, values, *rest)
    assert all(torch.equal(got, expected) for got, expected in zip(pools, want))
    assert not torch.equal(want[0], _evict_case(seed, first=first)[0][0])  # something moved


def test_opcheck_evict_lowest():
    pools, *rest = _evict_case(3)
    torch.library.opcheck(torch.ops.sparsecompile.evict_lowest.default, (pools, 3, *rest))


@triton_only
@pytest.mark.parametrize("width,block,narrow", [(13, None, 2), (40, 16, 2), (40, 16, 4)])  # one tile; three tiles,
def test_triton_evict_lowest_matches_reference(width, block, narrow):  # ties across them; 4 pools: two launches
    from sparsecompile.kernels.evict_lowest import evict_lowest_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pools, table, counts, budget, recent, _, _ = _evict_case(4, pages_per_row=10)
    counts[2], budget[2] = 37, 36
    lowest_protected = pools[3].clone()  # row 2's protected slots 16-19 (past the first 16-slot tile) lowest of all
    for slot in range(16, 20):
        lowest_protected[table[2, slot // PAGE], :, slot % PAGE] = -1.0
    pools = (pools[:3] + [lowest_protected, torch.rand_like(pools[3]), -torch.rand_like(pools[3])])[:2 + narrow]
    for values, first, zero_recent in ((3, 2, False), (2, 2, True), (3, 20, True)):  # h2o; streaming; sinks
        window = recent * 0 if zero_recent else recent
        case = [[p.clone().to(device) for p in pools], values, table.to(device), counts.to(device),
                budget.to(device), window.to(device), first, width]
        want = [p.clone() for p in case[0]]
        evict_lowest_reference(want, *case[1:])
        evict_lowest_triton(*case, block=block)
        assert all(torch.equal(got.cpu(), expected.cpu()) for got, expected in zip(case[0], want))
