"""Inspection API over a patched model or one of its caches."""

from __future__ import annotations

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
