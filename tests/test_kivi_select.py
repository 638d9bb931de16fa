"""``quest+kivi``: Quest's page selection over KIVI pages, its bounds from the key groups' own ranges. Each decode
step's attention against an independent simulation (KIVI's floats, Quest's formula over them, its top-k, softmax over
the chosen pages and the residual), the budget and the tokens-read statistics, equality with ``kivi`` when the
budget covers everything, memory, and the option errors."""

from __future__ import annotations

import pytest
import torch
from test_kivi import KV_HEADS, LAYERS, Q_HEADS, expected_state, make, run
from tiny_models import left_padded_batch, tiny_config, tiny_pair

import sparsecompile
from sparsecompile.config import MethodConfigError
from sparsecompile.kernels.library import triton_available
from sparsecompile.methods import method_class

GQA = Q_HEADS // KV_HEADS


def _expected_output(model, spec, layer, n, P, budget):
    """The step's attention (query at position ``n - 1``, ``n`` tokens held, every one kept in order) per query head
    ``[Q_HEADS, D]``, and the slots it read per KV head: KIVI's floats of the ``Q(n - 1)`` quantized slots, the
    rest in full precision; per KV head the residual, the boundary page's quantized slots and Quest's top pages among
    the wholly quantized ones (scores: max over the GQA group of ``sum_c max(q_c lo_c, q_c hi_c)`` over the page's
    floats), as many as fit the budget."""
    q_before = int(spec.quantized(n - 1))
    pos = torch.arange(n)[None].expand(KV_HEADS, -1)
    k_old, v_old = expected_state(model, spec, layer, pos[:, :n - 1])
    k = torch.cat([k_old[:, :q_before], model.keys[layer][:, q_before:n]], 1)
    v = torch.cat([v_old[:, :q_before], model.values[layer][:, q_before:n]], 1)
    queries = model.queries[layer, :, n - 1]  # [Q_HEADS, D]
    full = q_before // P
    always = n - full * P
    take = full if n <= budget else min(full, max(0, (budget - always) // P))
    out, read = torch.empty(Q_HEADS, k.shape[-1]), []
    for h in range(KV_HEADS):
        pages = k[h, :full * P].view(full, P, -1)
        lo, hi = pages.amin(1), pages.amax(1)  # [full, D]
        group = queries[h * GQA:(h + 1) * GQA]  # [GQA, D]
        scores = torch.maximum(group[:, None] * lo, group[:, None] * hi).sum(-1).amax(0)  # [full]
        if take < full:  # separated scores: the expected set is unambiguous
            ranked = torch.sort(scores, descending=True).values
            assert ranked[take - 1] - ranked[take] > 1e-4
        chosen = sorted(torch.topk(scores, take).indices.tolist())
        slots = [p * P + o for p in chosen for o in range(P)] + list(range(full * P, n))
        read.append(len(slots))
        for qh in range(h * GQA, (h + 1) * GQA):
            out[qh] = torch.softmax(k[h, slots] @ queries[qh] * 0.25, 0) @ v[h, slots]
    return out, read


@pytest.mark.parametrize("page_size,budget", [(4, 24), (8, 28)])
def test_decode_reads_the_top_pages_by_the_groups_ranges_and_the_residual(page_size, budget):
    """Prompts of 45 / 30 tokens, groups of 4, residual 8: pages of one group (P = 4) and of two (P = 8, where the
    page holding the quantized / residual boundary is always read). Every decode step's attention, in both layers,
    equals the simulation; ``kv_stats`` reports the slots the last step read."""
    controller, model = make("quest+kivi", page_size=page_size, bits=2, group_size=4, residual=8, budget=budget,
                             dense_layers=0, dense_below=0)
    spec, P = controller.runtime.storage, controller.layout.page_size
    assert P == page_size and spec.dense_history  # every token stays: the kernels may skip the positions
    lengths = [45, 30]
    for step, rows in enumerate(run(controller, model, lengths, 7)):
        if step == 0:
            continue
        for layer in range(LAYERS):
            out = model.outputs[-LAYERS + layer]  # [B, 1, Hq, D]
            for i, row in enumerate(rows):
                n = lengths[i] + step
                want, read = _expected_output(model, spec, layer, n, P, budget)
                assert max(read) <= budget or n <= budget
                torch.testing.assert_close(out[i, 0], want, atol=1e-5, rtol=1e-5)
                assert controller.runtime.reads.read[row, layer] == sum(read)


def test_budget_covering_everything_equals_kivi_alone():
    """A budget above every sequence: the same tokens as ``kivi`` (its quantized paths active: residual 8)."""
    ids, mask = left_padded_batch((33, 21, 14), seed=3)
    outs = []
    for method, options in (("kivi", {}), ("quest+kivi", dict(budget=512, dense_layers=0, dense_below=0))):
        _, model = tiny_pair("llama", seed=5)
        sparsecompile.optimize(model, method, bits=2, group_size=8, residual=8, **options)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
    assert torch.equal(outs[0], outs[1])


def test_resident_bytes_are_kivis_and_reads_stay_within_the_budget():
    ids, mask = left_padded_batch((60, 47), seed=4)
    stats = {}
    for method, options in (("kivi", {}), ("quest+kivi", dict(budget=32, dense_layers=1, dense_below=0))):
        _, model = tiny_pair("qwen2", seed=6, num_hidden_layers=3)
        sparsecompile.optimize(model, method, bits=4, group_size=8, residual=8, page_size=8, **options)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             return_dict_in_generate=True)
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        stats[method] = sparsecompile.kv_stats(cache)
        cache.release()
    quest, kivi = stats["quest+kivi"], stats["kivi"]
    assert [layer.resident_bytes for layer in quest.layers] == [layer.resident_bytes for layer in kivi.layers]
    assert quest.metadata_bytes == 0  # no key bounds of its own: the groups' scales and zeros are the bounds
    rows, heads = 2, tiny_config("qwen2").num_key_value_heads
    assert quest.layers[0].tokens_read == quest.layers[0].resident_tokens  # dense_layers=1
    for layer in quest.layers[1:]:
        assert layer.tokens_read <= rows * heads * 32 < layer.resident_tokens


def test_options_and_refusals():
    _, model = tiny_pair("llama")
    with pytest.raises(MethodConfigError, match=r"pass budget >= 28 \(residual \+ group_size"):
        sparsecompile.optimize(model, "quest+kivi", budget=27, group_size=4, residual=8, page_size=16, dense_layers=0)
    with pytest.raises(MethodConfigError, match="quest_page_size=8 differs from the engine page_size=16"):
        sparsecompile.optimize(model, "quest+kivi", budget=64, group_size=16, residual=16, quest_page_size=8,
                              dense_layers=0)
    with pytest.raises(MethodConfigError, match="scoring the dense pool's keys.*quest\\+kivi"):
        method_class("omnikv+kivi")
    assert "quest+kivi" in sparsecompile.available_methods()


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_decode_through_the_triton_kernels_equals_the_reference(monkeypatch):
    """The engine's selections through the CUDA launcher (the Triton kernels under the interpreter, fp32; the Gluon
    kernel needs an sm_90 GPU: tests/gpu/test_kivi_cuda.py): head dim 64 (the kernels' chunks), pages of two key
    groups (the boundary page read beside the chosen ones); the same tokens and logits as the torch reference."""
    import sparsecompile.runtime.kivi_view as view
    from sparsecompile.kernels.kivi_attention import kivi_decode_attention_triton

    ids, mask = left_padded_batch((70, 41), seed=3)
    runs, selected = [], []
    for launch in (None, kivi_decode_attention_triton):
        if launch is not None:
            monkeypatch.setattr(view, "kivi_decode_attention",
                                lambda *args, run=launch: selected.append(args[18] is not None) or run(*args))
        _, model = tiny_pair("llama", seed=2, head_dim=64, hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2)
        sparsecompile.optimize(model, "quest+kivi", budget=64, dense_layers=0, dense_below=0, bits=2, group_size=16,
                               residual=16, page_size=32)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        runs.append((out.sequences, torch.stack(out.scores)))
    assert selected and all(selected)  # every decode call read a selection (dense_layers=0, dense_below=0)
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=1e-5, rtol=1e-5)
