"""sparsecompile.LLM takes vLLM's prompt forms and engine arguments."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_pair
from tiny_tokenizer import CHAT_TEMPLATE, save_tiny_model, tiny_tokenizer

from sparsecompile import LLM, MethodConfigError, SamplingParams
from sparsecompile.models.hf_patch import patched_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    _, model = tiny_pair("llama", seed=1)
    return LLM(model, tokenizer=tiny_tokenizer(), max_num_seqs=4, block_size=4, prefill_chunk_size=8)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_vllm_prompt_dicts_and_mixed_lists(llm):
    text, ids = "w5 w6 w7 w8", [9, 10, 11]
    plain = tokens(llm.generate([text, ids], GREEDY, use_tqdm=False))
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert tokens(dicts) == plain
    assert dicts[0].prompt == text and dicts[1].prompt is None and dicts[1].prompt_token_ids == ids
    mixed = llm.generate([{"prompt_token_ids": torch.tensor(ids)}, text, ids, {"prompt": text}], GREEDY,
                         use_tqdm=False)
    assert tokens(mixed) == [plain[1], plain[0], plain[1], plain[0]]
    assert tokens(llm.generate({"prompt": text}, GREEDY, use_tqdm=False)) == [plain[0]]  # one dict alone
    assert tokens(llm.generate(ids, GREEDY, use_tqdm=False)) == [plain[1]]
    assert llm.generate([], GREEDY, use_tqdm=False) == []


@pytest.mark.parametrize("prompts,match", [
    ([{"prompt": "w5", "multi_modal_data": {}}], "prompt 0: unsupported key\\(s\\) \\['multi_modal_data'\\]"),
    ([{"text": "w5"}], "unsupported key"),
    (["w5", {}], "prompt 1: the dict has neither 'prompt' nor 'prompt_token_ids'"),
    ([{"prompt_token_ids": "w5 w6"}], "'prompt_token_ids' must be a list of token ids, got str"),
    ([3.5], "prompt 0: a prompt is a string, a list of token ids, or a dict"),
])
def test_bad_prompt_forms_are_named(llm, prompts, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_reports_the_rendered_prompt(llm):
    out = llm.chat([{"role": "user", "content": "w5 w6"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "w5 w6 w3"  # the chat template's rendering, assistant turn opened
    assert out.prompt_token_ids == [5, 6, 3]
    assert tokens([out]) == tokens(llm.generate([[5, 6, 3]], GREEDY, use_tqdm=False))
    assert CHAT_TEMPLATE  # the template the tokenizer carries


def test_engine_seed_is_the_default_for_unseeded_requests():
    def run(seed):
        _, model = tiny_pair("llama", seed=1)
        engine_llm = LLM(model, tokenizer=tiny_tokenizer(), max_num_seqs=4, seed=seed)
        params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
        outs = engine_llm.generate([[5, 6, 7]] * 3, params, use_tqdm=False)
        again = engine_llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True,
                                                                seed=123), use_tqdm=False)
        return tokens(outs), tokens(again)

    first, seeded = run(7)
    assert run(7) == (first, seeded)  # reproducible run to run
    assert len({tuple(t) for t in first}) > 1  # the n-th unseeded request samples with seed + n, not all alike
    assert run(8)[0] != first and run(8)[1] == seeded  # a request's own seed wins


def test_engine_arguments_are_recognised(tmp_path):
    _, model = tiny_pair()
    llm = LLM(model, tokenizer=tiny_tokenizer(), block_size=8, max_model_len=64)
    assert patched_model(llm.llm_engine.model).controller.layout.page_size == 8
    assert llm.llm_engine.max_model_len == 64
    with pytest.raises(ValueError, match="gpu_memory_utilization needs a CUDA device"):  # recognised, then checked
        LLM(tiny_pair()[1], tokenizer=tiny_tokenizer(), gpu_memory_utilization=0.8)
    with pytest.raises(MethodConfigError, match="dtype must be a torch.dtype or one of auto, float32"):
        LLM(tiny_pair()[1], tokenizer=tiny_tokenizer(), dtype="fp8")
    with pytest.raises(ValueError, match="dtype= and device= apply when LLM loads the model"):
        LLM(tiny_pair()[1], tokenizer=tiny_tokenizer(), dtype="bfloat16")
    save_tiny_model(tmp_path)
    for name, want in (("auto", torch.float32), ("half", torch.float16), (torch.bfloat16, torch.bfloat16)):
        loaded = LLM(str(tmp_path), dtype=name, device="cpu", max_num_seqs=2)
        assert next(loaded.llm_engine.model.parameters()).dtype == want
