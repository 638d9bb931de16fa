"""vLLM-compatible sampling options through the serving engine (tiny llama, CPU): ``n`` (prefilled once, forked),
logprobs and prompt logprobs against a reference forward, penalties / ``min_tokens`` / ``logit_bias`` against
HF ``generate``'s own logits processors, and per-request reproducibility with ``seed``.
"""

from __future__ import annotations

import pytest
import torch
from test_llm import prompts_of, tiny_llm

from sparsecompile import SamplingParams
from sparsecompile.serving.outputs import child_seed


def hf_greedy(model, prompt: list[int], new: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def pair():
    """(reference model, LLM) with the default tiny options, shared (each test leaves the engine idle)."""
    return tiny_llm()


def idle(llm) -> bool:
    s = llm.llm_engine.stats()
    return s.free_pages == s.total_pages and s.num_running == s.num_waiting == 0


def test_n_completions_fork_after_one_prefill_and_follow_their_derived_seeds(pair):
    """Completion i of an n=3 request equals an n=1 request seeded with child_seed(seed, i): each sibling's KV (from
    the fork) and generator are right. The prompt is prefilled once for the request: the siblings share its pages
    (copy-on-write)."""
    _, llm = pair
    prompt = prompts_of([21])[0]
    sampled = dict(temperature=1.0, top_k=40, max_tokens=8)
    before = llm.llm_engine.stats().prompt_tokens
    out = llm.generate([prompt], SamplingParams(n=3, seed=11, **sampled), use_tqdm=False)[0]
    assert llm.llm_engine.stats().prompt_tokens - before == len(prompt)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    alone = llm.generate([prompt] * 3, [SamplingParams(seed=child_seed(11, i), **sampled) for i in range(3)],
                         use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # the derived seeds differ
    assert child_seed(11, 0) == 11 and child_seed(None, 2) is None and child_seed(2**64 - 1, 1) < 2**64
    assert out.metrics.num_generated_tokens == 24 and idle(llm)


def test_n_siblings_that_do_not_fit_wait_and_recompute_exactly():
    """A pool with room for about one sequence: siblings are queued like preempted requests (the prompt re-prefilled
    later, then the first token fed as a decode step); greedy siblings all equal the reference."""
    reference, llm = tiny_llm(num_pages=30, max_model_len=100)
    prompt = prompts_of([40])[0]
    before = llm.llm_engine.stats().prompt_tokens
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert llm.llm_engine.stats().prompt_tokens - before == 3 * 40  # siblings re-prefill the prompt alone
    expected = hf_greedy(reference, prompt, 12)
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert idle(llm)


@pytest.mark.parametrize("method, options, pages", [
    ("snapkv", {"budget": 12, "window": 4}, 20),
    ("quest", {"budget": 8, "dense_layers": 0, "dense_below": 0}, 30),
    ("kivi", {"residual": 8, "group_size": 4}, 30),
])
def test_queued_and_preempted_siblings_get_the_tokens_forked_ones_get(method, options, pages):
    """The pool holds the prompt and about one sibling: the others wait (or are preempted) and recompute by
    re-prefilling the prompt alone and replaying what they hold as decode steps, so each seeded completion equals
    the one it gets forked on a large pool. Before: prompt + output re-prefilled as one prompt, which SnapKV
    compresses as another prompt and Quest under its budget / KIVI compute otherwise; with SnapKV on 20 pages that
    prefill of a preempted sibling could never fit and the request waited forever (hence the bounded steps)."""
    params = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=12)
    prompt = prompts_of([40])[0]
    _, large = tiny_llm(method, num_pages=400, max_model_len=100, **options)
    forked = [c.token_ids for c in large.generate([prompt], params, use_tqdm=False)[0].outputs]
    _, small = tiny_llm(method, num_pages=pages, max_model_len=100, **options)
    engine = small.llm_engine
    engine.add_request("r", prompt, params)
    done = []
    for _ in range(200):
        done += [o for o in engine.step() if o.finished]
        if done:
            break
    assert done, "the request never finished"
    assert engine.stats().prompt_tokens == 3 * 40  # two siblings re-prefilled the prompt alone
    assert [c.token_ids for c in done[0].outputs] == forked
    assert idle(small)


def test_n_siblings_of_an_eviction_method_fork_whatever_else_is_batched():
    """Admission seats an n > 1 request with its siblings (``max_num_seqs``) and reserves their resident pages, so
    each sibling forks the compressed prompt instead of re-prefilling prompt + first token, which SnapKV would
    compress as another prompt: batched with others, every completion is the one it gets alone (before, with four
    seats, siblings re-prefilled 148 tokens and two completions changed)."""
    _, llm = tiny_llm("snapkv", budget=12, window=4, max_num_seqs=4)
    prompts = prompts_of([33, 21, 28], seed=9)
    params = [SamplingParams(n=3, temperature=0.9, seed=5 + i, max_tokens=8) for i in range(3)]
    before = llm.llm_engine.stats().prompt_tokens
    together = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.stats().prompt_tokens - before == 33 + 21 + 28  # no sibling re-prefilled
    for prompt, p, out in zip(prompts, params, together):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
    assert idle(llm)


def test_aborting_an_n_request_frees_every_sibling(pair):
    _, llm = pair
    engine = llm.llm_engine
    engine.add_request("early", prompts_of([30])[0], SamplingParams(n=2, temperature=0, max_tokens=50))
    engine.abort_request("early")  # before its first token: both completions abort empty
    (early,) = [o for o in engine.step() if o.request_id == "early"]
    assert early.finished and [(c.finish_reason, c.token_ids) for c in early.outputs] == [("abort", [])] * 2
    engine.add_request("late", prompts_of([30])[0], SamplingParams(n=3, temperature=0.7, seed=1, max_tokens=50))
    for _ in range(4):
        outs = engine.step()
    assert any(len(c.token_ids) > 1 for o in outs for c in o.outputs)
    engine.abort_request("late")
    (late,) = [o for o in engine.step() if o.request_id == "late"]
    assert late.finished and all(c.finish_reason == "abort" and c.token_ids for c in late.outputs)
    assert idle(llm)


def test_logprobs_and_prompt_logprobs_are_the_models_log_softmax(pair):
    reference, llm = pair
    prompt = prompts_of([19])[0]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=7, logprobs=3, prompt_logprobs=2,
                            repetition_penalty=1.2)  # logprobs are the model's, before penalties and temperature
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = prompt + completion.token_ids
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    # generated token t sits at position len(prompt) + t, predicted by the position before it
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = expected[len(prompt) + step - 1]
        top3 = row.topk(3).indices.tolist()
        assert list(entry)[0] == token and set(entry) == {token, *top3}  # the sampled token, then the top 3
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row >= row[token]).sum())
        assert [entry[t].rank for t in top3] == [1, 2, 3] or token in top3
        assert entry[token].decoded_token == f"{token} "
    assert abs(completion.cumulative_logprob - sum(e[t].logprob for t, e in zip(completion.token_ids,
                                                                                  completion.logprobs))) < 1e-6
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position, (token, entry) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:])):
        row = expected[position]
        assert set(entry) == {token, *row.topk(2).indices.tolist()}
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
    plain = llm.generate([prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=7, repetition_penalty=1.2),
                         use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == completion.token_ids  # asking for logprobs changes no token
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None


def test_prompt_logprobs_across_prefill_chunks_and_n(pair):
    reference, llm = pair  # prefill chunks of 16 tokens, step budget 24
    prompt = prompts_of([45])[0]
    out = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=3, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.metrics.num_prefill_chunks >= 3
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    got = [entry[token].logprob for token, entry in zip(prompt[1:], out.prompt_logprobs[1:])]
    want = [expected[i, token].item() for i, token in enumerate(prompt[1:])]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])


