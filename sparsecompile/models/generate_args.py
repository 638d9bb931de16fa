"""What the patched ``generate()`` accepts of transformers' options, checked before any work starts.

transformers' ``generate()`` consumes most of its keyword arguments itself (generation-config fields,
logits processors, stopping criteria, streamers); the rest become ``model_kwargs`` that reach ``forward``
through ``prepare_inputs_for_generation``, which forwards every key it does not know. Two of generate()'s
own arguments leak that way: ``tokenizer`` and ``assistant_tokenizer`` are popped into the
"generation mode" kwargs and handed to the decoding method (``_sample(..., **generation_mode_kwargs,
**model_kwargs)``), whose signature does not name them, so they land in ``model_kwargs`` and are passed to
``forward``. The stock forward swallows them in ``**kwargs``; the patched forward ignores exactly these
(:data:`GENERATE_ONLY`) and refuses any other argument it cannot honour.

Refused up front, naming the option: a multimodal model's images, video or audio (its language model is what
is patched), decoding modes that reorder or roll back the cache (beam search and
its variants, contrastive search, assisted / speculative decoding, DoLa), ``output_attentions`` and
``output_hidden_states`` (the sparse forward returns logits only), cache implementations that promise a
memory behaviour we do not provide (offloaded, quantized, paged), and a prompt plus ``max_new_tokens`` that
runs past the model's position limit (checked before the prompt is processed, so no tokens are lost).
Cache implementations that only pick a layout (``dynamic``, ``static``, ``hybrid``, ``sliding_window``) are
dropped: sparsecompile's paged pool is the cache.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

#: generate()'s own arguments that transformers passes on to ``forward`` (see the module docstring)
GENERATE_ONLY = frozenset({"tokenizer", "assistant_tokenizer"})

_CACHE_REFUSALS = {
    "paged": "switches generate() to transformers' own continuous batching, which bypasses sparsecompile; use "
             "sparsecompile.LLM for continuous batching",
    "quantized": "asks for transformers' quantized KV cache, which sparsecompile's cache replaces; optimize the model "
                 "with method='kivi' (or '<policy>+kivi', e.g. 'snapkv+kivi') to store K/V quantized",
    "offloaded": "asks for a KV cache offloaded to CPU; sparsecompile keeps its KV pool on the model's device",
}
#: a multimodal model's non-text inputs (sparsecompile patches the language model: text-only generation works)
_MULTIMODAL_INPUTS = ("pixel_values", "pixel_values_videos", "image_embeds", "input_features", "input_values",
                      "audio_values", "mm_encoder_outputs")
_DEFAULT_MAX_LENGTH = 20  # transformers' global default when neither max_length nor max_new_tokens is set

_MODE_REFUSALS = {
    "beam_search": "beam search (num_beams > 1) reorders the cache between beams; use num_beams=1",
    "beam_sample": "beam sampling (num_beams > 1) reorders the cache between beams; use num_beams=1",
    "group_beam_search": "group beam search (num_beams > 1, num_beam_groups) reorders the cache; use num_beams=1",
    "constrained_beam_search": "constrained beam search (constraints / force_words_ids) reorders the cache between "
                               "beams; sequence_bias or bad_words_ids work with greedy decoding and sampling",
    "contrastive_search": "contrastive search (penalty_alpha with top_k > 1) rolls the cache back between "
                          "candidates; drop penalty_alpha",
    "assisted_generation": "assisted / speculative decoding (assistant_model, prompt_lookup_num_tokens, "
                           "assistant_early_exit, use_mtp) rolls rejected tokens out of the cache, which a "
                           "sparsecompile cache does not do",
    "dola_generation": "DoLa (dola_layers) contrasts early layers' hidden states, which the sparse forward does not "
                       "return",
}


@dataclass
class GenerateArguments:
    """The checked call: ``args`` / ``kwargs`` to pass on, and what the patch needs to know of it."""

    args: tuple
    kwargs: dict[str, Any]
    return_dict: bool  # return_dict_in_generate, from the call, its generation_config or the model's


def effective_generation_config(model: nn.Module, generation_config, kwargs: dict[str, Any]):
    """The generation config transformers will run with: the call's ``generation_config`` (else the model's),
    updated by the call's keyword arguments, the model's values filling what the call's config leaves unset.

    A shallow copy set attribute by attribute: no validation, no warnings (transformers does both once)."""
    base = model.generation_config
    config = copy.copy(generation_config if generation_config is not None else base)
    if generation_config is not None:
        for key, value in vars(base).items():
            if not key.startswith("_") and getattr(config, key, None) is None and value is not None:
                setattr(config, key, value)
    for key, value in kwargs.items():
        if hasattr(config, key) and not callable(getattr(config, key)):
            setattr(config, key, value)
    return config


def is_given(value: Any) -> bool:
    """An argument that carries something: not None, nor an empty container (transformers' generate() passes a
    multimodal model ``mm_encoder_outputs={}`` when there are no images: a text-only call)."""
    return value is not None and not (isinstance(value, (dict, list, tuple)) and not value)


def _cache_refusal(name: str) -> str | None:
    for key, why in _CACHE_REFUSALS.items():
        if key in name:
            return why
    return None


def _prompt_columns(bound: dict[str, Any]) -> int | None:
    """Columns of the prompt generate() will process (input_ids or inputs_embeds, padding included)."""
    embeds = bound.get("inputs_embeds")
    if embeds is not None and hasattr(embeds, "shape"):
        return int(embeds.shape[1])
    ids = bound.get("inputs") if bound.get("inputs") is not None else bound.get("input_ids")
    if ids is not None and hasattr(ids, "shape") and ids.dim() >= 2:
        return int(ids.shape[1])
    return None


def check_position_limit(columns: int | None, config, limit: int | None) -> None:
    """Refuse a prompt whose generation would run past the model's positions, before anything runs.

    The forward processing the last generated token's predecessor covers ``total - 1`` columns, where ``total``
    is the prompt plus ``max_new_tokens`` (or ``max_length``): that must fit ``limit``."""
    if limit is None or columns is None:
        return
    if columns > limit:
        raise ValueError(f"input of {columns} tokens exceeds the model's maximum length {limit} "
                         "(max_position_embeddings); shorten the prompt")
    new = config.max_new_tokens
    if new is not None:
        total, asked = columns + int(new), f"max_new_tokens={new}"
    else:
        total = max(int(config.max_length or _DEFAULT_MAX_LENGTH), columns + 1)
        asked = f"max_length={config.max_length or _DEFAULT_MAX_LENGTH}"
    if total - 1 > limit:
        raise ValueError(f"a prompt of {columns} tokens with {asked} runs past the model's maximum length {limit} "
                         f"(max_position_embeddings): at most {limit - columns + 1} new tokens fit; lower "
                         "max_new_tokens or shorten the prompt")


def check_generate_arguments(model: nn.Module, signature: inspect.Signature, args: tuple, kwargs: dict[str, Any],
                             max_length: int | None) -> GenerateArguments:
    """Check a ``generate(*args, **kwargs)`` call on the patched ``model`` (``signature``: the original
    generate's); raise ``ValueError`` naming what is not supported, else return the call to make."""
    bound = signature.bind_partial(*args, **kwargs).arguments
    bound.update(bound.pop("kwargs", None) or {})
    generation_config = bound.get("generation_config")
    config = effective_generation_config(model, generation_config, kwargs)
    mode = config.get_generation_mode(bound.get("assistant_model"))
    mode = getattr(mode, "value", mode)  # a str enum, hashed by its name: compare its value
    if mode in _MODE_REFUSALS and bound.get("custom_generate") is None:
        raise ValueError(f"{_MODE_REFUSALS[mode]}: not supported with sparsecompile")
    media = [name for name in _MULTIMODAL_INPUTS if is_given(bound.get(name))]
    if media:
        raise ValueError(f"{', '.join(media)}: images, video and audio are not supported with sparsecompile, which "
                         "serves the language model of a multimodal model (text-only generation works)")
    for name, why in (("output_attentions", "sparse attention never materialises the attention weights"),
                      ("output_hidden_states", "sparsecompile's forward returns the logits only")):
        if getattr(config, name, False):
            raise ValueError(f"{name}=True is not supported with sparsecompile: {why}")
    cache_impl = config.cache_implementation
    if cache_impl is not None:
        why = _cache_refusal(str(cache_impl))
        if why is not None:
            raise ValueError(f"cache_implementation={cache_impl!r} {why}")
        # a layout choice: sparsecompile's pool is the cache, so transformers must not build (or refuse) its own
        kwargs = dict(kwargs)
        if "cache_implementation" in kwargs:
            kwargs["cache_implementation"] = None
        elif generation_config is not None and generation_config.cache_implementation is not None:
            replaced = copy.deepcopy(generation_config)
            replaced.cache_implementation = None
            if "generation_config" in kwargs:
                kwargs["generation_config"] = replaced
            else:  # passed positionally
                args = tuple(replaced if a is generation_config else a for a in args)
        else:  # the model's own generation_config sets it
            kwargs["cache_implementation"] = None
    check_position_limit(_prompt_columns(bound), config, max_length)
    return GenerateArguments(args, kwargs, bool(config.return_dict_in_generate))
