"""``sparsecompile::dense_attention``: SDPA-compatible dense attention, the target of the SDPA-rewrite pass.

Used only for models that ignore ``set_attn_implementation`` (Falcon before transformers 5.25): the FX pass replaces
their raw SDPA calls with this op so that every attention site is still ours, observable and
countable. On CUDA it calls SDPA too (cuDNN / flash read K/V at about 4.6 TB/s on the H200).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import define_op

#: eager calls per process (the capture check counts them)
CALLS = [0]


def dense_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
                              scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """``query [B, Hq, T, D]``, ``key/value [B, Hkv, S, D]`` -> ``[B, Hq, T, D]`` (SDPA semantics)."""
    CALLS[0] += 1
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa).contiguous()


def _fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


dense_attention = define_op(
    "dense_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, bool is_causal, "
    "float? scale, bool enable_gqa) -> Tensor",
    cpu=dense_attention_reference,
    cuda=dense_attention_reference,
    fake=_fake,
)
