"""``h2o+kivi``: H2O over KIVI storage evicts whole quantized key groups during decode (``methods/kivi_heavy.py``).

Checked against the group rule's own formula at every eviction (per KV head, the lowest summed score among the
quantized groups outside the recent window, from the state just before it), for the property that makes it a
composition with KIVI (survivors' dequantized K/V and scores are bit for bit unchanged: groups move whole, the ring
turns), against ``h2o`` alone where both must agree (the prompt's kept tokens; the scores when nothing is quantized),
and for the memory it holds (the oracle, the bound, pages in use)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kivi_checks import assert_quantized_once
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

import sparsecompile
from sparsecompile.config import MethodConfigError
from sparsecompile.kernels.kivi_reference import kivi_view_kv
from sparsecompile.methods.h2o import SCORE
from sparsecompile.methods.kivi_heavy import GroupEvictionMixin
from sparsecompile.models.hf_patch import patched_model

BUDGET, RECENT, GROUP, RESIDUAL, PAGE = 96, 32, 16, 32, 16
OPTIONS = dict(budget=BUDGET, recent=RECENT, bits=4, group_size=GROUP, residual=RESIDUAL, page_size=PAGE,
               compile=False)
LENGTHS = (150, 139)  # left-padded rows reach budget + group at different steps


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama")).eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    width = max(LENGTHS)
    ids = torch.randint(3, 90, (len(LENGTHS), width), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate(LENGTHS):
        ids[i, : width - n] = 0
        mask[i, : width - n] = 0
    return ids, mask


def _state(manager) -> dict:
    """(row, layer) -> per KV head: ``{position: (K, V, score, quantized)}`` (dequantized K/V), plus each head's
    slot order as a list of positions, read through the host tables."""
    st, lay = manager.storage, manager.layout
    score_pool = manager.slot_metadata[SCORE]
    out = {}
    for row in manager.live_rows:
        for layer in range(lay.num_layers):
            count = int(manager.slot_counts(row)[layer])
            table = torch.as_tensor(manager._host_table[row, layer])
            index = table[None, None, :].expand(1, lay.num_kv_heads, -1)
            quantized = int(st.spec.quantized(torch.tensor([count])))
            k, v, pos, _ = kivi_view_kv(*st.page_tensors(), manager.pos_pool, st.ring_k, st.ring_v,
                                        torch.tensor([row * lay.num_layers + layer]), index,
                                        torch.full((1, lay.num_kv_heads), count), torch.tensor([quantized]), count)
            j = torch.arange(count)
            scores = score_pool[table[j // PAGE].long(), :, j % PAGE]  # [count, kv_heads]
            heads = []
            for h in range(lay.num_kv_heads):
                order = pos[0, h].tolist()
                heads.append(({p: (k[0, h, s].clone(), v[0, h, s].clone(), scores[s, h].clone(), s < quantized)
                               for s, p in enumerate(order)}, order, scores[:, h].clone(), quantized))
            out[row, layer] = heads
    return out


def _scores(manager) -> dict:
    """(row, layer, head) -> {position: accumulated score} of the resident slots (any storage)."""
    out = {}
    for row in manager.live_rows:
        for layer in range(manager.layout.num_layers):
            table = torch.as_tensor(manager._host_table[row, layer])
            j = torch.arange(int(manager.slot_counts(row)[layer]))
            pages = table[j // PAGE].long()
            pos, value = manager.pos_pool[pages, :, j % PAGE], manager.slot_metadata[SCORE][pages, :, j % PAGE]
            for h in range(manager.layout.num_kv_heads):
                out[row, layer, h] = dict(zip(pos[:, h].tolist(), value[:, h].tolist()))
    return out


def _expected_victim(order: list[int], scores: torch.Tensor, quantized: int) -> int:
    """The rule: among quantized groups whose every position is outside the recent window, the lowest sum of
    scores (ties: the lowest group)."""
    newest = max(order)
    sums = [(scores[g * GROUP:(g + 1) * GROUP].sum().item(), g) for g in range(quantized // GROUP)
            if max(order[g * GROUP:(g + 1) * GROUP]) <= newest - RECENT]
    assert sums, "no group outside the recent window"
    return min(sums)[1]


class _Watch(LogitsProcessor):
    """Before each sampling: kept positions per (row, layer, head), and the check of any eviction the step made."""

    def __init__(self) -> None:
        self.manager, self.kept, self.before, self.checked = None, [], None, 0
        self.scores: dict = {}  # (row, layer, head) -> {position: accumulated score}, at the last call
        self.pages: tuple[int, int] = (0, 0)  # pages in use, and those the slot counts need, at the last call

    def __call__(self, input_ids, scores):
        m = self.manager
        m.flush()
        self.kept.append({(r, layer): [p.tolist() for p in m.retained_positions(r, layer)]
                          for r in m.live_rows for layer in range(m.layout.num_layers)})
        self.scores = _scores(m)
        need = sum(-(-max(c, BUDGET + GROUP if c > BUDGET else 0) // PAGE) for r in m.live_rows
                   for c in m.slot_counts(r))
        self.pages = (m.allocator.num_pages - m.allocator.num_free, need)
        if self.before is not None:
            self._check(self.before, _state(m))
            self.before = None
        return scores

    def _check(self, before: dict, after: dict) -> None:
        for key, heads in after.items():
            for h, (now, _, _, _) in enumerate(heads):
                was, order, scores, quantized = before[key][h]
                if set(now) == set(was):
                    continue  # this pair did not evict at this step
                victim = _expected_victim(order, scores, quantized)
                gone = set(order[victim * GROUP:(victim + 1) * GROUP])
                assert set(now) == set(was) - gone, (key, h)
                for p, (k, v, score, _) in now.items():  # survivors: the same bits, the same score
                    assert torch.equal(k, was[p][0]) and torch.equal(v, was[p][1]) and torch.equal(score, was[p][2])
                self.checked += 1


def test_decode_evicts_the_formulas_group_and_never_requantizes(monkeypatch):
    model = _model()
    sparsecompile.optimize(model, "h2o+kivi", **OPTIONS)
    controller = patched_model(model).controller
    watch = _Watch()
    real = GroupEvictionMixin._evict_groups

    def spy(self, manager, step, layers, at, counts):
        if not watch.checked and watch.before is None:
            # scores that differ in every layer, row and head (a random model's accumulated scores rank the groups
            # alike everywhere): a victim picked from another pair's scores or positions shows
            pool = manager.slot_metadata[SCORE]
            pool.copy_(torch.rand(pool.shape, generator=torch.Generator().manual_seed(3)) * 1000)
        if watch.before is None:
            watch.before = _state(manager)  # every layer's state before this step's evictions
        return real(self, manager, step, layers, at, counts)

    monkeypatch.setattr(GroupEvictionMixin, "_evict_groups", spy)
    ids, mask = _inputs()
    new = 60
    controller.reserve(2, max(LENGTHS), new)
    watch.manager = controller.manager
    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   logits_processor=LogitsProcessorList([watch]))
    # three evictions per (row, layer, head) for the longer row, three for the shorter, at different steps
    assert watch.checked == 2 * 2 * 2 * 3
    counts = {len(heads[0]) for kept in watch.kept[1:] for heads in kept.values()}
    assert min(counts) >= BUDGET and max(counts) <= BUDGET + GROUP - 1  # between steps: budget .. budget + G - 1
    # memory, before the last token: a pair past its budget keeps the pages of budget + G slots (it takes them back
    # before its next eviction), the others those of their slots; evicted groups' pages went back
    assert watch.pages[0] == watch.pages[1] and watch.pages[0] > 0


@pytest.mark.parametrize("chunk", [None, 64])
def test_prompt_keeps_h2os_tokens_and_scores_grow_as_h2os(chunk):
    """The prompt's eviction is H2O's, in full precision: one forward, or chunks of 64 with an eviction after each,
    the kept tokens held in full precision between chunks (the same kept positions as ``h2o`` alone with the same
    chunks); with a residual longer than the sequence nothing is quantized and the accumulated scores equal
    ``h2o``'s (the prefill's through the materialised view's pages, decode's from the KIVI kernel's logits)."""
    ids, mask = _inputs()

    def run(method, **options):
        model = _model()
        sparsecompile.optimize(model, method, **options)
        controller = patched_model(model).controller
        watch = _Watch()
        controller.reserve(2, max(LENGTHS), 12)
        watch.manager = controller.manager
        model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                       logits_processor=LogitsProcessorList([watch]))
        return watch.kept[0], watch.scores

    kept, _ = run("h2o+kivi", **OPTIONS, prefill_chunk_size=chunk)
    alone, _ = run("h2o", budget=BUDGET, recent=RECENT, page_size=PAGE, compile=False, prefill_chunk_size=chunk)
    assert kept == alone
    wide = dict(budget=200, recent=RECENT, page_size=PAGE, compile=False, prefill_chunk_size=chunk)
    _, scores = run("h2o+kivi", **wide, bits=4, group_size=GROUP, residual=176)
    _, want = run("h2o", **wide)
    assert scores.keys() == want.keys() and len(want) == 2 * 2 * 2
    for key in want:
        assert scores[key].keys() == want[key].keys()
        for p, s in want[key].items():
            assert scores[key][p] == pytest.approx(s, rel=1e-5, abs=1e-6), (key, p)


