"""Interval pruning of idle chains (issue #19 item 2) on a tiny model: what stays in and out of the ranges, pages
freed, continuations on compressed history; every bad request refused with the state byte-identical; submitted
prunes blocked while the state runs; random prune / continue / fork / drop sequences leak no page."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_llm import DigitTokenizer, prompts_of
from tiny_models import tiny_pair

from sparsecompile import LLM, SamplingParams
from sparsecompile.serving.prune import PruneBlocked, PruneRejected, PruneSpec

GREEDY = SamplingParams(temperature=0, max_tokens=5)


def make_llm(method: str = "snapkv", **options) -> LLM:
    _, model = tiny_pair()
    defaults = {"snapkv": dict(budget=64, window=4), "h2o": dict(budget=64), "kvzip": dict(budget=64),
                "snapkv+kivi": dict(budget=64, window=4), "vanilla": {}}[method]
    return LLM(model, method, tokenizer=DigitTokenizer(), page_size=4, prefill_chunk_size=16, max_num_seqs=4,
               max_num_batched_tokens=24, **{**defaults, **options})


def positions(llm: LLM, chain_id: str) -> list[list[list[int]]]:
    engine = llm.llm_engine
    row = engine.reuse.chains.idle[chain_id].row
    return [[p.tolist() for p in engine.manager.retained_positions(row, layer)] for layer in range(2)]


def snapshot(llm: LLM) -> dict:
    engine = llm.llm_engine
    m = engine.manager
    state = {name: t.clone() for name, t in (("k", m.k_pool), ("v", m.v_pool), ("pos", m.pos_pool),
                                              *m.slot_metadata.items())}
    state.update(table=m._host_table.copy(), lengths=m._host_lengths.copy(), free=m.allocator.free_list,
                 refcounts=m.allocator.refcounts(np.arange(m.num_pages)).copy(),
                 chains={k: (c.row, c.pages, c.compressed, c.tokens.tolist()) for k, c in
                         engine.reuse.chains.idle.items()})
    return state


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif isinstance(a[key], np.ndarray):
            assert np.array_equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("policy", ["kvzip", "snapkv"])
def test_prune_keeps_k_in_the_ranges_and_nothing_else_changes(policy):
    llm = make_llm()
    prompt, extra = prompts_of([40, 6], seed=2)
    out = llm.generate([prompt], GREEDY, use_tqdm=False, chain_ids=["a"])[0]
    history = prompt + out.outputs[0].token_ids  # 44 tokens processed (the last sampled one is not)
    before = positions(llm, "a")
    free = llm.llm_engine.stats().free_pages
    result = llm.prune("a", [(24, 32), (8, 16), (16, 24)], keep_tokens=4, policy=policy)  # merged into [8, 32)
    assert result.status == "completed" and result.ranges == [(8, 32)]
    after = positions(llm, "a")
    for layer in range(2):
        for head in range(2):
            inside = [p for p in after[layer][head] if 8 <= p < 32]
            assert len(inside) == 4 and set(inside) <= set(before[layer][head])
            outside = [p for p in before[layer][head] if not 8 <= p < 32]
            assert [p for p in after[layer][head] if not 8 <= p < 32] == outside
    assert result.removed_entries == 2 * 2 * 20 and result.freed_pages == 2 * 5  # 44 -> 24 slots per layer
    assert llm.llm_engine.stats().free_pages == free + result.freed_pages
    cont = llm.generate([history + extra], GREEDY, use_tqdm=False, chain_ids=["a"])[0]
    assert cont.metrics.chain_hit and cont.metrics.compressed_history and cont.metrics.num_cached_tokens == 44
    assert llm.llm_engine.stats().reuse.compressed_continuations == 1


def test_keep_zero_drops_the_range_without_scoring_and_token_ids_find_the_chain():
    llm = make_llm("h2o")
    prompt = prompts_of([40], seed=4)[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False, chain_ids=["b"])[0]
    tokens = prompt + out.outputs[0].token_ids  # complete token_ids (with the unprocessed last token)
    result = llm.prune(tokens, [(4, 20)], keep_tokens=0)
    assert result.chain_id == "b" and result.removed_entries == 2 * 2 * 16
    for layer in positions(llm, "b"):
        for head in layer:
            assert not [p for p in head if 4 <= p < 20] and len(head) == 44 - 16


def test_bad_requests_are_refused_and_change_nothing():
    llm = make_llm()
    prompt = prompts_of([40], seed=5)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False, chain_ids=["c"])
    state = snapshot(llm)
    bad = [(dict(ranges=[(8, 16), (12, 20)]), "overlap"), (dict(ranges=[(8, 8)]), "empty"),
           (dict(ranges=[]), "empty"), (dict(ranges=[(8, 48)]), "outside"), (dict(ranges=[(6, 16)]), "page-aligned"),
           (dict(keep_tokens=-1), "keep_tokens"), (dict(policy="h2o"), "unknown policy"),
           (dict(chain="nope"), "no idle chain"), (dict(chain=[1, 2, 3]), "no idle chain")]
    for change, reason in bad:
        args = dict(chain="c", ranges=[(8, 16)], keep_tokens=2, policy="kvzip") | change
        with pytest.raises(PruneRejected, match=reason):
            llm.prune(args["chain"], args["ranges"], args["keep_tokens"], args["policy"])
        assert_same(state, snapshot(llm))
    vanilla = make_llm("vanilla")
    vanilla.generate([prompt], GREEDY, use_tqdm=False, chain_ids=["v"])
    with pytest.raises(PruneRejected, match="keeps every token"):
        vanilla.prune("v", [(8, 16)], 2)
    quantized = make_llm("snapkv+kivi", group_size=16, residual=16)
    quantized.generate([prompt], GREEDY, use_tqdm=False, chain_ids=["q"])
    with pytest.raises(PruneRejected, match="KIVI"):
        quantized.prune("q", [(8, 16)], 2)


def test_kvzip_re_reads_in_chunks_that_fit_the_block_table_or_refuses():
    # 44 resident entries; max_model_len 60 leaves 64 slots a layer: the 24-token range is re-read in two chunks
    llm = make_llm(max_model_len=60)
    prompt = prompts_of([40], seed=2)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False, chain_ids=["a"])
    result = llm.prune("a", [(8, 32)], keep_tokens=4, policy="kvzip")
    assert result.status == "completed" and result.removed_entries == 2 * 2 * 20
    assert all(len([p for p in head if 8 <= p < 32]) == 4 for layer in positions(llm, "a") for head in layer)
    tight = make_llm(max_model_len=52)  # 56 slots: no room for a lead-in and a chunk, nor a 32-token window
    tight.generate([prompt], GREEDY, use_tqdm=False, chain_ids=["a"])
    state = snapshot(tight)
    for policy in ("kvzip", "snapkv"):
        with pytest.raises(PruneRejected, match="larger max_model_len"):
            tight.prune("a", [(8, 32)], keep_tokens=4, policy=policy)
        assert_same(state, snapshot(tight))
    assert tight.prune("a", [(8, 32)], keep_tokens=0).removed_entries == 2 * 2 * 24


def test_a_prune_of_state_in_use_is_blocked_then_runs_when_it_goes_idle():
    llm = make_llm("kvzip")
    engine = llm.llm_engine
    prompt, extra = prompts_of([40, 9], seed=6)
    out = llm.generate([prompt], GREEDY, use_tqdm=False, chain_ids=["d"])[0]
    engine.add_request("turn2", prompt + out.outputs[0].token_ids + extra, GREEDY, chain_id="d")
    while not engine.reuse.chains.active.get("d"):
        engine.step()
    with pytest.raises(PruneBlocked, match="in use"):
        llm.prune("d", [(8, 16)], 2)
    record = engine.submit_prune(PruneSpec([(8, 16)], 2, chain_id="d"))
    assert record.status == "blocked"
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.prune_status(record.prune_id)
    assert done.status == "completed" and done.removed_entries == 2 * 2 * 6
    failed = engine.submit_prune(PruneSpec([(8, 10)], 2, chain_id="d"))
    assert failed.status == "failed" and "page-aligned" in failed.reason


def test_random_prune_continue_fork_drop_leak_nothing():
    """A property test over random sequences of prunes (both policies, any budget), continuations, forks and drops
    on one engine: reference counts always match the holders, and every page comes back at the end."""
    llm = make_llm("snapkv", budget=40, num_pages=120, max_idle_chains=3)
    engine = llm.llm_engine
    m, reuse = engine.manager, engine.reuse

    @settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ops=st.lists(st.tuples(st.sampled_from(["new", "continue", "prune", "prune", "fork", "drop"]),
                                  st.integers(0, 2**16)), min_size=4, max_size=10))
    def run(ops):
        history: dict[str, list[int]] = {}
        for i, (op, seed) in enumerate(ops):
            rng = np.random.default_rng(seed)
            idle = sorted(set(reuse.chains.idle) & set(history))
            if op == "new" or not idle:
                chain, prompt = f"c{i}", rng.integers(3, 90, int(rng.integers(20, 48))).tolist()
            elif op == "continue":
                chain = rng.choice(idle)
                prompt = history[chain] + rng.integers(3, 90, int(rng.integers(1, 12))).tolist()
            elif op == "prune":
                chain = rng.choice(idle)
                n = reuse.chains.idle[chain].num_tokens // 4 * 4
                lo = int(rng.integers(0, max(1, n // 4))) * 4
                hi = min(n, lo + int(rng.integers(1, 4)) * 4)
                if hi > lo:
                    llm.prune(chain, [(lo, hi)], int(rng.integers(0, 5)), rng.choice(["kvzip", "snapkv"]))
                continue
            elif op == "fork":
                source = rng.choice(idle)
                llm.fork_chain(source, f"f{i}")
                history[f"f{i}"] = history[source]
                continue
            else:
                llm.drop_chain(rng.choice(idle))
                continue
            out = llm.generate([prompt], GREEDY, use_tqdm=False, chain_ids=[chain])[0]
            history[chain] = prompt + out.outputs[0].token_ids
            holders = np.zeros(m.num_pages, dtype=np.int64)
            for row in m.live_rows:
                for layer in range(2):
                    np.add.at(holders, m.pages_of(row, layer), 1)
            assert (m.allocator.refcounts(np.arange(m.num_pages)) == holders).all()
            assert reuse.chains.idle_pages == sum(c.pages for c in reuse.chains.idle.values())
        engine.release_idle()
        assert engine.stats().free_pages == m.num_pages

    run()
