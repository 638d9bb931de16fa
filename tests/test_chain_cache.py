"""Multi-turn KV reuse in the serving engine (issue #15 items 3-5), on tiny random models:

* chain continuations equal ``generate()`` continued from the returned cache, token for token, for the eviction
  methods (their kept sets, H2O's scores and chunk-wise eviction, StreamingLLM's decode eviction all carry over);
* a continuation that does not match falls back to a fresh prefill and says why;
* prefix-cache hits equal misses (vanilla exactly; quest and omnikv select on the same KV);
* idle chains are reclaimed when memory is short, forks are independent, cancellation invalidates, and the pool
  is back to its start once everything idle is released.
"""

from __future__ import annotations

import pytest
import torch
from test_llm import DigitTokenizer, prompts_of
from tiny_models import tiny_pair

import sparsecompile
from sparsecompile import LLM, SamplingParams

T = 5  # tokens per turn
GREEDY = SamplingParams(temperature=0, max_tokens=T)
ENGINE = dict(page_size=4, prefill_chunk_size=16)
SERVING = dict(max_num_seqs=4, max_num_batched_tokens=24)
EVICTING = {  # budgets below the conversations' lengths: every turn compresses again
    "snapkv": {"budget": 20, "window": 4},
    "pyramidkv": {"budget": 20, "window": 4},
    "h2o": {"budget": 20},
    "streamingllm": {"budget": 20, "sinks": 2},
    "snapkv+kivi": {"budget": 20, "window": 4, "group_size": 16, "residual": 16},  # a chain keeps its residual ring
    # nothing evicted, but quantized, and each decode step reads the pages its scores pick (residual + one page)
    "quest+kivi": {"budget": 48, "dense_layers": 0, "dense_below": 0, "group_size": 16, "residual": 16},
}
SELECTING = {"vanilla": {}, "quest": {"budget": 16, "dense_layers": 0, "dense_below": 0},
             "omnikv": {"budget": 12, "filter_layers": "0", "dense_below": 0}}


