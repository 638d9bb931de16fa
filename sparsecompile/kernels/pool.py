"""Pool helpers shared by the ops and the KV core: expand a view to slots, read slots, visibility.

The KV pool is ``[num_pages, kv_heads, page_size, *rest]``; a *global slot id* is ``page * page_size + offset``.
An AttentionView names, per ``(sequence, kv_head)``, entries of ``block_size`` slots (pages, or single slots)
and how many slots are read; these helpers turn that into slot ids and masks (traceable, except
:func:`used_view_slots`, which syncs with the host and serves the opaque torch references only).
"""

from __future__ import annotations

import torch


def view_slots(index: torch.Tensor, lengths: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand a view's entries to global slot ids.

    Args:
        index: ``[batch, kv_heads, entries]`` int32 page ids (``block_size = page_size``) or slot ids (1).
        lengths: ``[batch, kv_heads]`` number of slots read.
    Returns:
        ``slots [batch, kv_heads, entries * block_size]`` int64 (0 where invalid) and ``valid`` (bool, same shape).
    """
    span = index.shape[-1] * block_size
    j = torch.arange(span, device=index.device)
    slots = index.long().repeat_interleave(block_size, dim=-1) * block_size + (j % block_size)
    valid = j < lengths[..., None].long()
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


def used_view_slots(index: torch.Tensor, lengths: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`view_slots` cut at the longest list (a host sync: for the opaque torch references only)."""
    span = int(lengths.max()) if lengths.numel() else 0
    return view_slots(index[..., : max(1, -(-span // block_size))], lengths, block_size)


def gather_slots(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Read ``pool [num_pages, kv_heads, page_size, *rest]`` at ``slots [batch, kv_heads, n]``.

    Returns ``[batch, kv_heads, n, *rest]``.
    """
    page_size = pool.shape[2]
    head = torch.arange(pool.shape[1], device=slots.device)[None, :, None]
    return pool[slots // page_size, head, slots % page_size]


def visibility(kpos: torch.Tensor, valid: torch.Tensor, q_positions: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """``[batch, kv_heads, queries, slots]`` bool: which slot each query may attend to (see module doc)."""
    qpos = q_positions[:, None, :, None].long()
    k = kpos[:, :, None, :].long()
    mask = (valid & (kpos >= 0))[:, :, None, :] & (k <= qpos)
    if sliding_window > 0:
        mask = mask & (k > qpos - sliding_window)
    return mask


def launch_inputs(query: torch.Tensor, index: torch.Tensor,
                  q_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels index the last dim of ``query`` / ``index`` and all of ``q_positions`` densely."""
    if query.stride(3) != 1:
        query = query.contiguous()
    if index.stride(2) != 1:
        index = index.contiguous()
    return query, index, q_positions.contiguous()