def test_chunked_prompt_is_quantized_once_from_full_precision():
    """Chunks of 64 with an eviction after each: between chunks the kept tokens stay in full precision, so after the
    prompt the stored codes are exactly KIVI's quantization of ``h2o``'s kept K/V (same chunks), group by group, and
    the residual holds its K/V bit for bit (quantizing after every chunk would store re-quantized values)."""
    ids, mask = _inputs()
    managers, outs = [], []
    for method, extra in (("h2o", {}), ("h2o+kivi", dict(bits=4, group_size=GROUP, residual=RESIDUAL))):
        model = _model()
        sparsecompile.optimize(model, method, budget=BUDGET, recent=RECENT, page_size=PAGE, compile=False,
                               prefill_chunk_size=64, **extra)
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                   return_dict_in_generate=True))  # (the output holds the cache: rows stay live)
        managers.append(patched_model(model).controller.manager)
    dense, kivi = managers
    lay = kivi.layout
    checked = 0
    for row in kivi.live_rows:
        for layer in range(lay.num_layers):
            assert kivi.slot_counts(row)[layer] == BUDGET
            checked += assert_quantized_once(dense, kivi, row, layer, 4, GROUP)
    assert checked == 2 * 2 * (BUDGET - RESIDUAL)


def test_oracle_and_bound_follow_the_groups():
    model = _model()
    sparsecompile.optimize(model, "h2o+kivi", **OPTIONS)
    controller = patched_model(model).controller
    assert controller.oracle.held_slots_per_layer(150, 500) == [BUDGET + GROUP] * 2
    assert controller.oracle.resident_slots_per_layer(150, 21) == [BUDGET + 21 % GROUP] * 2
    assert controller.runtime.decode_slot_bound() == BUDGET + GROUP


