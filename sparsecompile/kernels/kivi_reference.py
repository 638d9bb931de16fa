"""Torch references of the KIVI decode attention (``kivi_attention.py``'s ops): the floats of every list rebuilt
from KIVI pages and the residual ring, then fp32 softmax attention. They run the ops on CPU, the CUDA fallback for
shapes the Triton kernel does not take, and the tests' comparisons."""

from __future__ import annotations

import torch

from .kivi_quant import dequantize_keys, dequantize_values, slot_major, storage_bits, unpack_codes, unpack_value_groups
from .pool import visibility


def kivi_view_kv(kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows, index, lengths,
                 quantized, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``span`` slots of every list as floats: keys, values ``[batch, kv_heads, span, D]`` fp32, positions
    ``[batch, kv_heads, span]`` (-1 past ``lengths``) and validity (torch; the reference's and tests' view)."""
    batch, heads = index.shape[:2]
    page_size = kcode.shape[2]
    dim = kscale.shape[-1]
    bits = storage_bits(kcode, dim)
    group = page_size // kscale.shape[2]
    npages = max(1, -(-span // page_size))
    pages = index[..., :npages].long()  # [B, H, n]
    head = torch.arange(heads, device=index.device)[None, :, None]
    kc = unpack_codes(kcode[pages, head], bits)  # [B, H, n, P, D]
    k = dequantize_keys(kc.unflatten(-2, (page_size // group, group)), kscale[pages, head], kzero[pages, head])
    k = k.flatten(-3, -2).flatten(2, 3)[:, :, :span]  # [B, H, span, D]
    v = dequantize_values(unpack_value_groups(vcode[pages, head], bits), slot_major(vscale)[pages, head],
                          slot_major(vzero)[pages, head])
    v = v.flatten(2, 3)[:, :, :span]
    pos = pos_pool[pages, head].flatten(2, 3)[:, :, :span].long()
    j = torch.arange(span, device=index.device)
    rk, rv = _ring_floats(ring_k, ring_v, ring_rows, j[None, :].expand(batch, -1), heads)
    in_ring = (j[None, :] >= quantized.long()[:, None])[:, None, :, None]
    valid = j[None, None, :] < lengths.long()[..., None]
    return (torch.where(in_ring, rk, k), torch.where(in_ring, rv, v), torch.where(valid, pos, -1), valid)


def kivi_selected_kv(kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows, index, lengths,
                     quantized, quant_index, quant_count) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """:func:`kivi_view_kv` for a selection over the quantized slots: the first ``quant_count[b]`` slots of the pages
    ``quant_index [batch, kv_heads, k]`` names, then the residual (every list's slots ``[quantized, lengths)``, in
    the ring, their positions through ``index``), ``span = k * P + RING`` columns (torch, sync-free)."""
    batch, heads = index.shape[:2]
    page_size, ring = kcode.shape[2], ring_k.shape[2]
    count = quant_count.long()
    k, v, pos, valid = kivi_view_kv(kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows,
                                    quant_index, count[:, None].expand(batch, heads), count,
                                    quant_index.shape[2] * page_size)
    slot = quantized.long()[:, None] + torch.arange(ring, device=index.device)  # [B, RING]: the residual's slots
    live = slot[:, None, :] < lengths.long()[..., None]  # [B, H, RING]
    head = torch.arange(heads, device=index.device)[None, :, None]
    at = torch.where(live, slot[:, None, :], 0)
    page = torch.gather(index.long(), 2, at // page_size)
    rpos = pos_pool[page, head, at % page_size].long()
    rk, rv = _ring_floats(ring_k, ring_v, ring_rows, slot, heads)
    return (torch.cat([k, rk], 2), torch.cat([v, rv], 2), torch.cat([pos, torch.where(live, rpos, -1)], 2),
            torch.cat([valid, live], 2))


def _ring_floats(ring_k, ring_v, ring_rows, slots: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[batch, heads, n, D]`` fp32 the ring holds for row-local ``slots [batch, n]`` (at ``slot % RING`` of
    each sequence's ring row)."""
    idx = (slots % ring_k.shape[2])[:, None, :].expand(-1, heads, -1)
    rows = ring_rows.long()[:, None, None].expand_as(idx)
    head = torch.arange(heads, device=slots.device)[None, :, None].expand_as(idx)
    return ring_k[rows, head, idx].float(), ring_v[rows, head, idx].float()


def _reference_logits(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows, index,
                      lengths, quantized, q_positions, scale: float, sliding_window: int,
                      span: int, quant_index=None, quant_count=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled fp32 logits ``[batch, kv_heads, group * queries, span]`` (row ``g * T + t``; -inf where unseen) and the
    values ``[batch, kv_heads, span, D]`` of the first ``span`` slots of every list (with ``quant_index``: of
    :func:`kivi_selected_kv`'s columns)."""
    batch, q_heads, queries, dim = query.shape
    heads = index.shape[1]
    tensors = (kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows, index, lengths,
               quantized)
    if quant_index is None:
        k, v, kpos, valid = kivi_view_kv(*tensors, span)
    else:
        k, v, kpos, valid = kivi_selected_kv(*tensors, quant_index, quant_count)
    q = query.float().reshape(batch, heads, q_heads // heads * queries, dim)
    mask = visibility(kpos, valid, q_positions.repeat(1, q_heads // heads), sliding_window)  # [B, H, g*T, span]
    logits = torch.einsum("bhqd,bhnd->bhqn", q, k) * scale
    return logits.masked_fill(~mask, float("-inf")), v


def kivi_decode_attention_reference(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v,
                                    ring_rows, index, lengths, quantized, q_positions, scale: float,
                                    sliding_window: int, span: int | None = None, quant_index=None,
                                    quant_count=None) -> torch.Tensor:
    """Torch reference: rebuild the floats of every list, then fp32 softmax attention.

    Args:
        query: ``[batch, q_heads, queries, D]``.
        kcode ... vzero: KIVI page tensors; pos_pool ``[pages, kv_heads, P]``.
        ring_k, ring_v: ``[rows, kv_heads, RING, D]``; ring_rows ``[batch]`` int64.
        index: ``[batch, kv_heads, pages]`` page ids; lengths ``[batch, kv_heads]``; quantized ``[batch]`` (a multiple
            of the group size; the quantized prefix of every head of the row).
        q_positions: ``[batch, queries]`` (-1: padding query).
        span: slots of every list to rebuild (None: the longest list's, read from ``lengths``: a host sync; the
            CUDA fallback passes the view's capacity so that it can run inside a CUDA graph capture).
        quant_index, quant_count: a selection over the quantized slots (Quest over KIVI pages): ``[batch, kv_heads,
            k]`` page ids and ``[batch]`` slots; each list then reads the first ``quant_count[b]`` slots of those
            pages, in place of its quantized slots ``[0, quantized)``, and its residual ``[quantized, lengths)``
            (``span`` unused: sync-free).
    Returns:
        ``[batch, queries, q_heads, D]`` in ``query.dtype``.
    """
    batch, q_heads, queries, dim = query.shape
    if span is None and quant_index is None:
        span = int(lengths.max()) if lengths.numel() else 0
    out = torch.zeros(batch, queries, q_heads, dim, dtype=query.dtype, device=query.device)
    if span == 0:
        return out
    logits, v = _reference_logits(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v,
                                  ring_rows, index, lengths, quantized, q_positions, scale, sliding_window, span,
                                  quant_index, quant_count)
    probs = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)  # a query that sees nothing returns zeros
    o = torch.einsum("bhqn,bhnd->bhqd", probs, v)  # [B, H, g*T, D], row = g * T + t
    return o.reshape(batch, q_heads, queries, dim).transpose(1, 2).to(query.dtype).contiguous()


def kivi_decode_attention_logits_reference(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k,
                                           ring_v, ring_rows, index, lengths, quantized, q_positions, scale: float,
                                           sliding_window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kivi_decode_attention_reference` for one decode query per sequence, plus what a method that scores by
    attention probabilities reads (H2O over KIVI storage): each query's log-sum-exp ``[batch, q_heads, 1]`` fp32 and
    its scaled logits per view position ``[batch, q_heads, pages * P]`` fp32, -inf where unseen (past ``lengths``
    included), so that ``exp(logits - lse)`` is the probability the attention gave the slot; the logits of quantized
    slots are those of their dequantized keys. Sync-free: every slot of the view's capacity is rebuilt."""
    check_one_query(query)
    batch, q_heads, _, dim = query.shape
    span = index.shape[2] * kcode.shape[2]
    logits, v = _reference_logits(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v,
                                  ring_rows, index, lengths, quantized, q_positions, scale, sliding_window, span)
    lse = torch.logsumexp(logits, -1)  # [B, H, g]: -inf for a query that sees nothing
    probs = torch.nan_to_num(torch.exp(logits - lse[..., None]), nan=0.0)
    out = torch.einsum("bhqn,bhnd->bhqd", probs, v).reshape(batch, q_heads, 1, dim).transpose(1, 2)
    return (out.to(query.dtype).contiguous(), lse.reshape(batch, q_heads, 1).contiguous(),
            logits.reshape(batch, q_heads, span).contiguous())


def check_one_query(query: torch.Tensor) -> None:
    if query.shape[2] != 1:
        raise ValueError(f"kivi_decode_attention_logits: one decode query per sequence, got {query.shape[2]}")
