"""transformers' generate() options on a patched model, token for token against the unpatched model; the options
we cannot honour are refused up front, naming them; what HF users already rely on keeps working."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from tiny_models import left_padded_batch, tiny_pair
from tiny_tokenizer import text_of, tiny_tokenizer, word
from transformers import DynamicCache, GenerationConfig, TextIteratorStreamer, TextStreamer, pipeline
from transformers.generation.streamers import BaseStreamer

import sparsecompile
from sparsecompile.models.hf_patch import cache_argument_name, patched_model

NEW = 10


@pytest.fixture(scope="module")
def pair():
    reference, model = tiny_pair("llama", seed=7)
    sparsecompile.optimize(model, page_size=4, prefill_chunk_size=4)
    return reference, model


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def free_run(pair):
    """The unpatched model's greedy tokens for the batch every option test uses."""
    ids, mask = left_padded_batch((9, 6), seed=3)
    out = pair[0].generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return ids, mask, out[:, ids.shape[1]:]


def both(pair, seed: int | None = 0, **kwargs):
    """Run generate() with the same arguments on the unpatched and the patched model."""
    outs = []
    for model in pair:
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(model.generate(**kwargs))
    return outs


def assert_no_pages_held(model):
    manager = patched_model(model).controller.manager
    assert manager is None or manager.allocator.num_free == manager.num_pages


def options_for(free: torch.Tensor, tok) -> dict[str, dict]:
    """Options whose effect shows on this batch: stop at tokens the free run generates, ban them, penalise."""
    t2, t4 = int(free[0, 2]), int(free[1, 4])
    return {
        "stop_strings": dict(stop_strings=[word(t2), word(t4)], tokenizer=tok),  # each row stops: generation ends
        "min_new_tokens": dict(min_new_tokens=6, eos_token_id=t2),
        "eos_and_padding": dict(eos_token_id=[t2, t4]),
        "repetition_penalty": dict(repetition_penalty=1.8),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "bad_words_ids": dict(bad_words_ids=[[t2], [t4]]),
        "sequence_bias": dict(sequence_bias={(t2,): -20.0}),
        "suppress_tokens": dict(suppress_tokens=[t2], begin_suppress_tokens=[int(free[0, 0])]),
        "forced_eos_token_id": dict(forced_eos_token_id=t4, eos_token_id=t4),
        "seeded_sampling": dict(do_sample=True, temperature=0.8, top_k=30, top_p=0.9, min_p=0.02,
                                num_return_sequences=2),
        "typical_epsilon": dict(do_sample=True, typical_p=0.9, epsilon_cutoff=3e-4),
        "generation_config": dict(generation_config=GenerationConfig(max_new_tokens=7, do_sample=True, top_k=8,
                                                                     temperature=0.7, pad_token_id=0)),
        "static_cache_requested": dict(cache_implementation="static"),
        "use_cache_false": dict(use_cache=False),
        "classifier_free_guidance": dict(guidance_scale=1.5),
        "token_healing": dict(token_healing=True, tokenizer=tok),  # needs the tokenizer: HF's own loop
    }


OPTIONS = ["stop_strings", "min_new_tokens", "eos_and_padding", "repetition_penalty", "no_repeat_ngram_size",
           "bad_words_ids", "sequence_bias", "suppress_tokens", "forced_eos_token_id", "seeded_sampling",
           "typical_epsilon", "generation_config", "static_cache_requested", "use_cache_false",
           "classifier_free_guidance", "token_healing"]


@pytest.mark.parametrize("name", OPTIONS)
def test_generate_option_matches_the_unpatched_model(pair, tok, free_run, name):
    ids, mask, free = free_run
    kwargs = options_for(free, tok)[name]
    if "generation_config" not in kwargs:
        kwargs = dict(max_new_tokens=NEW, pad_token_id=0, **kwargs)
    want, got = both(pair, input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(got, want), name
    if name in ("stop_strings", "eos_and_padding", "bad_words_ids"):
        assert want.shape != (2, ids.shape[1] + NEW) or not torch.equal(want[:, ids.shape[1]:], free), \
            "the option must change the output"
    if name == "classifier_free_guidance":  # the unconditional branch's cache lives until the model's next forward
        pair[1].generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, pad_token_id=0)
    assert_no_pages_held(pair[1])