def generate_turns(model, parts: list[list[int]], device: str = "cpu", new_tokens: int = T) -> list[list[int]]:
    """One conversation through ``generate()``: each turn's prompt is the previous prompt + its output + the next
    part, continued from the returned cache (HF feeds only the unprocessed tail)."""
    cache, ids, outs = None, None, []
    for part in parts:
        tail = torch.tensor([part], device=device)
        ids = tail if ids is None else torch.cat([ids, torch.tensor([outs[-1]], device=device), tail], dim=1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        cache = out.past_key_values
        outs.append(out.sequences[0, ids.shape[1]:].tolist())
    cache.release()
    return outs


def llm_turns(llm: LLM, conversations: list[list[list[int]]]) -> tuple[list[list[list[int]]], list]:
    """Every conversation's turns through ``llm``, all conversations batched in each turn, one chain each."""
    outs: list[list[list[int]]] = [[] for _ in conversations]
    prompts: list[list[int]] = [[] for _ in conversations]
    metrics = []
    for turn in range(len(conversations[0])):
        for i, parts in enumerate(conversations):
            prompts[i] = prompts[i] + (outs[i][-1] if outs[i] else []) + parts[turn]
        results = llm.generate(prompts, GREEDY, use_tqdm=False, chain_ids=[f"conv{i}" for i in range(len(prompts))])
        for i, o in enumerate(results):
            assert o.chain_id == f"conv{i}" and o.finished
            outs[i].append(o.outputs[0].token_ids)
        metrics.append([o.metrics for o in results])
    return outs, metrics


@pytest.mark.parametrize("method", sorted(EVICTING))
def test_chain_continuation_equals_generate_continued_from_its_cache(method):
    reference, candidate = tiny_pair()
    sparsecompile.optimize(reference, method, **ENGINE, **EVICTING[method])
    # the second turns' suffixes (last output token + part) exceed a prefill chunk: H2O evicts chunk-wise in them
    conversations = [prompts_of([30, 19, 9], seed=1), prompts_of([23, 21, 6], seed=2)]
    want = [generate_turns(reference, parts) for parts in conversations]
    llm = LLM(candidate, method, tokenizer=DigitTokenizer(), **SERVING, **ENGINE, **EVICTING[method])
    got, metrics = llm_turns(llm, conversations)
    assert got == want
    assert [m.chain_hit for m in metrics[0]] == [False, False] and metrics[0][0].chain_miss_reason == "unknown_chain"
    for turn in (1, 2):
        for i, m in enumerate(metrics[turn]):
            processed = sum(len(p) for p in conversations[i][:turn]) + turn * T - 1  # the last token was not fed
            assert m.chain_hit and m.num_cached_tokens == processed
    stats = llm.llm_engine.stats()
    assert stats.reuse.chain_hits == 4 and stats.reuse.idle_chains == 2
    suffixes = sum(len(p) + 1 for c in conversations for p in c[1:])
    assert stats.reuse.chain_suffix_tokens == suffixes and stats.prompt_tokens == suffixes + 30 + 23
    llm.llm_engine.release_idle()
    assert llm.llm_engine.stats().free_pages == stats.total_pages


def test_a_continuation_that_does_not_match_prefills_from_scratch_and_says_why():
    _, candidate = tiny_pair()
    _, fresh_model = tiny_pair()
    options = {**SERVING, **ENGINE, **EVICTING["snapkv"]}
    llm = LLM(candidate, "snapkv", tokenizer=DigitTokenizer(), **options)
    fresh = LLM(fresh_model, "snapkv", tokenizer=DigitTokenizer(), **options)
    first, extra = prompts_of([30, 8], seed=3)
    out = llm.generate([first], GREEDY, use_tqdm=False, chain_ids=["a"])[0].outputs[0].token_ids
    edited = [first[0] + 1] + first[1:] + out + extra  # the history changed (e.g. an edited system prompt)
    miss = llm.generate([edited], GREEDY, use_tqdm=False, chain_ids=["a"])[0]
    assert miss.metrics.chain_hit is False and miss.metrics.chain_miss_reason == "prefix_mismatch"
    assert miss.metrics.num_cached_tokens == 0
    assert miss.outputs[0].token_ids == fresh.generate([edited], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # the mismatching request replaced the chain: continuing the edited history hits again
    again = edited + miss.outputs[0].token_ids + extra
    assert llm.generate([again], GREEDY, use_tqdm=False, chain_ids=["a"])[0].metrics.chain_hit
    reuse = llm.llm_engine.reuse
    reuse.chains.fingerprint += 1  # as if the engine's method options had changed since
    stale = llm.generate([again + [5, 6]], GREEDY, use_tqdm=False, chain_ids=["a"])[0].metrics
    assert stale.chain_miss_reason == "fingerprint"
    reuse.chains.fingerprint -= 1
    assert llm.generate([first], GREEDY, use_tqdm=False, chain_ids=["new"])[0].metrics.chain_miss_reason == \
        "unknown_chain"
    stats = llm.llm_engine.stats().reuse
    assert stats.chain_misses == {"prefix_mismatch": 1, "fingerprint": 1, "unknown_chain": 2}


@pytest.mark.parametrize("method", sorted(SELECTING))
def test_prefix_cache_hits_equal_misses(method):
    _, candidate = tiny_pair()
    _, plain_model = tiny_pair()
    options = {**SERVING, **ENGINE, **SELECTING[method]}
    llm = LLM(candidate, method, tokenizer=DigitTokenizer(), enable_prefix_caching=True, **options)
    plain = LLM(plain_model, method, tokenizer=DigitTokenizer(), **options)
    base = prompts_of([41])[0]
    prompts = [base + tail for tail in prompts_of([3, 9, 17], seed=5)] + [base[:20], base]
    llm.generate([base], GREEDY, use_tqdm=False)  # caches base's 10 full pages
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    want = plain.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    # full pages only, and at least one prompt token is always computed (it gives the logits)
    assert [o.metrics.num_cached_tokens for o in outs] == [40, 40, 40, 16, 40]
    stats = llm.llm_engine.stats()
    assert stats.reuse.prefix.hits == 176 and stats.reuse.prefix.hit_requests == 5
    assert stats.prompt_tokens == 41 + sum(len(p) for p in prompts) - 176
    llm.llm_engine.reuse.prefix.check()
    assert stats.free_pages + stats.reuse.reclaimable_pages == stats.total_pages  # only idle blocks are held
    assert llm.reset_prefix_cache() == stats.reuse.reclaimable_pages
    assert llm.llm_engine.stats().free_pages == stats.total_pages


def test_idle_chains_are_reclaimed_when_memory_is_short_and_everything_comes_back():
    _, candidate = tiny_pair()
    _, fresh_model = tiny_pair()
    options = dict(num_pages=48, max_model_len=100, **SERVING, **ENGINE)
    llm = LLM(candidate, "vanilla", tokenizer=DigitTokenizer(), **options)
    engine = llm.llm_engine
    total = engine.stats().total_pages
    short = prompts_of([20, 20, 20], seed=7)
    outs = llm.generate(short, GREEDY, use_tqdm=False, chain_ids=["x", "y", "z"])
    idle = engine.stats().reuse
    assert idle.idle_chains == 3 and idle.reclaimable_pages == total - engine.stats().free_pages == 3 * 2 * 6
    long = prompts_of([60], seed=8)[0]  # 2 layers x 17 pages at its peak: two idle chains must go
    got = llm.generate([long], GREEDY, use_tqdm=False)[0]
    fresh = LLM(fresh_model, "vanilla", tokenizer=DigitTokenizer(), **options)
    assert got.outputs[0].token_ids == fresh.generate([long], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    reclaimed = engine.stats().reuse.chains_reclaimed
    assert reclaimed == 2 and got.metrics.num_preemptions == 0
    assert list(engine.reuse.chains.idle) == ["z"]  # least recently used first
    resumed = llm.generate([short[0] + outs[0].outputs[0].token_ids + [9, 9]], GREEDY, use_tqdm=False,
                           chain_ids=["x"])[0]
    assert resumed.metrics.chain_miss_reason == "reclaimed"
    engine.release_idle()
    assert engine.stats().free_pages == total and engine.stats().reuse.reclaimable_pages == 0


def test_forked_chains_continue_independently_and_cancellation_invalidates():
    reference, candidate = tiny_pair()
    sparsecompile.optimize(reference, "h2o", **ENGINE, **EVICTING["h2o"])
    llm = LLM(candidate, "h2o", tokenizer=DigitTokenizer(), **SERVING, **ENGINE, **EVICTING["h2o"])
    engine = llm.llm_engine
    first, a, b = prompts_of([30, 7, 11], seed=9)
    out = llm.generate([first], GREEDY, use_tqdm=False, chain_ids=["main"])[0].outputs[0].token_ids
    llm.fork_chain("main", "branch")
    history = first + out
    outs = llm.generate([history + a, history + b], GREEDY, use_tqdm=False, chain_ids=["main", "branch"])
    assert all(o.metrics.chain_hit for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [generate_turns(reference, [first, a])[1],
                                                      generate_turns(reference, [first, b])[1]]
    # cancel a continuation mid-decode: its chain is gone, its pages are free, the next turn says why
    engine.add_request("cut", history + a + outs[0].outputs[0].token_ids + b, GREEDY, chain_id="main")
    while engine.reuse.chains.active.get("main") is None:
        engine.step()
    engine.step()
    engine.abort_request("cut")
    engine.step()
    assert "main" not in engine.reuse.chains.idle and engine.stats().reuse.chains_invalidated == 1
    later = llm.generate([history + a + [5, 5]], GREEDY, use_tqdm=False, chain_ids=["main"])[0]
    assert later.metrics.chain_miss_reason == "invalidated"
    assert llm.drop_chain("branch") and llm.drop_chain("main") and not llm.drop_chain("main")
    assert engine.stats().free_pages == engine.stats().total_pages


def test_a_fork_without_a_row_to_reclaim_is_refused_and_changes_nothing():
    """With ``max_idle_chains=1`` the source is the only idle chain and nothing can be reclaimed for the fork's row:
    a clear error (an AttributeError before); a fork onto an existing chain is refused too. The source continues as
    if nothing happened."""
    reference, candidate = tiny_pair()
    sparsecompile.optimize(reference, "vanilla", **ENGINE)
    llm = LLM(candidate, "vanilla", tokenizer=DigitTokenizer(), max_idle_chains=1, **SERVING, **ENGINE)
    first, more = prompts_of([12, 5], seed=3)
    out = llm.generate([first], GREEDY, use_tqdm=False, chain_ids=["main"])[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_idle_chains=1 leaves no row for a fork beside 'main'"):
        llm.fork_chain("main", "branch")
    with pytest.raises(ValueError, match="chain 'main' already exists .idle.; fork_chain needs a new chain id"):
        llm.fork_chain("main", "main")  # nor onto an existing chain, which it would have replaced
    llm.llm_engine.add_request("first-turn", more, GREEDY, chain_id="other")  # not finished: "other" is taken
    with pytest.raises(ValueError, match="chain 'other' belongs to a request that has not finished"):
        llm.fork_chain("main", "other")
    llm.llm_engine.abort_request("first-turn")
    llm.llm_engine.step()
    again = llm.generate([first + out + more], GREEDY, use_tqdm=False, chain_ids=["main"])[0]
    assert again.metrics.chain_hit and again.outputs[0].token_ids == generate_turns(reference, [first, more])[1]


def test_a_step_that_preempts_into_the_prefix_cache_reclaims_before_it_allocates():
    """A decode step preempts the newest request to make room: the scheduler counts its pages free, but the prefix
    cache keeps its full blocks (idle, reclaimable): the engine reclaims them before the step allocates. Before, the
    step ran out of pages (``OutOfPages``) on this 20-page pool (found by a random serving fuzz)."""
    _, model = tiny_pair()
    _, solo_model = tiny_pair()
    options = dict(tokenizer=DigitTokenizer(), max_model_len=100, page_size=4, prefill_chunk_size=8)
    llm = LLM(model, "vanilla", enable_prefix_caching=True, num_pages=20, max_num_seqs=3, max_num_batched_tokens=11,
              **options)
    shared = prompts_of([11], seed=3)[0]
    arrivals = {4: ("r1", shared + prompts_of([18], seed=4)[0], SamplingParams(n=2, temperature=0.8, seed=519,
                                                                               max_tokens=7)),
                7: ("r2", prompts_of([19], seed=5)[0], SamplingParams(temperature=0.8, seed=379, max_tokens=16)),
                8: ("r0", prompts_of([11], seed=6)[0], SamplingParams(temperature=0, max_tokens=14))}
    engine, outs = llm.llm_engine, {}
    for step in range(300):
        if step in arrivals:
            engine.add_request(*arrivals[step])
        outs.update({o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished})
        if step > 8 and not engine.has_unfinished_requests():
            break
    assert engine.stats().num_preemptions > 0
    solo = LLM(solo_model, "vanilla", num_pages=400, **options)
    for rid, prompt, params in arrivals.values():
        assert outs[rid] == [c.token_ids for c in solo.generate([prompt], params, use_tqdm=False)[0].outputs], rid
    engine.reuse.prefix.check()
    stats = engine.stats()
    assert stats.free_pages + stats.reuse.reclaimable_pages == stats.total_pages


def test_a_continuation_whose_resume_needs_more_than_the_pool_prefills_from_scratch():
    """KVzip resuming a 22-token chain with 11 new tokens peaks at 26 pages, a fresh 33-token prompt at 18: on a
    24-page pool the continuation prefills from scratch (a miss, ``too_large``) and equals the unpatched model.
    Before, it headed the queue forever, blocking every request behind it (found by a random serving fuzz)."""
    reference, model = tiny_pair()
    llm = LLM(model, "kvzip", tokenizer=DigitTokenizer(), budget=256, num_pages=24, max_model_len=120, page_size=4,
              prefill_chunk_size=8, max_num_seqs=2, max_num_batched_tokens=16)
    first = prompts_of([15], seed=1)[0]
    turn = llm.generate([first], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False, chain_ids=["c"])[0]
    second = first + turn.outputs[0].token_ids + prompts_of([11], seed=2)[0]
    engine, done = llm.llm_engine, []
    engine.add_request("t2", second, GREEDY, chain_id="c")
    for _ in range(100):
        done += [o for o in engine.step() if o.finished]
        if done:
            break
    assert done and done[0].metrics.chain_miss_reason == "too_large"
    ids = torch.tensor([second])
    want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=T, do_sample=False,
                              pad_token_id=0)[0, len(second):].tolist()
    assert done[0].outputs[0].token_ids == want
    assert engine.stats().reuse.chain_misses == {"unknown_chain": 1, "too_large": 1}  # the first turn: a new id


def test_a_queue_head_that_can_never_be_admitted_is_aborted_not_waited_for(caplog):
    """The engine's guard: nothing runs, and the head of the queue is not admitted into the idle engine (here the
    scheduler's capacity is cut after the request was accepted, as a wrong cost model would): its request is
    aborted with a warning, and the request behind it runs, instead of both waiting forever."""
    _, model = tiny_pair()
    llm = LLM(model, "vanilla", tokenizer=DigitTokenizer(), num_pages=40, max_model_len=100, **ENGINE, **SERVING)
    engine = llm.llm_engine
    engine.add_request("big", prompts_of([60])[0], GREEDY)
    engine.add_request("small", prompts_of([6])[0], GREEDY)
    engine.scheduler.capacity = {"kv_pages": 24}  # "big" (30 pages at its peak) no longer fits the pool
    outs = {}
    for _ in range(50):
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert outs["big"].outputs[0].finish_reason == "abort" and "cannot be admitted" in caplog.text
    assert outs["small"].outputs[0].finish_reason == "length" and len(outs["small"].outputs[0].token_ids) == T
    engine.scheduler.capacity = {"kv_pages": 40}
    assert engine.stats().free_pages == engine.stats().total_pages
