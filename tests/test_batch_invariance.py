"""A row's tokens do not depend on what else is batched with it: each row of a left-padded ``generate()`` batch,
prefilled in chunks, equals the row alone, for every method (H2O evicts after each chunk and KIVI quantizes the groups
a chunk completes, so a row's chunks must start at its own first token, not at the batch's first column:
``runtime/prompt_chunks.py``); and full logits of such a batch are the unpatched model's at every real token."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from method_matrix import COMPRESSING
from tiny_models import left_padded_batch, tiny_pair

import sparsecompile
from sparsecompile.methods.registry import available_methods
from sparsecompile.models.hf_patch import patched_model
from sparsecompile.runtime.prompt_chunks import prompt_chunks

LENGTHS, NEW = (37, 9, 22), 6


def test_every_method_has_a_row():
    assert set(COMPRESSING) == set(available_methods())


def _run(model, ids, mask=None):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    kept = [sparsecompile.retained_positions(cache, layer) for layer in range(2)]  # [layer][row][head]
    cache.release()
    return out.sequences[:, -NEW:], torch.stack(out.logits, 1), kept


@pytest.mark.parametrize("method", sorted(COMPRESSING))
def test_each_row_of_a_chunked_padded_batch_equals_the_row_alone(method):
    """Tokens, every step's logits and the positions each layer and head keeps: the row alone's. (Before rows were
    cut from their own first token, h2o and h2o+kivi kept other positions and kivi gave other logits.)"""
    _, model = tiny_pair("qwen2", seed=3)
    sparsecompile.optimize(model, method, page_size=4, prefill_chunk_size=8, **COMPRESSING[method])
    ids, mask = left_padded_batch(LENGTHS, seed=8)
    tokens, logits, kept = _run(model, ids, mask)
    for i, n in enumerate(LENGTHS):
        alone_tokens, alone_logits, alone_kept = _run(model, ids[i:i + 1, -n:])
        assert tokens[i].tolist() == alone_tokens[0].tolist(), (method, i)
        torch.testing.assert_close(logits[i], alone_logits[0], atol=1e-4, rtol=1e-4)
        for layer in range(2):
            assert [p.tolist() for p in kept[layer][i]] == [p.tolist() for p in alone_kept[layer][0]], (method, i)
    manager = patched_model(model).controller.manager
    assert manager.allocator.num_free == manager.num_pages


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_logits_of_a_chunked_padded_batch_are_the_unpatched_models(keep):
    reference, model = tiny_pair("llama", seed=2)
    sparsecompile.optimize(model, page_size=4, prefill_chunk_size=4)
    ids, mask = left_padded_batch((11, 2, 7), seed=5)
    want = reference(ids, attention_mask=mask).logits
    out = model(ids, attention_mask=mask, logits_to_keep=keep)
    valid = mask.bool() if keep == 0 else mask[:, -keep:].bool()
    want = want if keep == 0 else want[:, -keep:]
    assert out.logits.shape == want.shape
    torch.testing.assert_close(out.logits[valid], want[valid], atol=1e-5, rtol=1e-5)
    (out.cache if "cache" in out else out.past_key_values).release()


@given(rows=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 12)), min_size=1, max_size=5),
       chunk=st.integers(1, 9), holes=st.booleans())
@settings(max_examples=150, deadline=None)
def test_prompt_chunks_cut_each_row_from_its_own_first_token(rows, chunk, holes):
    """``prompt_chunks``: every valid token of every row exactly once, in order; a row's k-th chunk is its tokens
    ``[k * chunk, (k + 1) * chunk)`` (as alone); every row takes part in the last step; pad slots are not valid."""
    width = max(n + pad for n, pad in rows) or 1
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (n, _) in enumerate(rows):  # left padding: the widest row sets the width
        valid[i, width - n:] = True
        if holes and n > 2:  # a mask with a zero inside a row
            valid[i, width - n + 1] = False
    plan = prompt_chunks(valid, chunk)
    assert plan[-1].last and not any(p.last for p in plan[:-1])
    seen: dict[int, list[list[int]]] = {i: [] for i in range(len(rows))}
    for piece in plan:
        cols = piece.columns
        for k, i in enumerate(piece.members):
            mine = (torch.arange(width)[cols] if not piece.gathers else cols[k])[piece.valid[k]].tolist()
            assert len(mine) <= chunk
            seen[i].append(mine)
    for i in range(len(rows)):
        own = valid[i].nonzero().flatten().tolist()
        assert [c for part in seen[i] for c in part] == own  # once each, in order
        if plan[0].gathers and own:
            assert seen[i] == [own[k:k + chunk] for k in range(0, len(own), chunk)]
    if plan[0].gathers:
        assert plan[-1].members == list(range(len(rows)))
