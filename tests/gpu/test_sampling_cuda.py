"""CUDA-only checks (skipped without a GPU) of the vLLM sampling options: logits processing on the device equals
the CPU result, the non-finite guard, and the engine's n / logprobs / penalties path with compiled decode."""

from __future__ import annotations

import pytest
import torch

from sparsecompile.serving.outputs import SamplingParams, child_seed
from sparsecompile.serving.sampling import TokenHistory, make_generator, process_logits, sample, token_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rows():
    params = [SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.3),
              SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[5], logit_bias={9: 3.0}),
              SamplingParams(temperature=0, presence_penalty=-1.0),
              SamplingParams(temperature=0)]
    histories = [TokenHistory([1, 2, 3, 3], [4, 4, 7]), TokenHistory([8], [1]), TokenHistory([6], [6, 6, 2]),
                 TokenHistory([0], [])]
    return params, histories


def test_process_logits_on_cuda_equals_cpu():
    params, histories = _rows()
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 4
    cpu = process_logits(logits.clone(), params, histories, {2, 5})
    cuda = process_logits(logits.cuda(), params, histories, {2, 5})
    torch.testing.assert_close(cuda.cpu(), cpu)
    greedy = sample(logits.cuda().bfloat16(), params, [None] * 4, histories, {2, 5})
    assert greedy.tolist() == sample(logits.bfloat16(), params, [None] * 4, histories, {2, 5}).tolist()


def test_sampling_guards_and_logprobs_on_cuda():
    logits = torch.randn(3, 500, device="cuda")
    logits[0, 4] = torch.inf
    logits[1] = torch.nan
    out = sample(logits, [SamplingParams(temperature=1.0)] * 2 + [SamplingParams(temperature=1e-46)],
                 [make_generator(i, "cuda") for i in range(3)])
    assert out[0].item() == 4 and out[2].item() == logits[2].argmax().item()
    chosen, rank, top_lp, top_ids = token_logprobs(logits[2:], out[2:], 5)
    assert rank.item() == 1 and top_ids[0, 0].item() == out[2].item()
    torch.testing.assert_close(chosen, logits[2:].log_softmax(-1).max(-1).values)


@pytest.mark.parametrize("compile_decode", [False, True])
def test_engine_n_logprobs_and_penalties_on_cuda(compile_decode):
    from test_llm import DigitTokenizer, prompts_of
    from tiny_models import tiny_pair

    from sparsecompile import LLM

    reference, candidate = tiny_pair("llama")
    reference, candidate = reference.cuda(), candidate.cuda()
    llm = LLM(candidate, "vanilla", tokenizer=DigitTokenizer(), max_num_seqs=4, max_num_batched_tokens=24,
              page_size=4, prefill_chunk_size=16, compile=compile_decode, cuda_graphs=compile_decode)
    prompt = prompts_of([21])[0]
    sampled = dict(temperature=1.0, top_k=40, max_tokens=8, repetition_penalty=1.3)
    out = llm.generate([prompt], SamplingParams(n=3, seed=11, logprobs=2, **sampled), use_tqdm=False)[0]
    alone = llm.generate([prompt] * 3, [SamplingParams(seed=child_seed(11, i), **sampled) for i in range(3)],
                         use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in alone]
    completion = out.outputs[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + completion.token_ids], device="cuda")).logits[0].float()
    expected = expected.log_softmax(-1)
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert abs(entry[token].logprob - expected[len(prompt) + step - 1, token].item()) < 2e-3
    stats = llm.llm_engine.stats()
    assert stats.free_pages == stats.total_pages
