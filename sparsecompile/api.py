"""Inspection API over a patched model or one of its caches."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .models.hf_cache import SparseCache
from .models.hf_patch import patched_model
from .runtime.controller import SparseController
from .runtime.stats import KVStats, collect


def _resolve(target: nn.Module | SparseCache) -> tuple[SparseController, list[int]]:
    if isinstance(target, SparseCache):
        return target.controller, list(target.rows)
    if not isinstance(target, nn.Module):
        raise ValueError(f"expected a model patched by sparsecompile.optimize() or a SparseCache, got "
                         f"{type(target).__name__}")
    patched = patched_model(target)
    cache = patched.last_cache
    rows = list(cache.rows) if cache is not None and cache.rows else []
    return patched.controller, rows


def kv_stats(target: nn.Module | SparseCache) -> KVStats:
    """Per-layer resident tokens and bytes, pages allocated and free.

    For a model, the statistics are those of the cache of its most recent forward (a released
    cache reports nothing resident); pass a :class:`SparseCache` to inspect a specific one.
    """
    controller, rows = _resolve(target)
    manager = controller.manager
    name = controller.runtime.name
    if manager is None:
        return KVStats(name, controller.layout.page_size, 0, 0)
    return collect(manager, rows, name, controller.runtime.tokens_read(manager, rows))


def retained_positions(target: nn.Module | SparseCache, layer: int) -> list[list[torch.Tensor]]:
    """For each batch item and KV head of ``layer``, the sorted logical positions still resident."""
    controller, rows = _resolve(target)
    if controller.manager is None or not rows:
        raise ValueError("no live cache: run a forward (or generate with return_dict_in_generate=True) first")
    if not 0 <= layer < controller.layout.num_layers:
        raise ValueError(f"layer {layer} is out of range (0..{controller.layout.num_layers - 1})")
    return [controller.manager.retained_positions(row, layer) for row in rows]


def _check_token_ids(name: str, ids: Any, vocab: int | None) -> None:
    """A ``[batch, tokens]`` integer tensor of at least one token, every id in ``[0, vocab)``."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] == 0 or ids.is_floating_point() \
            or ids.dtype == torch.bool:
        got = f"a {ids.dim()}-D {ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) \
            else type(ids).__name__
        raise ValueError(f"{name} must be a [batch, tokens] tensor of integer token ids with at least one token, got "
                         f"{got} (one sequence: ids[None])")
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{name} holds ids outside the model's vocabulary [0, {vocab})")


def compress(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             question_ids: torch.Tensor | None = None) -> SparseCache:
    """Run a context through ``model``'s sparse method once and return its cache, to answer several questions.

    ``input_ids [batch, context]`` (left-padded with ``attention_mask`` for batches) is prefilled as a prompt: an
    eviction method compresses it (SnapKV scores with the context's last ``window`` tokens, as kvpress does without a
    question). With ``question_ids [batch, q]`` the scoring is query-aware instead: the question is prefilled after
    the context, so its queries form the observation window (and, for H2O, add their attention), then its own
    entries are removed, so the cache again holds the context only. Either way, ask each question on a fork::

        cache = sparsecompile.compress(model, context_ids)
        for q in questions:
            ids = torch.cat([context_ids, q], dim=1)
            out = model.generate(ids, past_key_values=cache.fork(), max_new_tokens=64)

    Query-agnostic (no ``question_ids``) is right when the questions are not known in advance or are many;
    query-aware keeps what one known question needs and serves that question (or close ones) best.
    """
    patched = patched_model(model)
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    _check_token_ids("input_ids", input_ids, vocab)
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; it must match input_ids "
                         f"{tuple(input_ids.shape)} (1 for tokens, 0 for left padding)")
    context = input_ids.shape[1]
    ids, mask = input_ids, attention_mask
    if question_ids is not None:
        _check_token_ids("question_ids", question_ids, vocab)
        if question_ids.shape[0] != input_ids.shape[0]:
            raise ValueError(f"question_ids has {question_ids.shape[0]} rows for a batch of {input_ids.shape[0]}")
        ids = torch.cat([input_ids, question_ids.to(input_ids.device)], dim=1)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(question_ids.shape)], dim=1)
    # generate() numbers positions by the padding mask; a later generate() on a fork continues from the same ones
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0) if mask is not None else None
    cache = SparseCache(patched.controller)
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=positions, **{patched.cache_name: cache},
              use_cache=True, logits_to_keep=1)
        if question_ids is not None:
            valid = (mask[:, :context].sum(1) if mask is not None
                     else torch.full((ids.shape[0],), context)).tolist()
            patched.controller.drop_positions(cache.rows, [int(v) for v in valid])  # positions count valid tokens
            cache.processed, cache.next_positions = context, None  # the question's positions are gone
    except BaseException:
        cache.release()
        raise
    return cache


def warmup(model: nn.Module, batch_sizes: tuple[int, ...] | list[int] = (1,), prompt_len: int = 1024,
           max_new_tokens: int = 256, programs: bool = False) -> dict[int, float]:
    """Compile the decode step ahead of time, for each batch size, at the pool geometry ``generate()`` uses for
    prompts of ``prompt_len`` tokens and ``max_new_tokens`` new ones; returns seconds per batch size.

    Later ``generate()`` calls of that geometry in this process reuse the graphs; other processes find them in the
    on-disk compile cache (``EngineConfig.compile_cache``). ``sparsecompile warmup`` runs this from the shell. A
    method with several decode variants (Quest's dense read of short batches) gets each variant's graph.

    ``programs``: also export each batch size's decode step and compile it into an AOTInductor package in the cache
    (``serving/decode_programs.py``; minutes on an 8B model): a later process's ``optimize()`` + ``generate()`` of
    that geometry then loads the program instead of tracing the step (dynamo's tracing is most of a warm process's
    first call).
    """
    import time

    patched = patched_model(model)
    if not patched.controller.compiles_decode:
        raise ValueError("this model's decode step is not compiled (compile=False, or not on CUDA): nothing to warm up")
    device = next(model.parameters()).device
    seconds = {}
    controller = patched.controller
    for batch in batch_sizes:
        ids = torch.zeros(batch, prompt_len, dtype=torch.long, device=device)
        start = time.perf_counter()
        for variant in controller.runtime.decode_variants:
            cache = SparseCache(controller, expected_new_tokens=max_new_tokens)  # the pool generate() would size
            try:
                with controller.forced_variant(variant):
                    model.generate(ids, attention_mask=torch.ones_like(ids), **{patched.cache_name: cache},
                                   max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
                if programs:
                    from .serving.decode_programs import build  # at the geometry the generate() left (pool held)

                    build(model, batch, variant)
            finally:
                cache.release()
        seconds[batch] = time.perf_counter() - start
    return seconds
