"""sparsecompile.LLM / LLMEngine: continuous batching equals per-prompt generate(); stop rules; aborts; errors."""

from __future__ import annotations

import pytest
import torch
from method_matrix import DENSE_EQUIVALENT
from tiny_models import tiny_pair

import sparsecompile
from sparsecompile import LLM, RequestRejected, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)


class DigitTokenizer:
    """Token ``t`` decodes to ``"<t> "``; enough for detokenization and stop strings on random tiny models."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"{t} " for t in ids)

    def __call__(self, text: str):
        raise AssertionError("tests pass token ids")


def prompts_of(lengths, vocab: int = 96, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def reference_tokens(model, prompts, max_new_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        out.append(gen[0, len(p):].tolist())
    return out


def tiny_llm(method: str = "vanilla", **kwargs):
    reference, candidate = tiny_pair("llama")
    options = dict(max_num_seqs=4, max_num_batched_tokens=24, page_size=4, prefill_chunk_size=16)
    options.update(kwargs)
    return reference, LLM(candidate, method, tokenizer=DigitTokenizer(), **options)


LENGTHS = (5, 40, 17, 58, 9, 33, 24, 51, 12, 3)


@pytest.mark.parametrize("method", sorted(DENSE_EQUIVALENT))
def test_every_method_matches_the_unpatched_model_under_continuous_batching(method):
    """Budget >= length: each method is dense, so batching, chunking and interleaving must not change a token."""
    reference, llm = tiny_llm(method, **DENSE_EQUIVALENT[method])
    prompts = prompts_of(LENGTHS)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts, GREEDY.max_tokens)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    stats = llm.llm_engine.stats()
    assert stats.free_pages == stats.total_pages and stats.num_running == stats.num_waiting == 0


def test_preemption_recomputes_exactly_and_frees_everything():
    reference, llm = tiny_llm("vanilla", num_pages=60, max_num_seqs=6, max_model_len=100)
    prompts = prompts_of(LENGTHS)
    params = SamplingParams(temperature=0, max_tokens=20)
    outs = llm.generate(prompts, params, use_tqdm=True)
    assert sum(o.metrics.num_preemptions for o in outs) > 0  # the pool is too small for all six at once
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts, 20)
    assert llm.llm_engine.stats().free_pages == 60
    # block-table rows a multiple of 16 pages, so rows start aligned (Quest's top-k select ran 1.3x slower on an
    # odd width on the H200: results/topk_width_h200.jsonl)
    width = llm.llm_engine.manager.max_pages_per_seq
    assert width % 16 == 0 and width * llm.llm_engine.controller.layout.page_size > 100


def test_padded_decode_batches_read_and_write_nothing_for_the_padding():
    """With compiled decode the engine pads batches to CUDA-graph sizes; run that path eagerly."""
    reference, llm = tiny_llm("h2o", budget=24, cuda_graph_sizes=[3])
    controller = llm.llm_engine.controller
    controller._compiled_decode = controller._decode_eager  # padding on, no compile
    assert llm.llm_engine.graph_sizes == [3, 4]
    prompts = prompts_of(LENGTHS)
    _, plain = tiny_llm("h2o", budget=24)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.llm_engine.stats().free_pages == llm.llm_engine.stats().total_pages


def test_seeded_sampling_does_not_depend_on_the_batch():
    _, llm = tiny_llm()
    prompts = prompts_of(LENGTHS[:6])
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=100 + i, max_tokens=10) for i in range(6)]
    together = llm.generate(prompts, seeded, use_tqdm=False)
    alone = [llm.generate([p], s, use_tqdm=False)[0] for p, s in zip(prompts, seeded)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] != [o.outputs[0].token_ids[:10] for o in greedy]


def test_stop_strings_stop_tokens_and_lengths():
    _, llm = tiny_llm()
    prompt = prompts_of([20])[0]
    free = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    tokens = free.token_ids
    assert free.text == "".join(f"{t} " for t in tokens)
    by_id = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[4]]),
                         use_tqdm=False)[0].outputs[0]
    first = tokens.index(tokens[4])
    assert by_id.token_ids == tokens[:first + 1] and by_id.finish_reason == "stop" and by_id.stop_reason == tokens[4]
    assert by_id.text == "".join(f"{t} " for t in tokens[:first])  # the stop token is not in the text
    stop = f"{tokens[2]} {tokens[3]}"
    by_text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    assert by_text.finish_reason == "stop" and by_text.stop_reason == stop
    assert by_text.text == free.text[:free.text.index(stop)]
    kept = [llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, include_stop_str_in_output=True,
                                                  **rule), use_tqdm=False)[0].outputs[0]
            for rule in (dict(stop=[stop]), dict(stop_token_ids=[tokens[4]]))]
    assert kept[0].text == free.text[:free.text.index(stop) + len(stop)] and kept[0].stop_reason == stop
    assert kept[1].text == "".join(f"{t} " for t in tokens[:first + 1]) and kept[1].stop_reason == tokens[4]
    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert short.outputs[0].token_ids == tokens[:3] and short.outputs[0].finish_reason == "length"
    assert short.metrics.num_generated_tokens == 3 and short.metrics.num_prompt_tokens == 20
    assert short.metrics.time_to_first_token is not None and short.metrics.latency >= short.metrics.time_to_first_token


def test_text_is_decoded_after_the_prompt_as_vllm_does():
    """A tokenizer whose decoder puts the space between words (SentencePiece's leading-space marks, word-level
    decoders) gives the first token's space in the text: ``prompt + text`` is the whole sequence decoded (what
    ``echo`` returns); a stop string never matches across into the prompt."""
    from tiny_tokenizer import tiny_tokenizer

    _, candidate = tiny_pair("llama")
    tokenizer = tiny_tokenizer()
    llm = LLM(candidate, tokenizer=tokenizer, max_num_seqs=2, page_size=4)
    prompt = "w10 w11 w12"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    assert out.outputs[0].text.startswith(" w") and len(ids) == 6
    assert prompt + out.outputs[0].text == tokenizer.decode(out.prompt_token_ids + ids, skip_special_tokens=True)
    # "w12 w" straddles the prompt's end: it is not a stop (text starts after the prompt)
    straddle = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=["w12 w"]),
                            use_tqdm=False)[0].outputs[0]
    assert straddle.finish_reason == "length" and straddle.text == out.outputs[0].text


def test_streaming_deltas_add_up_and_abort_frees_pages_at_once():
    _, llm = tiny_llm()
    engine = llm.llm_engine
    total = engine.stats().total_pages
    engine.add_request("keep", prompts_of([30])[0], SamplingParams(temperature=0, max_tokens=15))
    engine.add_request("drop", prompts_of([45], seed=1)[0], SamplingParams(temperature=0, max_tokens=15))
    text, ids, aborted = "", [], None
    for step in range(100):
        for out in engine.step():
            if out.request_id == "keep":
                text += out.outputs[0].delta_text
                ids += out.outputs[0].delta_token_ids
                final = out
            elif out.finished:
                aborted = out
        if step == 6:
            before = engine.stats().free_pages
            engine.abort_request("drop")
            assert engine.stats().free_pages > before  # freed now, not at the next step
        if not engine.has_unfinished_requests():
            break
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert final.finished and text == final.outputs[0].text and ids == final.outputs[0].token_ids
    assert engine.stats().free_pages == total
    engine.abort_request("keep")  # finished or unknown ids are ignored
    engine.abort_request("nope")


def _outputs_by_kind(kind, stop):
    """Every output the engine returns for three requests (n = 2 seeded sampling with logprobs and a stop string;
    greedy; one aborted at step 5) asking for outputs of ``kind``."""
    _, llm = tiny_llm()
    engine = llm.llm_engine
    prompts = prompts_of([21, 34, 9], seed=3)
    params = [SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=14, logprobs=2, stop=stop, output_kind=kind),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=kind),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=kind)]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    outputs = []
    for step in range(200):
        if step == 5:
            engine.abort_request("r2")
        outputs += engine.step()
        if not engine.has_unfinished_requests():
            break
    assert engine.stats().free_pages == engine.stats().total_pages
    return outputs


def _completion(c):
    return c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason


def test_output_kinds_carry_the_same_completions():
    """CUMULATIVE (every step, everything so far), DELTA (every step, only what it added) and FINAL_ONLY (one output
    at the end) report the same completions: the deltas add up to the cumulative text, tokens and logprobs (stop
    strings held back alike), and a final-only request returns exactly one output, equal to the last cumulative one."""
    from sparsecompile import RequestOutputKind

    first = _outputs_by_kind(RequestOutputKind.CUMULATIVE, None)
    tokens = next(o for o in reversed(first) if o.request_id == "r0").outputs[0].token_ids
    stop = f"{tokens[5]} {tokens[6]}"  # DigitTokenizer: token t decodes to "t "
    cumulative = _outputs_by_kind(RequestOutputKind.CUMULATIVE, stop)
    final = {o.request_id: o for o in cumulative if o.finished}
    assert set(final) == {"r0", "r1", "r2"} and final["r2"].outputs[0].finish_reason == "abort"
    assert final["r0"].outputs[0].finish_reason == "stop" and final["r0"].outputs[0].stop_reason == stop

    only = _outputs_by_kind(RequestOutputKind.FINAL_ONLY, stop)
    assert sorted(o.request_id for o in only) == ["r0", "r1", "r2"] and all(o.finished for o in only)
    for out in only:
        want = final[out.request_id]
        assert [_completion(c) for c in out.outputs] == [_completion(c) for c in want.outputs]
        assert [c.delta_token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]

    delta = _outputs_by_kind("delta", stop)  # a name works too
    assert [o.request_id for o in delta] == [o.request_id for o in cumulative]
    for rid, want in final.items():
        mine = [o for o in delta if o.request_id == rid]
        assert mine[-1].finished and not any(o.finished for o in mine[:-1])
        for index, w in enumerate(want.outputs):
            parts = [o.outputs[index] for o in mine]
            assert all(c.text == c.delta_text and c.token_ids == c.delta_token_ids for c in parts)
            assert "".join(c.text for c in parts) == w.text
            assert sum((c.token_ids for c in parts), []) == w.token_ids
            if w.logprobs is not None:
                assert sum((c.logprobs for c in parts), []) == w.logprobs
            assert _completion(parts[-1])[3:] == _completion(w)[3:]


def test_generate_asks_for_final_outputs_without_changing_the_callers_params():
    from sparsecompile import RequestOutputKind

    reference, llm = tiny_llm()
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(prompts_of([7, 19]), params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts_of([7, 19]), 8)
    with pytest.raises(RequestRejected, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="partial")
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        llm.generate(prompts_of([7]), {"max_tokens": 8}, use_tqdm=False)


def test_bad_requests_are_rejected_and_leave_nothing_behind():
    _, llm = tiny_llm(max_model_len=64)
    engine = llm.llm_engine
    with pytest.raises(RequestRejected, match="context is 64 tokens"):
        llm.generate([prompts_of([64])[0]], GREEDY, use_tqdm=False)
    with pytest.raises(RequestRejected, match="max_tokens"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=0), use_tqdm=False)
    with pytest.raises(RequestRejected, match=r"\[0, 96\)"):
        llm.generate([[5, 600]], GREEDY, use_tqdm=False)
    with pytest.raises(RequestRejected, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(RequestRejected, match="top_p"):
        llm.generate([[5, 6]], SamplingParams(top_p=0), use_tqdm=False)
    # a good prompt before a bad one in the same call is not left queued or allocated
    with pytest.raises(RequestRejected):
        llm.generate([[5, 6, 7], prompts_of([80])[0]], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    engine.add_request("dup", [5, 6], GREEDY)
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("dup", [5, 6], GREEDY)
    engine.abort_request("dup")
    engine.step()
    assert engine.stats().free_pages == engine.stats().total_pages
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].finished  # still serving


def test_engine_refuses_a_model_it_cannot_reach():
    reference, _ = tiny_pair("llama")
    with pytest.raises(sparsecompile.UnsupportedModelError, match="optimize"):
        sparsecompile.serving.engine.LLMEngine(reference, DigitTokenizer())


@pytest.mark.slow
@pytest.mark.parametrize("method,options", [("snapkv", {"budget": 40, "window": 8})])
def test_smollm2_32_mixed_prompts_equal_per_prompt_generate(smollm2_path, method, options):
    """The issue's acceptance test: 32 prompts of mixed lengths, LLM.generate vs greedy generate() one by one.
    SnapKV compresses some prompts in batched chunked prefill, the harder case; vanilla's batches are checked
    against the unpatched model by the tiny-model tests above and ``test_smollm2.py`` (its ``vanilla`` row here took
    25 s of the CI budget)."""
    from needle import AUSTEN_TEXT

    llm = LLM(str(smollm2_path), method, dtype=torch.float32, device="cpu", max_num_seqs=8,
              max_num_batched_tokens=160, prefill_chunk_size=48, **options)
    tok = llm.tokenizer
    with open(AUSTEN_TEXT, encoding="utf-8") as f:
        words = f.read().split()
    prompts = [" ".join(words[31 * i: 31 * i + 6 + (37 * i) % 56]) for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    model = llm.llm_engine.model
    lengths = [len(tok(p).input_ids) for p in prompts]
    assert min(lengths) < 40 and max(lengths) > 48  # snapkv compresses some prompts; some take two chunks
    assert sum(o.metrics.num_prefill_chunks for o in outs) > len(prompts)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                  eos_token_id=None, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == expected, prompt[:60]
        assert out.outputs[0].text == tok.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("method,options", [("snapkv", {"budget": 16, "window": 4}), ("h2o", {"budget": 16}),
                                            ("streamingllm", {"budget": 16, "sinks": 2}),
                                            ("pyramidkv", {"budget": 16, "window": 4})])
def test_batched_prefill_of_compressing_methods_equals_generate(method, options):
    """Several prompts' chunks share one forward (rows end their prompts at different steps): what each keeps and
    generates equals its own optimize() + generate()."""
    reference, llm = tiny_llm(method, max_num_batched_tokens=64, **options)
    sparsecompile.optimize(reference, method, page_size=4, prefill_chunk_size=16, **options)
    prompts = prompts_of(LENGTHS)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts, GREEDY.max_tokens)


def test_a_burst_of_prompts_is_prefilled_in_few_forwards(monkeypatch):
    _, llm = tiny_llm(max_num_seqs=8, max_num_batched_tokens=256)
    controller = llm.llm_engine.controller
    calls = []
    original = controller.prefill
    monkeypatch.setattr(controller, "prefill", lambda *a, **k: calls.append(len(a[1])) or original(*a, **k))
    llm.generate(prompts_of((12, 14, 13, 15, 11, 12, 16, 10)), GREEDY, use_tqdm=False)
    assert calls[0] == 8 and len(calls) == 1  # all eight prompts in the first step's single prefill forward


@pytest.mark.parametrize("method,budget,chunk", [("vanilla", None, 8192), ("vanilla", 20000, 20000),
                                                 ("vanilla", 100, 100), ("h2o", 20000, 8192)])
def test_serving_chunks_fill_the_step_budget(method, budget, chunk):
    """Without ``prefill_chunk_size``, a prompt chunk is capped by the step's token budget (8192 by default), not by
    a fixed 8192: a larger ``max_num_batched_tokens`` runs a long prompt in larger chunks; a method's own chunk (H2O's
    8192) still holds."""
    _, llm = tiny_llm(method, max_num_batched_tokens=budget, prefill_chunk_size=None,
                      **({"budget": 32} if method == "h2o" else {}))
    assert llm.llm_engine.scheduler.prefill_chunk_size == chunk


def test_a_capped_prompt_budget_beside_decodes_keeps_the_tokens():
    """``max_prefill_tokens_while_decoding`` only re-chunks prompts that arrive while others decode: same tokens."""
    reference, llm = tiny_llm(max_prefill_tokens_while_decoding=3)
    prompts = prompts_of(LENGTHS)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts, GREEDY.max_tokens)
    _, uncapped = tiny_llm()
    chunks = [o.metrics.num_prefill_chunks for o in uncapped.generate(prompts, GREEDY, use_tqdm=False)]
    assert sum(o.metrics.num_prefill_chunks for o in outs) > 2 * sum(chunks)  # the cap did cut the chunks (63 vs 25)


def test_an_engine_served_by_the_server_refuses_other_threads_until_the_server_stops():
    """The server's engine thread binds the (not thread-safe) engine and its pool: an ``LLM.generate`` or the patched
    model's ``generate()`` from another thread gets a clear error instead of racing its steps (which crashed the
    server's thread or mixed requests' state)."""
    from fastapi.testclient import TestClient

    from sparsecompile.server import create_app
    from sparsecompile.serving.engine import EngineUnavailableError

    _, model = tiny_pair("llama")
    llm = LLM(model, tokenizer=DigitTokenizer(), max_num_seqs=4, page_size=4)
    prompt = prompts_of([9])[0]
    before = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with TestClient(create_app(llm.llm_engine, "tiny"), base_url="http://localhost") as client:
        with pytest.raises(EngineUnavailableError, match="driven by the server's engine thread"):
            llm.generate([prompt], GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="KV pool is driven by the server's engine thread"):
            model.generate(torch.tensor([prompt]), max_new_tokens=2)  # the same pool, through the patched model
        served = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0}).json()
        assert served["choices"][0]["text"] == "".join(f"{t} " for t in before)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
    assert llm.llm_engine.stats().free_pages == llm.llm_engine.stats().total_pages


def test_an_llm_whose_model_was_optimized_again_says_so():
    """Two LLMs over one model object: the second optimizes it again, which closes the first one's KV pool. The first
    then refuses with the reason (an AssertionError from deep in the prefill before) and the second serves."""
    reference, candidate = tiny_pair("llama")
    first = LLM(candidate, tokenizer=DigitTokenizer(), page_size=4)
    second = LLM(candidate, "snapkv", tokenizer=DigitTokenizer(), page_size=4, budget=64)
    prompt = prompts_of([9])[0]
    from sparsecompile.serving.engine import EngineUnavailableError

    with pytest.raises(EngineUnavailableError, match=r"was restore\(\)d or optimize\(\)d again"):
        first.generate([prompt], GREEDY, use_tqdm=False)
    got = second.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got == reference_tokens(reference, [prompt], GREEDY.max_tokens)[0]
