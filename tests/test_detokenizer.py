"""Incremental detokenization through the Rust decoder (``text_decoder``): the same text as the tokenizer's own
``decode`` after every token, and the tokenizer's ``decode`` wherever transformers post-processes it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_llm import DigitTokenizer

from sparsecompile.serving.detokenizer import Detokenizer, text_decoder
from sparsecompile.serving.outputs import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)


def _texts(tokenizer, decode, prompt: list[int], out: list[int], skip: bool) -> list[str]:
    """The detokenizer's text after each of ``out``'s tokens."""
    d = Detokenizer(tokenizer, SamplingParams(max_tokens=10**6, skip_special_tokens=skip), set(), prompt, decode)
    texts = []
    for token in out:
        d.append(token)
        texts.append(d.text)
    return texts


def test_a_plain_fast_tokenizer_decodes_through_rust(tokenizer):
    decode = text_decoder(tokenizer)
    ids = tokenizer.encode("It 's a test , is n't it ? Caf\u00e9 \U0001F600", add_special_tokens=False)
    assert decode(ids, True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert decode.__qualname__ == "text_decoder.<locals>.rust"
    assert text_decoder(DigitTokenizer()).__qualname__ == "_own_decode.<locals>.slow"


@given(data=st.data(), skip=st.booleans())
@settings(max_examples=40, deadline=None)
def test_rust_decoding_gives_the_tokenizers_text_after_every_token(tokenizer, data, skip):
    """Random ids (byte tokens that split characters, special tokens, prompt tails cut inside a character):
    the same text as the tokenizer's own ``decode`` after every token, so stop strings stop at the same token."""
    text = "Caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F600\U0001F44D\U0001F3FD \u03a9 It 's , here ."
    pool = tokenizer.encode(text, add_special_tokens=False) + list(tokenizer.all_special_ids)
    ids = st.lists(st.one_of(st.sampled_from(pool), st.integers(0, tokenizer.backend_tokenizer.get_vocab_size() - 1)),
                   min_size=1, max_size=24)
    prompt, out = data.draw(ids), data.draw(ids)
    assert (_texts(tokenizer, text_decoder(tokenizer), prompt, out, skip)
            == _texts(tokenizer, None, prompt, out, skip))


def test_post_processing_tokenizers_keep_their_own_decode(tokenizer, smollm2_path):
    """transformers' space cleanup (forced on here for this BPE tokenizer) and a subclass's own ``_decode`` change
    the text after the Rust decoder: those keep the tokenizer's ``decode``."""
    from transformers import AutoTokenizer

    cleaned = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True, clean_up_tokenization_spaces=True,
                                            clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    ids = cleaned.encode("It 's a test , is n't it ?", add_special_tokens=False)
    assert cleaned.decode(ids) != tokenizer.decode(ids)  # the cleanup does apply
    decode = text_decoder(cleaned)
    assert decode.__qualname__ == "_own_decode.<locals>.slow" and decode(ids, True) == cleaned.decode(ids)

    class Shouting(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting.from_pretrained(smollm2_path, local_files_only=True)
    assert text_decoder(shouting).__qualname__ == "_own_decode.<locals>.slow"
