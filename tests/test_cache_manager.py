"""CacheManager device operations: writes, views, physical eviction (compaction frees pages),
logical selection (views over a subset, nothing freed), growth keeping contents; KV statistics."""

from __future__ import annotations

import numpy as np
import torch

from sparsecompile.kernels import gather_slots, paged_attention
from sparsecompile.runtime.cache_manager import CacheManager, KVLayout
from sparsecompile.runtime.memory_oracle import DenseMemoryOracle
from sparsecompile.runtime.stats import collect
from sparsecompile.runtime.step import StepState
from sparsecompile.runtime.view import PageSelection, SlotSelection

L, H, D, P = 2, 2, 8, 4


def _filled(lengths=(10, 7)):
    """A manager with one row per prompt, every token written (positions 0..n-1)."""
    m = CacheManager(KVLayout(L, H, D, P, torch.float32, torch.device("cpu")), 16, 4, 8)
    rows = [m.add_sequence() for _ in lengths]
    width = max(lengths)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    positions = torch.arange(width).expand(len(lengths), -1)
    step = StepState.build(rows, valid, positions, is_prefill=True, is_last_chunk=True, device=torch.device("cpu"))
    m.ensure_slots(rows, np.array([[n] * L for n in lengths]))
    m.flush()
    keys = torch.randn(len(lengths), H, width, D)
    for layer in range(L):
        m.write(layer, step, keys + layer, keys - layer)
    return m, rows, step, keys


def test_write_then_dense_view_reads_every_token():
    m, rows, step, keys = _filled()
    for row, n in zip(rows, (10, 7)):
        assert [p.tolist() for p in m.retained_positions(row, 1)] == [list(range(n))] * H
    view = m.build_view(1, step)
    assert view.block_size == P and view.lengths.tolist() == [[10, 10], [7, 7]]
    q = torch.randn(2, H, 1, D)
    out = paged_attention(q, view.k_pool, view.v_pool, view.pos_pool, view.index, view.lengths,
                          torch.tensor([[9], [6]]), view.block_size, 1.0, 0)
    for b, n in enumerate((10, 7)):
        k = keys[b, :, :n] + 1
        want = torch.softmax(q[b, :, 0, None] @ k.transpose(1, 2), -1) @ (keys[b, :, :n] - 1)
        torch.testing.assert_close(out[b, 0], want[:, 0])


def test_compaction_is_physical_eviction():
    m, rows, step, keys = _filled()
    free_before = m.allocator.num_free
    keep = torch.tensor([[[0, 3, 8], [1, 2, 9]], [[0, 5, 6], [2, 3, 4]]])  # per row, per head, ascending
    m.move_slots(0, step.rows, keep, torch.arange(3).expand_as(keep))  # kept slots to the front, in order
    for row in rows:
        m.truncate(row, 0, 3)
    m.flush()
    assert m.allocator.num_free == free_before + (3 - 1) + (2 - 1)  # 10 -> 3 slots, 7 -> 3 slots
    assert [p.tolist() for p in m.retained_positions(rows[0], 0)] == [[0, 3, 8], [1, 2, 9]]
    assert [p.tolist() for p in m.retained_positions(rows[1], 0)] == [[0, 5, 6], [2, 3, 4]]
    slots, _ = m.resident_slot_ids(0, step.rows, 3)
    got = gather_slots(m.k_pool, slots[:, None, :].expand(-1, H, -1))
    want = torch.stack([keys[b, h, keep[b, h]] for b in range(2) for h in range(H)]).view(2, H, 3, D)
    torch.testing.assert_close(got, want)
    assert [p.tolist() for p in m.retained_positions(rows[0], 1)] == [list(range(10))] * H  # other layer untouched


def test_selection_is_logical_only():
    m, rows, step, _ = _filled()
    free_before = m.allocator.num_free
    slots = SlotSelection(torch.tensor([[[0, 4], [9, 1]], [[6, 0], [3, 3]]]), torch.tensor([[2, 2], [1, 2]]))
    view = m.build_view(0, step, slots)
    assert view.block_size == 1
    pos = gather_slots(m.pos_pool, view.index.long())
    assert pos[0].tolist() == [[0, 4], [9, 1]] and view.lengths.tolist() == [[2, 2], [1, 2]]
    pages = m.build_view(0, step, PageSelection(torch.tensor([[[2, 0]] * H, [[1, 0]] * H]),
                                                torch.tensor([[6, 6], [7, 7]])))
    assert pages.index[0, 0].tolist() == [m.pages_of(rows[0], 0)[2], m.pages_of(rows[0], 0)[0]]
    assert m.allocator.num_free == free_before


def test_grow_keeps_contents():
    m, rows, step, keys = _filled()
    before = [m.retained_positions(r, 1) for r in rows]
    k_before = m.k_pool[: m.num_pages].clone()
    m.grow(40, 8, 16)
    assert m.num_pages == 40 and m.block_table.shape == (8, L, 16)
    assert torch.equal(m.k_pool[:16], k_before)
    for r, b in zip(rows, before):
        assert [p.tolist() for p in m.retained_positions(r, 1)] == [p.tolist() for p in b]


def test_stats_match_formula():
    m, rows, _, _ = _filled()
    stats = collect(m, rows, "vanilla")
    assert [s.resident_tokens for s in stats.layers] == [(10 + 7) * H] * L
    assert stats.resident_bytes == L * (10 + 7) * H * D * 2 * 4
    assert stats.allocated_pages == L * (3 + 2) and stats.free_pages == 16 - L * 5


def test_dense_memory_oracle():
    layout = KVLayout(3, 2, 8, 4, torch.float32, torch.device("cpu"))
    oracle = DenseMemoryOracle(layout)
    assert oracle.admission_cost(10, 6) == {"kv_pages": 3 * 4}
    assert oracle.step_cost(10, 5, 1) == {"kv_pages": 0} and oracle.step_cost(10, 6, 1) == {"kv_pages": 3}
    assert oracle.fits({"kv_pages": 12}, oracle.resources(12)) and not oracle.fits({"kv_pages": 13}, {"kv_pages": 12})


def test_flush_sends_each_rows_changes_once_and_the_device_table_matches_the_host():
    m = CacheManager(KVLayout(L, H, D, P, torch.float32, torch.device("cpu")), 64, 4, 16)  # 16 pages a row-layer
    a, b = m.add_sequence(), m.add_sequence()
    m.ensure_slots([a, b], np.array([[4] * L, [4] * L]))
    m.flush()
    sent = []
    original = m._entries_to_send

    def spy():
        entries = original()
        sent.append(entries.copy())
        return entries

    m._entries_to_send = spy
    c = m.add_sequence()  # a new row: its whole table row goes, so its entries do not
    # a: 1 new page a layer (2 entries); b: 14 a layer (28 entries: 8 int32 each > the 2 x 16 of its table row)
    m.ensure_slots([a, b, c], np.array([[8] * L, [60] * L, [12] * L]))
    m.flush()
    assert sorted(set(sent[-1][:, 0].tolist())) == [a] and len(sent[-1]) == L  # b and c went as table rows
    assert torch.equal(m.block_table[[a, b, c]], torch.from_numpy(m._host_table[[a, b, c]]))
    assert m.lengths[[a, b, c]].tolist() == [[8] * L, [60] * L, [12] * L]