def test_penalties_min_tokens_and_logit_bias_match_hf_generate(pair):
    """Greedy decoding with each option equals HF generate with its logits processor of the same meaning."""
    reference, llm = pair
    prompt = prompts_of([12], seed=4)[0]
    new = 12
    plain = hf_greedy(reference, prompt, new)
    k = next(i for i in range(1, new) if plain[i] not in plain[:i])  # plain[k] first appears at k
    stop, target = plain[k], plain[-1]
    variants = {  # our options -> HF generate's
        "repetition": ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        "bias": ({"logit_bias": {target: 4.0}}, {"sequence_bias": {(target,): 4.0}}),
        "min_tokens": ({"stop_token_ids": [stop], "min_tokens": k + 3}, {"eos_token_id": stop,
                                                                         "min_new_tokens": k + 3}),
    }
    params = [SamplingParams(temperature=0, max_tokens=new)]
    params += [SamplingParams(temperature=0, max_tokens=new, **ours) for ours, _ in variants.values()]
    params.append(SamplingParams(temperature=0, max_tokens=new, stop_token_ids=[stop]))
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
    assert outs[0] == plain and outs[-1] == plain[:k + 1]
    for got, (name, (_, theirs)) in zip(outs[1:], variants.items()):
        assert got == hf_greedy(reference, prompt, new, **theirs), name
        assert got != plain, name
    assert stop not in outs[3][:k + 3]


def test_frequency_and_presence_penalties_change_greedy_tokens_reproducibly(pair):
    _, llm = pair
    prompt = prompts_of([8], seed=5)[0]

    options = [{}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"presence_penalty": -2.0},
               {"frequency_penalty": 2.0}]
    outs = llm.generate([prompt] * len(options), [SamplingParams(temperature=0, max_tokens=20, **o) for o in options],
                        use_tqdm=False)
    plain, frequency, presence, negative, again = (o.outputs[0].token_ids for o in outs)
    repeats = len(plain) - len(set(plain))
    assert repeats > 5  # a tiny random model loops
    for penalised in (frequency, presence):
        assert len(penalised) - len(set(penalised)) < repeats
    assert len(negative) - len(set(negative)) >= repeats  # a negative presence penalty favours repeats
    assert again == frequency
