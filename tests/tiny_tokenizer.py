"""A real (fast, word-level) HF tokenizer over the tiny models' 96-token vocabulary.

Token ``i`` is the word ``w<i>`` (0 ``<pad>``, 1 ``<s>``, 2 ``</s>``); text is words separated by spaces. It is a
``PreTrainedTokenizerFast``, so transformers' stop strings, streamers, pipelines and chat templates run on it.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

VOCAB = 96
# StopStringCriteria tokenizes "abcdef" to learn how tokens join: give it one token of its own (the last id).
_PROBE = "abcdef"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"


def word(token: int) -> str:
    return _PROBE if token == VOCAB - 1 else f"w{token}"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{word(i): i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def text_of(ids) -> str:
    return " ".join(word(int(i)) for i in ids)


def save_tiny_model(path, model_type: str = "llama", seed: int = 0):
    """Save a tiny random model and :func:`tiny_tokenizer` as an HF directory; returns the unpatched model."""
    from tiny_models import tiny_pair

    reference, _ = tiny_pair(model_type, seed=seed)
    reference.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return reference