def test_scores_and_logits_in_the_returned_dict(pair, free_run):
    ids, mask, _ = free_run
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, return_dict_in_generate=True,
                  output_scores=True, output_logits=True, repetition_penalty=1.3)
    want, got = both(pair, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for name in ("scores", "logits"):
        assert len(getattr(got, name)) == len(getattr(want, name)) == 6
        for a, b in zip(getattr(got, name), getattr(want, name)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    cache = got["cache"] if "cache" in got else got["past_key_values"]
    assert isinstance(cache, sparsecompile.SparseCache)
    cache.release()


class Recorder(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value) -> None:
        self.chunks.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


def test_streamers(pair, tok, capsys):
    ids = torch.randint(3, 95, (1, 7), generator=torch.Generator().manual_seed(11))
    recorders = [Recorder(), Recorder()]
    for model, recorder in zip(pair, recorders):
        model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, streamer=recorder)
    assert recorders[0].chunks == recorders[1].chunks and recorders[1].ended
    assert recorders[1].chunks[0] == ids[0].tolist() and len(recorders[1].chunks) == NEW + 1  # prompt, then tokens
    want = pair[0].generate(input_ids=ids, max_new_tokens=NEW, do_sample=False)[0, 7:]

    pair[1].generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out.strip() == text_of(want)

    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    worker = threading.Thread(target=pair[1].generate,
                              kwargs=dict(input_ids=ids, max_new_tokens=NEW, do_sample=False, streamer=streamer))
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text.strip() == text_of(want)


def test_text_generation_pipeline(pair, tok):
    prompts = ["w5 w6 w7 w8", "w40 w41"]
    runs = [pipeline("text-generation", model=m, tokenizer=tok)(prompts, max_new_tokens=6, do_sample=False)
            for m in pair]
    assert runs[0] == runs[1]
    assert runs[1][0][0]["generated_text"].startswith("w5 w6 w7 w8")


def test_continuing_from_a_returned_cache(pair):
    ids, mask = left_padded_batch((8, 5), seed=9)
    outs = []
    for model in pair:
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                               return_dict_in_generate=True, pad_token_id=0)
        cache = first["cache"] if "cache" in first else first["past_key_values"]
        more = torch.randint(3, 95, (2, 3), generator=torch.Generator().manual_seed(2))
        seq = torch.cat([first.sequences, more], 1)
        seq_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        outs.append(model.generate(input_ids=seq, attention_mask=seq_mask, max_new_tokens=5, do_sample=False,
                                   pad_token_id=0, **{cache_argument_name(model): cache}))
        assert isinstance(cache, DynamicCache if model is pair[0] else sparsecompile.SparseCache)
        if model is pair[1]:
            cache.release()
    assert torch.equal(outs[1], outs[0])
    assert_no_pages_held(pair[1])


REFUSED = [
    (dict(num_beams=2), "beam search"),
    (dict(generation_config=GenerationConfig(num_beams=3, max_new_tokens=4)), "beam search"),
    (dict(num_beams=2, do_sample=True), "beam sampling"),
    (dict(penalty_alpha=0.6, top_k=4), "contrastive search"),
    (dict(prompt_lookup_num_tokens=3), "assisted / speculative decoding"),
    (dict(dola_layers="low"), "DoLa"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
    (dict(cache_implementation="quantized"), "method=.kivi."),
    (dict(cache_implementation="offloaded"), "offloaded to CPU"),
    (dict(cache_implementation="paged"), "continuous batching"),
]


@pytest.mark.parametrize("kwargs,match", REFUSED, ids=[m for _, m in REFUSED])
def test_unsupported_options_are_refused_by_name(pair, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pair[1].generate(input_ids=torch.randint(3, 95, (1, 5)), max_new_tokens=4, **kwargs)
    assert_no_pages_held(pair[1])


def test_assistant_model_refused(pair):
    with pytest.raises(ValueError, match="assisted / speculative decoding"):
        pair[1].generate(input_ids=torch.randint(3, 95, (1, 5)), max_new_tokens=4, assistant_model=pair[0])


def test_position_limit_checked_before_any_token():
    reference, model = tiny_pair(max_position_embeddings=32)
    sparsecompile.optimize(model, page_size=4)
    ids = torch.randint(3, 95, (1, 20), generator=torch.Generator().manual_seed(1))
    # 20 + 13 tokens: the last forward sees 32 positions, which fit
    want = reference.generate(input_ids=ids, max_new_tokens=13, do_sample=False)
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=13, do_sample=False), want)
    calls = patched_model(model).controller.attention_calls
    with pytest.raises(ValueError, match=r"20 tokens with max_new_tokens=14 runs past the model's maximum length 32.*"
                                         r"at most 13 new tokens fit"):
        model.generate(input_ids=ids, max_new_tokens=14)
    with pytest.raises(ValueError, match="max_length=40 runs past the model's maximum length 32"):
        model.generate(input_ids=ids, max_length=40)
    with pytest.raises(ValueError, match="max_length=40"):
        model.generate(input_ids=ids, generation_config=GenerationConfig(max_length=40))
    assert patched_model(model).controller.attention_calls == calls  # refused before the prompt ran
    assert_no_pages_held(model)


