"""``sparsecompile::topk_select``: per-row top-``count`` entries of a score tensor, as ascending indices.

Shared by the dynamic-selection methods (Quest picks pages, OmniKV picks prompt tokens). Every
``(batch, head)`` row keeps its ``counts[b, h]`` highest scores; the kept *indices* are returned in
ascending order (so the attention reads pages / slots in their natural order and the last page stays
last), padded with ``-1`` up to the static width ``k``. Ties at the threshold go to the lower index,
so the selection is deterministic (unlike ``torch.topk``). Callers force an entry in with a score of
``+inf`` and keep one out with ``-inf`` (and a count that does not reach it).

On CUDA a Triton kernel does a radix select (32 one-bit passes over the row find the ``count``-th
largest score, then one ordered pass writes the winners with a running prefix sum): no sort, and the
output is ascending by construction. A row of up to 16K scores is loaded once and every pass runs
from registers; longer rows stream ``O(33 * n)`` reads in one program.
"""

from __future__ import annotations

import torch

from .library import define_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def topk_select_reference(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """Torch reference.

    Args:
        scores: ``[batch, heads, n]`` floating scores.
        counts: ``[batch, heads]`` integer, entries to keep per row (clamped to ``[0, min(k, n)]``).
        k: static output width.
    Returns:
        ``[batch, heads, k]`` int64: the kept indices ascending, then ``-1``.
    """
    n = scores.shape[-1]
    # A stable descending sort ranks equal scores by index, which fixes the tie rule.
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices
    rank = torch.arange(n, device=scores.device)
    keep_rank = rank < counts.long().clamp(0, min(k, n))[..., None]
    kept = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter(-1, order, keep_rank)
    ascending = torch.sort(torch.where(kept, rank, n), dim=-1).values
    if k > n:
        ascending = torch.cat([ascending, ascending.new_full((*ascending.shape[:-1], k - n), n)], dim=-1)
    out = ascending[..., :k]
    return torch.where(out < n, out, torch.full_like(out, -1))


if triton is not None:

    @triton.jit
    def _order_key(x):
        """float32 -> int64 key in ``[0, 2**32)`` with the same order (IEEE bits, negatives flipped)."""
        bits = x.to(tl.int32, bitcast=True).to(tl.int64)
        return tl.where(bits >= 0, bits + 2147483648, -1 - bits)

    @triton.jit
    def _topk_select_kernel(S, C, OUT, stride_sb, stride_sh, stride_cb, stride_ch, stride_ob, stride_oh,
                            n, k_out, HEADS: tl.constexpr, BLOCK: tl.constexpr, ONE_TILE: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // HEADS
        h = pid % HEADS
        row = S + b * stride_sb + h * stride_sh
        out = OUT + b * stride_ob + h * stride_oh
        count = tl.load(C + b * stride_cb + h * stride_ch).to(tl.int64)
        count = tl.minimum(tl.maximum(count, 0), tl.minimum(k_out, n))
        offs = tl.arange(0, BLOCK)
        if ONE_TILE:
            # The whole row fits one tile: load it once and run every pass from registers.
            valid = offs < n
            key = _order_key(tl.load(row + offs, mask=valid, other=0.0).to(tl.float32))
            thr = tl.zeros([], dtype=tl.int64)
            for i in range(32):
                cand = thr | (tl.full([], 1, tl.int64) << (31 - i))
                thr = tl.where(tl.sum((valid & (key >= cand)).to(tl.int64), 0) >= count, cand, thr)
            ties = count - tl.sum((valid & (key > thr)).to(tl.int64), 0)
            is_eq = (valid & (key == thr)).to(tl.int64)
            take = (valid & (key > thr)) | ((is_eq > 0) & (tl.cumsum(is_eq, 0) - is_eq < ties))
            take_i = tl.where(take & (count > 0), 1, 0).to(tl.int64)
            tl.store(out + tl.cumsum(take_i, 0) - take_i, offs.to(tl.int64), mask=take_i > 0)
            written = tl.sum(take_i, 0)
        else:
            # Radix select: the largest key t with at least `count` keys >= t is the count-th largest key.
            thr = tl.zeros([], dtype=tl.int64)
            for i in range(32):
                cand = thr | (tl.full([], 1, tl.int64) << (31 - i))
                total = tl.zeros([], dtype=tl.int64)
                for start in range(0, n, BLOCK):
                    idx = start + offs
                    key = _order_key(tl.load(row + idx, mask=idx < n, other=0.0).to(tl.float32))
                    total += tl.sum(((idx < n) & (key >= cand)).to(tl.int64), 0)
                thr = tl.where(total >= count, cand, thr)
            greater = tl.zeros([], dtype=tl.int64)
            for start in range(0, n, BLOCK):
                idx = start + offs
                key = _order_key(tl.load(row + idx, mask=idx < n, other=0.0).to(tl.float32))
                greater += tl.sum(((idx < n) & (key > thr)).to(tl.int64), 0)
            ties = count - greater  # keys equal to the threshold still to take, lowest index first
            written = tl.zeros([], dtype=tl.int64)
            tie_seen = tl.zeros([], dtype=tl.int64)
            for start in range(0, n, BLOCK):
                idx = start + offs
                valid = idx < n
                key = _order_key(tl.load(row + idx, mask=valid, other=0.0).to(tl.float32))
                is_eq = (valid & (key == thr)).to(tl.int64)
                tie_rank = tie_seen + tl.cumsum(is_eq, 0) - is_eq
                take = (valid & (key > thr)) | ((is_eq > 0) & (tie_rank < ties))
                take_i = tl.where(take & (count > 0), 1, 0).to(tl.int64)
                dst = written + tl.cumsum(take_i, 0) - take_i
                tl.store(out + dst, idx.to(tl.int64), mask=take_i > 0)
                written += tl.sum(take_i, 0)
                tie_seen += tl.sum(is_eq, 0)
        for start in range(0, k_out, BLOCK):
            idx = start + offs
            tl.store(out + idx, tl.full([BLOCK], -1, tl.int64), mask=(idx < k_out) & (idx >= written))


def topk_select_triton(scores: torch.Tensor, counts: torch.Tensor, k: int, max_tile: int = 16384) -> torch.Tensor:
    """Triton launch with the semantics of :func:`topk_select_reference`.

    Rows of up to ``max_tile`` scores are loaded once into one tile and the 33 passes run from registers;
    longer rows stream through tiles of 1024 scores on every pass.
    """
    batch, heads, n = scores.shape
    if scores.stride(2) != 1:
        scores = scores.contiguous()
    out = torch.empty(batch, heads, k, dtype=torch.int64, device=scores.device)
    if batch * heads == 0 or k == 0:
        return out
    one_tile = n <= max_tile
    block = max(16, triton.next_power_of_2(max(n, k))) if one_tile else 1024
    _topk_select_kernel[(batch * heads,)](
        scores, counts, out, scores.stride(0), scores.stride(1), counts.stride(0), counts.stride(1),
        out.stride(0), out.stride(1), n, k, HEADS=heads, BLOCK=block, ONE_TILE=one_tile,
        num_warps=8 if block >= 4096 else 4,
    )
    return out


def _fake(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    return scores.new_empty(scores.shape[0], scores.shape[1], k, dtype=torch.int64)


topk_select = define_op(
    "topk_select(Tensor scores, Tensor counts, int k) -> Tensor",
    cpu=topk_select_reference,
    cuda=topk_select_triton if triton is not None else None,
    fake=_fake,
)