def test_conflicting_options_are_refused():
    with pytest.raises(MethodConfigError, match=r"pass budget >= 48"):  # the residual 32 (recent 20) + one group
        sparsecompile.optimize(_model(), "h2o+kivi", budget=40, group_size=GROUP, residual=RESIDUAL)
    with pytest.raises(MethodConfigError, match=r"pass budget >= 64"):  # the residual 48 + one group
        sparsecompile.optimize(_model(), "h2o+kivi", budget=60, recent=8, group_size=GROUP, residual=48)
    with pytest.raises(MethodConfigError, match="interval=4 does not apply"):
        sparsecompile.optimize(_model(), "h2o+kivi", budget=BUDGET, interval=4, group_size=GROUP)


def test_serving_evicts_groups_like_generate(monkeypatch):
    """Under continuous batching (four prompts; the shortest is kept whole and reaches ``budget + G`` at another step
    than the others, so some steps evict for part of the batch), the engine's h2o+kivi gives each prompt's
    ``generate()`` tokens and frees every page."""
    from test_llm import prompts_of, reference_tokens, tiny_llm

    from sparsecompile import SamplingParams

    batches = []  # how many of a step's rows evicted, per eviction (engine, then generate())
    real = GroupEvictionMixin._evict_groups

    def spy(self, manager, step, layers, at, counts):
        batches.append((len(np.unique(at)), len(step.row_ids)))
        return real(self, manager, step, layers, at, counts)

    monkeypatch.setattr(GroupEvictionMixin, "_evict_groups", spy)

    prompts, new = prompts_of((150, 139, 120, 80)), 50  # the 80-token prompt is kept whole: it evicts later
    options = {**OPTIONS, "compile": False}
    # 128-token steps: prompts in 64-token chunks, held in full precision between steps while other rows decode
    reference, llm = tiny_llm("h2o+kivi", max_num_batched_tokens=128, prefill_chunk_size=64, **options)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new),
                                                          use_tqdm=False)]
    stats = llm.llm_engine.stats()
    assert stats.free_pages == stats.total_pages
    assert any(n < rows for n, rows in batches)  # some steps evicted for part of the batch only
    sparsecompile.optimize(reference, "h2o+kivi", prefill_chunk_size=64, **options)
    assert outs == reference_tokens(reference, prompts, new)


def test_a_pool_sized_for_one_request_never_preempts_it():
    """The engine sizes its pool by the oracle's peak of one request (``max_num_seqs=1``); once the prompt's slots are
    measured, reservations must follow the group eviction too (``KiviMemoryOracle.resumed_*``): before, they grew a
    page per page of tokens past the budget, the engine preempted its only request and re-prefilled prompt + output,
    which H2O compresses as a new prompt (other tokens than generate())."""
    from test_llm import prompts_of, reference_tokens, tiny_llm

    from sparsecompile import SamplingParams

    prompts, new = prompts_of((150,)), 60
    options = {**OPTIONS, "compile": False}
    # chunks of one group: the prefill's peak (budget + chunk) is the decode's (budget + G), no slack in the pool
    reference, llm = tiny_llm("h2o+kivi", max_num_seqs=1, max_num_batched_tokens=64, prefill_chunk_size=GROUP,
                              **options)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new),
                                                          use_tqdm=False)]
    assert llm.llm_engine.stats().num_preemptions == 0
    sparsecompile.optimize(reference, "h2o+kivi", prefill_chunk_size=GROUP, **options)
    assert outs == reference_tokens(reference, prompts, new)
