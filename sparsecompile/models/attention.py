"""The transformers AttentionInterface entry: every attention layer of a patched model lands here.

``optimize()`` registers :func:`sparse_attention_forward` under :data:`ATTN_IMPLEMENTATION` (with a
matching AttentionMaskInterface entry) and attaches the model's SparseController to each attention
module. The function receives the new, un-repeated K/V (our cache adapter never concatenates) and
hands them to the controller, which writes them to the paged pool and attends over its view.

Masking is owned by the kernel, not by transformers: padding tokens never enter the pool and
causality / sliding windows are applied from logical positions. transformers sizes its masks from
one layer only, so they cannot describe per-layer, per-head retained sets anyway. The registered
mask function therefore builds nothing.
"""

from __future__ import annotations

import torch
from torch import nn

ATTN_IMPLEMENTATION = "sparsecompile"
CONTROLLER_ATTR = "_sparsecompile_controller"


def sparse_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """AttentionInterface function.

    ``query [B, Hq, T, D]``, ``key/value [B, Hkv, T, D]`` (new tokens only) -> ``([B, T, Hq, D], None)``.
    """
    controller = getattr(module, CONTROLLER_ATTR, None)
    if controller is None:
        raise RuntimeError(f"{type(module).__name__} uses the sparsecompile attention implementation but was not "
                           "patched by sparsecompile.optimize()")
    if softcap:
        raise NotImplementedError("attention logit softcapping is not implemented by sparsecompile yet")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not implemented by sparsecompile yet")
    if dropout and module.training:
        raise NotImplementedError("sparsecompile attention is inference-only (dropout > 0 in training mode)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = controller.attend(module.layer_idx, query, key, value, float(scale), int(sliding_window or 0))
    return out, None


def _no_mask(*args, **kwargs) -> None:
    """Mask interface entry: the kernel masks from positions (see module docstring)."""
    return None


def register_attention() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, sparse_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
