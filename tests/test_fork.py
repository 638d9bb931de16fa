"""Cache fork (copy-on-write), crop and compress-once-ask-many (issue #15 items 1-2), on tiny random models."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import left_padded_batch, tiny_pair

import sparsecompile
from sparsecompile.models.hf_patch import patched_model

GREEDY = dict(do_sample=False, max_new_tokens=6, pad_token_id=0)
# budgets below the context so the eviction methods really evict (context 40 tokens)
COMPRESSING = {
    "vanilla": {},
    "quest": {"budget": 16, "dense_layers": 0, "page_size": 8, "dense_below": 0},
    "omnikv": {"budget": 12, "filter_layers": "0", "dense_below": 0},
    "streamingllm": {"budget": 20, "sinks": 2},
    "snapkv": {"budget": 20, "window": 4},
    "pyramidkv": {"budget": 20, "window": 4},
    "h2o": {"budget": 20, "prefill_chunk_size": 16},
}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _ask(model, cache, context, question):
    ids = torch.cat([context, question], dim=1)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, **GREEDY)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("method", sorted(COMPRESSING))
def test_two_questions_on_forks_equal_fresh_compress_then_ask(method):
    _, model = tiny_pair()
    sparsecompile.optimize(model, method, **COMPRESSING[method])
    context, q1, q2 = _ids(40, 1), _ids(5, 2), _ids(7, 3)
    fresh = []
    for q in (q1, q2):
        cache = sparsecompile.compress(model, context)
        fresh.append(_ask(model, cache, context, q))
        cache.release()
    manager = patched_model(model).controller.manager
    used_before = manager.allocator.num_used
    shared = sparsecompile.compress(model, context)
    stats = sparsecompile.kv_stats(shared).resident_tokens
    forks = [shared.fork(), copy.deepcopy(shared)]
    assert _ask(model, forks[0], context, q1) == fresh[0]
    assert _ask(model, forks[1], context, q2) == fresh[1]
    assert sparsecompile.kv_stats(shared).resident_tokens == stats  # writing to the forks never touched it
    assert _ask(model, shared, context, q1) == fresh[0]  # the original still answers as fresh
    for cache in (*forks, shared):
        cache.release()
    assert manager.allocator.num_used == used_before  # shared pages were counted, nothing leaked
    assert manager.shared_page_count() == 0


def test_query_aware_compress_keeps_the_context_only():
    _, model = tiny_pair()
    sparsecompile.optimize(model, "snapkv", budget=20, window=4)
    context, question = _ids(40, 1), _ids(4, 2)
    aware = sparsecompile.compress(model, context, question_ids=question)
    agnostic = sparsecompile.compress(model, context)
    assert aware.get_seq_length() == agnostic.get_seq_length() == 40
    for layer in range(2):
        for heads in sparsecompile.retained_positions(aware, layer):
            for positions in heads:
                assert positions.numel() <= 20 and int(positions.max()) < 40
    # the question's queries chose the kept entries, so the sets differ from the query-agnostic ones
    aware_sets = [p.tolist() for h in sparsecompile.retained_positions(aware, 0) for p in h]
    agnostic_sets = [p.tolist() for h in sparsecompile.retained_positions(agnostic, 0) for p in h]
    assert aware_sets != agnostic_sets
    assert len(_ask(model, aware, context, question)) == GREEDY["max_new_tokens"]


def test_compress_left_padded_batch_matches_generate_from_scratch():
    reference, model = tiny_pair()
    sparsecompile.optimize(model, "vanilla")
    ids, mask = left_padded_batch((13, 9, 5))
    question = _ids(3, 7).expand(3, -1)
    cache = sparsecompile.compress(model, ids, attention_mask=mask)
    full = torch.cat([ids, question], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(question)], dim=1)
    got = model.generate(full, attention_mask=full_mask, past_key_values=cache.fork(), **GREEDY)
    want = reference.generate(full, attention_mask=full_mask, **GREEDY)
    assert torch.equal(got, want)
    cache.release()


@pytest.mark.parametrize("method", ["vanilla", "quest", "omnikv"])
def test_crop_equals_never_having_seen_the_tokens(method):
    _, model = tiny_pair()
    sparsecompile.optimize(model, method, **COMPRESSING[method])
    context, extra, question = _ids(30, 1), _ids(9, 2), _ids(4, 3)
    cache = sparsecompile.compress(model, torch.cat([context, extra], dim=1))
    cache.crop(30)
    assert cache.get_seq_length() == 30
    cropped = _ask(model, cache, context, question)
    fresh = sparsecompile.compress(model, context)
    assert cropped == _ask(model, fresh, context, question)


@pytest.mark.parametrize("method", ["snapkv", "h2o", "streamingllm"])
def test_crop_is_refused_for_eviction_methods(method):
    _, model = tiny_pair()
    sparsecompile.optimize(model, method, **COMPRESSING[method])
    cache = sparsecompile.compress(model, _ids(40, 1))
    with pytest.raises(ValueError, match=f"cannot crop a {method} cache: it evicts"):
        cache.crop(30)
    with pytest.raises(TypeError, match="fork"):
        copy.copy(cache)
