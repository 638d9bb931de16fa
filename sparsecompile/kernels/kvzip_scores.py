"""``sparsecompile::kvzip_scores``: KVzip's reconstruction scores over an AttentionView.

KVzip (Kim et al. 2025) scores a cached context chunk by how much the model attends to it while
re-reading it: the "repeat" prompt plus the chunk itself is fed after the context, and each cached
slot's score is the **maximum**, over the KV head's query group and over the repeat queries, of the
softmax probability that query gives the slot (kvpress ``KVzipPress``: softmax over the [sink, cached
chunk, repeat] keys). The view names exactly those keys (a slot list, ``block_size = 1``, or a page
view); the repeat tokens sit at positions after the context, so the usual causal visibility applies
among them. Each query's softmax runs over the view slots it sees (visibility as
:func:`paged_attention.visibility`); probabilities are fp32 (kvpress uses the model dtype). The method
slices the chunk's columns out of the result.

On CUDA: the queries' lse (split over the slots when they are few), then the slot-tile-parallel mass
pass with a max reduction (see :mod:`attention_mass`).
"""

from __future__ import annotations

import torch

from .attention_mass import triton, view_scores_triton
from .attention_mass_reference import MAX, TO_KV_HEAD, view_scores_reference
from .library import define_op


def kvzip_scores_reference(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                           lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                           sliding_window: int) -> torch.Tensor:
    """Torch reference.

    Args:
        query: ``[batch, q_heads, queries, head_dim]`` the repeat queries (RoPE applied).
        k_pool, pos_pool: the pool (``[num_pages, kv_heads, page_size, head_dim]`` / ``[..., page_size]``).
        index, lengths: the view (``[batch, kv_heads, entries]``, ``[batch, kv_heads]``).
        q_positions: ``[batch, queries]`` logical positions (-1: padding, contributes nothing).
    Returns:
        ``[batch, kv_heads, entries * block_size]`` fp32, column ``j`` = the view's ``j``-th slot (0 past
        ``lengths`` and where no query sees the slot).
    """
    return view_scores_reference(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                 sliding_window, MAX, TO_KV_HEAD)


def kvzip_scores_triton(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                        lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                        sliding_window: int, lse_config: dict | None = None,
                        mass_config: dict | None = None) -> torch.Tensor:
    """Triton launch with the semantics of :func:`kvzip_scores_reference` (configs: see :mod:`attention_mass`)."""
    return view_scores_triton(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                              sliding_window, MAX, TO_KV_HEAD, lse_config, mass_config)


def _fake(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window):
    return query.new_empty(query.shape[0], k_pool.shape[1], index.shape[-1] * block_size, dtype=torch.float32)


kvzip_scores = define_op(
    "kvzip_scores(Tensor query, Tensor k_pool, Tensor pos_pool, Tensor index, Tensor lengths, Tensor q_positions, "
    "int block_size, float scale, int sliding_window) -> Tensor",
    cpu=kvzip_scores_reference,
    cuda=kvzip_scores_triton if triton is not None else None,
    fake=_fake,
)
