"""``streamingllm+kivi``: the sliding window over KIVI storage drops whole pages (``methods/kivi_window.py``).

Checked against the window's own formula (the kept positions after every step), for the property that makes it a
composition with KIVI (a token's dequantized K/V never change once quantized: pages move whole, the ring turns),
and for the memory it frees (pages in use follow the slot counts)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

import sparsecompile
from sparsecompile.config import MethodConfigError
from sparsecompile.kernels.kivi_reference import kivi_view_kv
from sparsecompile.models.hf_patch import patched_model

BUDGET, SINKS, PAGE, RESIDUAL, PROMPT = 80, 4, 16, 32, 150
OPTIONS = dict(budget=BUDGET, sinks=SINKS, bits=4, group_size=16, residual=RESIDUAL, page_size=PAGE, compile=False)


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama")).eval()


def _expected(written: int) -> list[int]:
    """Positions the window keeps after ``written`` decode tokens: the compacted prompt (sinks + the newest), then
    a page of the oldest unpinned ones leaves whenever a layer reaches ``BUDGET + PAGE``."""
    kept = list(range(SINKS)) + list(range(PROMPT - (BUDGET - SINKS), PROMPT))
    for t in range(written):
        kept.append(PROMPT + t)
        if len(kept) >= BUDGET + PAGE:
            del kept[PAGE:2 * PAGE]  # the first unpinned page (sinks=4 < PAGE: one pinned page)
    return kept


def _snapshot(manager) -> dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, bool]]:
    """(row, layer, position) -> dequantized K, V [kv_heads, D] and whether it sat in a quantized page, from the host
    tables (the device copies are refreshed at the next step's start)."""
    st, lay = manager.storage, manager.layout
    out = {}
    for row in manager.live_rows:
        for layer in range(lay.num_layers):
            count = int(manager.slot_counts(row)[layer])
            if count == 0:
                continue
            index = torch.as_tensor(manager._host_table[row, layer])[None, None, :].expand(1, lay.num_kv_heads, -1)
            quantized = st.spec.quantized(torch.tensor([count]))
            k, v, pos, _ = kivi_view_kv(*st.page_tensors(), manager.pos_pool, st.ring_k, st.ring_v,
                                        torch.tensor([row * lay.num_layers + layer]), index,
                                        torch.full((1, lay.num_kv_heads), count), quantized, count)
            for j, p in enumerate(pos[0, 0].tolist()):
                out[row, layer, p] = (k[0, :, j].clone(), v[0, :, j].clone(), j < int(quantized))
    return out


class _Watch(LogitsProcessor):
    """Records, before each sampling, every (row, layer)'s kept positions and, at one step, the dequantized K/V."""

    def __init__(self, manager, snap_at: int) -> None:
        self.manager, self.snap_at, self.steps, self.snap = manager, snap_at, [], None

    def __call__(self, input_ids, scores):
        m = self.manager
        m.flush()  # (the page drops of the step just ended reach the device tables at the next step's start)
        self.steps.append({(r, layer): m.retained_positions(r, layer)[0].tolist()
                           for r in m.live_rows for layer in range(m.layout.num_layers)})
        if len(self.steps) == self.snap_at:
            self.snap = _snapshot(m)
        return scores


def test_window_slides_a_page_at_a_time_and_never_requantizes():
    model = _model()
    sparsecompile.optimize(model, "streamingllm+kivi", **OPTIONS)
    controller = patched_model(model).controller
    ids = torch.randint(3, 90, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    new = 70  # 69 decode tokens written: four pages leave
    watch = _Watch(None, snap_at=51)  # after 50 decode tokens; a page leaves at 64
    controller.reserve(2, PROMPT, new)  # the pool exists before generate() so the processor can read it
    watch.manager = controller.manager
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                         logits_processor=LogitsProcessorList([watch]))
    manager = controller.manager
    for step, kept in enumerate(watch.steps):  # step i: after the prompt and i decode tokens
        rows = {key: value for key, value in kept.items() if value}
        assert rows and all(value == _expected(step) for value in rows.values()), step
    assert len(_expected(new - 1)) == BUDGET + (new - 1) % PAGE  # between budget and budget + page - 1
    # tokens quantized after 50 tokens are bit for bit the same at the end, after another page left: whole pages
    # moved, the ring turned with them
    end = _snapshot(manager)
    common = [key for key, (_, _, quantized) in watch.snap.items() if quantized and key in end]
    assert len(common) == 2 * 2 * (PAGE + PAGE)  # per (row, layer): the pinned page and one that moved down
    for key in common:
        assert torch.equal(watch.snap[key][0], end[key][0]) and torch.equal(watch.snap[key][1], end[key][1]), key
    # ring slots (full precision) that stayed in the ring are unchanged too: the turn kept slot -> value
    ring = [key for key, (_, _, quantized) in watch.snap.items() if not quantized and key in end and not end[key][2]]
    assert ring and all(torch.equal(watch.snap[key][0], end[key][0]) for key in ring)
    # memory: every (row, layer) holds exactly the pages of its slots; dropped pages went back to the allocator
    held = sum(-(-c // PAGE) for r in manager.live_rows for c in manager.slot_counts(r))
    assert manager.allocator.num_pages - manager.allocator.num_free == held
    stats = sparsecompile.kv_stats(out.cache if hasattr(out, "cache") else out.past_key_values)
    assert stats.resident_tokens == 2 * 2 * 2 * len(_expected(new - 1))  # rows x layers x KV heads


def test_oracle_and_bounds_follow_the_page_window():
    model = _model()
    sparsecompile.optimize(model, "streamingllm+kivi", **OPTIONS)
    controller = patched_model(model).controller
    assert controller.oracle.held_slots_per_layer(PROMPT, 500) == [BUDGET + PAGE] * 2
    assert controller.oracle.resident_slots_per_layer(PROMPT, 21) == [BUDGET + 21 % PAGE] * 2
    assert controller.runtime.decode_slot_bound() == BUDGET + PAGE


def test_budget_below_the_window_floor_is_refused():
    with pytest.raises(MethodConfigError, match=r"pass budget >= 48"):  # one pinned page of 16 + residual 32
        sparsecompile.optimize(_model(), "streamingllm+kivi", **{**OPTIONS, "budget": 40})
