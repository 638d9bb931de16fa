"""``sparsecompile::snapkv_scores``: SnapKV's observation-window scores over an AttentionView.

For each query head, the softmax probabilities (fp32) that the observation-window queries give to
every slot of the view, summed over the window queries (SnapKV / KVCache-Factory sum; kvpress takes
the mean, which ranks identically). Pooling, the GQA group average and the top-k live in the method
(``methods/snapkv.py``): they are cheap and need the prompt layout. On CUDA: the window queries' lse
split over the slots, then the slot-tile-parallel mass pass (see :mod:`attention_mass`).
"""

from __future__ import annotations

import torch

from .attention_mass import triton, view_scores_triton
from .attention_mass_reference import SUM, TO_HEAD, view_scores_reference
from .library import define_op


def snapkv_scores_reference(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                            lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                            sliding_window: int) -> torch.Tensor:
    """Torch reference.

    Args:
        query: ``[batch, q_heads, window, head_dim]`` the observation-window queries (RoPE applied).
        k_pool, pos_pool: the pool (``[num_pages, kv_heads, page_size, head_dim]`` / ``[..., page_size]``).
        index, lengths: the view (``[batch, kv_heads, entries]``, ``[batch, kv_heads]``).
        q_positions: ``[batch, window]`` logical positions of the window queries (-1: no query).
    Returns:
        ``[batch, q_heads, entries * block_size]`` fp32, column ``j`` = the view's ``j``-th slot (0 past ``lengths``).
    """
    return view_scores_reference(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                 sliding_window, SUM, TO_HEAD)


def snapkv_scores_triton(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                         lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                         sliding_window: int, lse_config: dict | None = None,
                         mass_config: dict | None = None) -> torch.Tensor:
    """Triton launch with the semantics of :func:`snapkv_scores_reference` (configs: see :mod:`attention_mass`)."""
    return view_scores_triton(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                              sliding_window, SUM, TO_HEAD, lse_config, mass_config)


def _fake(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window):
    return query.new_empty(query.shape[0], query.shape[1], index.shape[-1] * block_size, dtype=torch.float32)


snapkv_scores = define_op(
    "snapkv_scores(Tensor query, Tensor k_pool, Tensor pos_pool, Tensor index, Tensor lengths, Tensor q_positions, "
    "int block_size, float scale, int sliding_window) -> Tensor",
    cpu=snapkv_scores_reference,
    cuda=snapkv_scores_triton if triton is not None else None,
    fake=_fake,
)