def test_bf16_generate_runs_and_follows_the_unpatched_model():
    reference, model = tiny_pair("qwen2", seed=5)
    reference, model = reference.to(torch.bfloat16), model.to(torch.bfloat16)
    ids, mask = left_padded_batch((7, 4), seed=4)
    want = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    sparsecompile.optimize(model, page_size=4)
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert got.shape == want.shape and torch.equal(got[:, :ids.shape[1] + 1], want[:, :ids.shape[1] + 1])


def test_save_pretrained_of_a_patched_model(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    pair[1].save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "sparsecompile" not in json.dumps(config)  # a plain checkpoint, loadable without sparsecompile
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 95, (1, 6), generator=torch.Generator().manual_seed(4))
    assert torch.equal(loaded.generate(input_ids=ids, max_new_tokens=5, do_sample=False),
                       pair[0].generate(input_ids=ids, max_new_tokens=5, do_sample=False))


def test_a_multimodal_model_generates_text_like_its_unpatched_self_and_refuses_images():
    """``AutoModelForCausalLM`` loads Gemma 3 as ``Gemma3ForConditionalGeneration``; transformers' generate() hands it
    ``mm_encoder_outputs={}`` without images. Text-only generation equals the unpatched model (greedy, snapkv kept
    dense) in ``generate()`` and ``LLM``; images are refused up front, naming them."""
    import copy

    from transformers import AutoModelForCausalLM, Gemma3Config

    text = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=6, query_pre_attn_scalar=16, pad_token_id=0,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=99,
                          boi_token_index=97, eoi_token_index=98)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    ids, mask = left_padded_batch((7, 12), seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = reference.generate(**kwargs)
    llm = sparsecompile.LLM(model, "snapkv", tokenizer=tiny_tokenizer(), budget=64, window=4, max_model_len=64,
                            page_size=4)
    assert torch.equal(model.generate(**kwargs), want)
    prompts = [ids[i][mask[i].bool()].tolist() for i in range(2)]
    outs = llm.generate(prompts, sparsecompile.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:, ids.shape[1]:].tolist()
    with pytest.raises(ValueError, match="pixel_values: images, video and audio are not supported"):
        model.generate(**kwargs, pixel_values=torch.randn(2, 3, 28, 28))
    assert_no_pages_held(model)


def test_a_model_whose_forward_takes_no_position_ids_decodes_in_its_own_numbering():
    """generate() builds position_ids from the padding mask only for a forward that takes them; otherwise the model
    numbers every column, padding included (MOSS-Transcribe-Diarize, ...). The decode loop continues the prefill's
    numbering: a left-padded row decoded by the mask's numbering attended at the wrong distances (logits off by ~7)."""
    from tiny_models import tiny_config
    from transformers import LlamaForCausalLM

    class NoPositionIds(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, logits_to_keep=0, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                   logits_to_keep=logits_to_keep, **kwargs)

    torch.manual_seed(0)
    reference = NoPositionIds(tiny_config("llama", initializer_range=0.5)).eval()
    model = NoPositionIds(tiny_config("llama", initializer_range=0.5)).eval()
    model.load_state_dict(reference.state_dict())
    sparsecompile.optimize(model)
    ids, mask = left_padded_batch((7, 12), seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    want, got = both((reference, model), **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    (got["cache"] if "cache" in got else got["past_key_values"]).release()
