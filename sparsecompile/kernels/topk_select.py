"""``sparsecompile::topk_select``: per-row top-``count`` entries of a score tensor, as ascending indices.

Shared by the dynamic-selection methods (Quest picks pages, OmniKV picks prompt tokens). Every
``(batch, head)`` row keeps its ``counts[b, h]`` highest scores; the kept *indices* are returned in
ascending order (so the attention reads pages / slots in their natural order and the last page stays
last), padded with ``-1`` up to the static width ``k``. Ties at the threshold go to the lower index,
so the selection is deterministic (unlike ``torch.topk``). Callers force an entry in with a score of
``+inf`` and keep one out with ``-inf`` (and a count that does not reach it).

On CUDA, rows of up to 16K scores (Quest's pages) go to a Triton select: one program loads the row
once as 32-bit order keys, block reductions find the ``count``-th largest, and one ordered pass
writes the winners with a running prefix sum (no sort; ascending by construction). The row sits in a
power-of-two main tile plus a tail tile: Quest's 8,203 pages at 128K (8,192 + a page per 16 decode
tokens) take 8,192 + 16 entries instead of 16,384 (8.69 -> 8.43 ms a Quest step at 128K x 4 on the H200,
``results/decode_h200_quest_topk.jsonl``).

The threshold search is a chain of dependent block reductions, so its length is the kernel's time
(the warps do not matter: ``results/quest_ops_sweep_h200.jsonl``). ``search="bit"``: 32 one-bit radix passes
(31 us a layer for Quest at 128K x 4 in ``results/profile_quest_128k_b4.txt``, 32.5 us alone).
``search="byte"``: four 8-bit histograms (67 us; ``tl.histogram`` is slow, ``results/kernels_ops_h200_c.jsonl``).
A two-bit variant (16 passes whose four digit counts shared one int64 reduction) took 44.2 us and was removed
(``results/kernels_ops_h200_d.jsonl``). ``search="bisect"`` (the default): bisection of the keys' range that
stops once exactly ``count`` keys lie at or above the midpoint, about log2(range / gap at the threshold)
passes instead of 32: 18.6 us against ``"bit"``'s 21.1 in the same H200 run, 32 rows of 8,208 Gaussian scores
(``results/kernels_ops_h200_bisect.jsonl``).
Longer rows (OmniKV's prompt-long rows) use :func:`topk_select_radix` (``LONG_SEARCH = "radix"``, the default):
four 8-bit radix passes whose chunks add their histograms with atomics, then per-chunk counts and ordered writes,
all over ``rows x chunks`` programs: 51.8 us for four rows of 131,236 scores (k 2,048) with 2,048-score chunks
(57.8 with 4,096, 106.7 with 8,192) against 202.2 for the torch path (``torch.topk`` for the threshold, which
spreads a row over many blocks, then the same tie rule and prefix-sum placement in torch ops, ``LONG_SEARCH =
"torch"``); OmniKV's 128K x 4 step 8.57 ms against 9.04 (``results/kernels_ops_h200_topk_radix.jsonl``,
``decode_h200_topk_{torch,radix}.jsonl``).
"""

from __future__ import annotations

import torch

from .library import define_op
from .tiles import FP_FUSION

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


def _row_cumsum(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Inclusive int64 cumsum along the last dim, in blocks: a scan over a few very long rows runs one block
    per row on CUDA (hundreds of microseconds at 128K); blocks of ``block`` then a scan of block totals do not."""
    n = x.shape[-1]
    pad = -n % block
    xb = torch.nn.functional.pad(x.long(), (0, pad)).view(*x.shape[:-1], -1, block)
    local = xb.cumsum(-1)
    before = local[..., -1].cumsum(-1) - local[..., -1]  # totals of the earlier blocks
    return (local + before[..., None]).view(*x.shape[:-1], -1)[..., :n]


def _topk_select_long(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """Torch ops with the semantics of :func:`topk_select_reference` for long rows (``torch.topk`` splits a long
    row over many blocks; one Triton program per row would stream it 33 times). The ``count``-th largest value is
    the threshold; entries above it are taken, ties at it lowest index first; a running count places them."""
    n = scores.shape[-1]
    s = scores.float()
    c = counts.long().clamp(0, min(k, n))[..., None]  # [batch, heads, 1]
    top = s.topk(min(k, n), dim=-1).values  # descending
    thr = top.gather(-1, (c - 1).clamp(min=0))
    above = s > thr
    tie = s == thr
    ties = c - above.sum(-1, keepdim=True)
    # One scan for both running counts (above in the high 32 bits, ties in the low: a row has < 2^32 entries): the
    # ties taken are the first `ties`, so the taken entries up to i are above(i) + min(ties(i), ties).
    counts = _row_cumsum((above.long() << 32) | tie.long())
    above_run, tie_run = counts >> 32, counts & 0xFFFFFFFF
    take = (above | (tie & (tie_run <= ties))) & (c > 0)
    dst = torch.where(take, above_run + torch.minimum(tie_run, ties) - 1, k)
    out = torch.full((*s.shape[:-1], k + 1), -1, dtype=torch.int64, device=s.device)
    return out.scatter_(-1, dst, torch.arange(n, device=s.device).expand_as(dst))[..., :k].contiguous()


if triton is not None:

    @triton.jit
    def _order_key(x):
        """float32 -> uint32 key with the same order (IEEE bits, negatives flipped)."""
        bits = x.to(tl.uint32, bitcast=True)
        return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)

    @triton.jit
    def _threshold_1bit(key, valid, key_t, valid_t, count, HAS_TAIL: tl.constexpr):
        """The largest key t with at least ``count`` keys >= t (the count-th largest key), one bit at a time, over
        the row's main tile and, with ``HAS_TAIL``, its tail tile."""
        thr = tl.zeros([], dtype=tl.uint32)
        for i in range(32):
            cand = thr | (tl.full([], 1, tl.uint32) << (31 - i))
            above = tl.sum((valid & (key >= cand)).to(tl.int32), 0)
            if HAS_TAIL:
                above += tl.sum((valid_t & (key_t >= cand)).to(tl.int32), 0)
            thr = tl.where(above >= count, cand, thr)
        return thr

    @triton.jit
    def _threshold_bisect(key, valid, key_t, valid_t, count, HAS_TAIL: tl.constexpr):
        """As :func:`_threshold_1bit`, by bisection of ``[min key, max key]`` that stops as soon as exactly ``count``
        keys lie at or above the midpoint (every later step would only move the threshold inside the gap under the
        count-th key). The passes needed are about log2(key range / gap at the count-th key), not 32: the leading
        bits that every key shares and the trailing bits below the gap cost nothing."""
        big = tl.full([], 0xFFFFFFFF, tl.uint32)
        lo = tl.min(tl.where(valid, key, big), 0)
        hi = tl.max(tl.where(valid, key, 0), 0)
        if HAS_TAIL:
            lo = tl.minimum(lo, tl.min(tl.where(valid_t, key_t, big), 0))
            hi = tl.maximum(hi, tl.max(tl.where(valid_t, key_t, 0), 0))
        # Invariant: the threshold (the largest t with at least count keys >= t) lies in [lo, hi].
        while lo < hi:
            d = hi - lo
            mid = lo + (d >> 1) + (d & 1)  # the upper midpoint, in (lo, hi]; no overflow at d = 2^32 - 1
            at_or_above = tl.sum((valid & (key >= mid)).to(tl.int32), 0)
            if HAS_TAIL:
                at_or_above += tl.sum((valid_t & (key_t >= mid)).to(tl.int32), 0)
            fits = at_or_above >= count
            lo = tl.where(fits, mid, lo)
            hi = tl.where(fits, tl.where(at_or_above == count, mid, hi), mid - 1)
        return lo

    @triton.jit
    def _next_digit(hist, bins, greater, count):
        """One radix step from a digit histogram (``hist`` over ``bins``; bins past 255 count nothing): the largest
        digit d whose keys at or above it, with the ``greater`` keys already known above, still reach ``count``, and
        ``greater`` plus the keys of the digits above d."""
        at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # non-increasing over digits 0..255
        fits = (bins < 256) & (greater + at_or_above >= count)
        d = tl.maximum(tl.sum(fits.to(tl.int32), 0) - 1, 0)  # fits holds exactly for digits 0..d
        return d, greater + tl.sum(tl.where(bins > d, hist, 0), 0)

    @triton.jit
    def _threshold_8bit(key, valid, count):
        """As :func:`_threshold_1bit`, one byte at a time: among the keys that share the digits chosen so far, a
        256-bin histogram of the next byte; the digit is the largest d whose keys at or above it, with the keys
        already known to be greater, still reach ``count``."""
        thr = tl.zeros([], dtype=tl.uint32)
        greater = tl.zeros([], dtype=tl.int32)  # keys above every candidate of the remaining digits
        live = valid
        bins = tl.arange(0, 512)
        for i in tl.static_range(4):
            shift = 24 - 8 * i
            digit = tl.where(live, ((key >> shift) & 0xFF).to(tl.int32), 256)  # the rest counted in bin 256
            hist = tl.where(bins < 256, tl.histogram(digit, 512), 0)
            d, greater = _next_digit(hist, bins, greater, count)
            thr = thr | (d.to(tl.uint32) << shift)
            live = live & (digit == d)
        return thr

    @triton.jit
    def _take(key, valid, thr, ties, ties_before, count):
        """0/1 per entry of a tile: above the threshold, or one of the ``ties`` equal keys to take (lowest index
        first; ``ties_before`` equal keys sit in earlier tiles)."""
        is_eq = (valid & (key == thr)).to(tl.int32)
        take = (valid & (key > thr)) | ((is_eq > 0) & (ties_before + tl.cumsum(is_eq, 0) - is_eq < ties))
        return tl.where(take & (count > 0), 1, 0).to(tl.int32), tl.sum(is_eq, 0)

    @triton.jit
    def _topk_select_kernel(S, C, OUT, stride_sb, stride_sh, stride_cb, stride_ch, stride_ob, stride_oh,
                            n, k_out, HEADS: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
                            HAS_TAIL: tl.constexpr, SEARCH: tl.constexpr):
        # One program per row; the row is in registers (entries [0, BLOCK) and, with HAS_TAIL, [BLOCK, BLOCK +
        # TAIL): a row just past a power of two need not pad to the next) and every radix pass runs from there.
        pid = tl.program_id(0)
        b = pid // HEADS
        h = pid % HEADS
        row = S + b * stride_sb + h * stride_sh
        out = OUT + b * stride_ob + h * stride_oh
        count = tl.load(C + b * stride_cb + h * stride_ch).to(tl.int32)
        count = tl.minimum(tl.maximum(count, 0), tl.minimum(k_out, n))
        offs = tl.arange(0, BLOCK)
        valid = offs < n
        key = _order_key(tl.load(row + offs, mask=valid, other=0.0).to(tl.float32))
        offs_t = BLOCK + tl.arange(0, TAIL)
        valid_t = offs_t < n
        key_t = _order_key(tl.load(row + offs_t, mask=valid_t & HAS_TAIL, other=0.0).to(tl.float32))
        if SEARCH == 2:  # (the launcher gives it one tile)
            thr = _threshold_8bit(key, valid, count)
        elif SEARCH == 1:
            thr = _threshold_1bit(key, valid, key_t, valid_t, count, HAS_TAIL)
        else:
            thr = _threshold_bisect(key, valid, key_t, valid_t, count, HAS_TAIL)
        above = tl.sum((valid & (key > thr)).to(tl.int32), 0)
        if HAS_TAIL:
            above += tl.sum((valid_t & (key_t > thr)).to(tl.int32), 0)
        ties = count - above  # keys equal to the threshold to take, lowest index first
        take, equal = _take(key, valid, thr, ties, 0, count)
        tl.store(out + tl.cumsum(take, 0) - take, offs.to(tl.int64), mask=take > 0)
        written = tl.sum(take, 0)
        if HAS_TAIL:
            take_t, _ = _take(key_t, valid_t, thr, ties, equal, count)
            tl.store(out + written + tl.cumsum(take_t, 0) - take_t, offs_t.to(tl.int64), mask=take_t > 0)
            written += tl.sum(take_t, 0)
        for start in range(0, k_out, BLOCK):
            idx = start + offs
            tl.store(out + idx, tl.full([BLOCK], -1, tl.int64), mask=(idx < k_out) & (idx >= written))

    @triton.jit
    def _radix_prefix(HIST, r, rows, count, PASSES: tl.constexpr):
        """The threshold's top ``8 * PASSES`` bits of row ``r`` from the histograms of the passes so far
        (``HIST [4, rows, 256]``: pass p counts, among the keys that share the first p digits, each value of digit
        p), and how many keys lie above every key with those bits (:func:`_next_digit` a pass)."""
        thr = tl.zeros([], dtype=tl.uint32)
        greater = tl.zeros([], dtype=tl.int32)
        bins = tl.arange(0, 256)
        for p in tl.static_range(PASSES):
            d, greater = _next_digit(tl.load(HIST + (p * rows + r) * 256 + bins), bins, greater, count)
            thr = thr | (d.to(tl.uint32) << (24 - 8 * p))
        return thr, greater

    @triton.jit
    def _radix_chunk(S, C, r, chunk, stride_sr, stride_c, n, k_out, CHUNK: tl.constexpr):
        """A program's chunk of row ``r``: offsets, validity, order keys, and the row's clamped count."""
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = offs < n
        key = _order_key(tl.load(S + r * stride_sr + offs, mask=valid, other=0.0).to(tl.float32))
        count = tl.load(C + r * stride_c).to(tl.int32)
        return offs, valid, key, tl.minimum(tl.maximum(count, 0), tl.minimum(k_out, n))

    @triton.jit
    def _radix_hist_kernel(S, C, HIST, stride_sr, stride_c, rows, n, k_out, PASS: tl.constexpr,
                           CHUNK: tl.constexpr):
        # grid (rows, chunks): this chunk's histogram of digit PASS among the keys that share the digits found by
        # the earlier passes (every program re-derives them from the earlier histograms: 256 entries a pass)
        r = tl.program_id(0)
        offs, valid, key, count = _radix_chunk(S, C, r, tl.program_id(1), stride_sr, stride_c, n, k_out, CHUNK)
        live = valid
        if PASS > 0:
            prefix, _ = _radix_prefix(HIST, r, rows, count, PASS)
            live = live & ((key >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
        digit = tl.where(live, ((key >> (24 - 8 * PASS)) & 0xFF).to(tl.int32), 256)  # the rest: bin 256
        bins = tl.arange(0, 512)
        hist = tl.histogram(digit, 512)
        tl.atomic_add(HIST + (PASS * rows + r) * 256 + bins, hist, mask=bins < 256)

    @triton.jit
    def _radix_count_kernel(S, C, HIST, TILES, stride_sr, stride_c, rows, n, k_out, CHUNK: tl.constexpr):
        # grid (rows, chunks): keys above the threshold and equal to it in this chunk -> TILES [rows, chunks, 2]
        r = tl.program_id(0)
        chunk = tl.program_id(1)
        offs, valid, key, count = _radix_chunk(S, C, r, chunk, stride_sr, stride_c, n, k_out, CHUNK)
        thr, _ = _radix_prefix(HIST, r, rows, count, 4)
        tile = TILES + (r * tl.num_programs(1) + chunk) * 2
        tl.store(tile, tl.sum((valid & (key > thr)).to(tl.int32), 0))
        tl.store(tile + 1, tl.sum((valid & (key == thr)).to(tl.int32), 0))

    @triton.jit
    def _radix_write_kernel(S, C, HIST, TILES, OUT, stride_sr, stride_c, stride_or, rows, n, k_out,
                            CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr):
        # grid (rows, chunks): this chunk's winners at their ascending positions (the earlier chunks' counts give
        # the offset and how many ties they took), then its share of the -1 padding past the count
        r = tl.program_id(0)
        chunk = tl.program_id(1)
        chunks = tl.num_programs(1)
        offs, valid, key, count = _radix_chunk(S, C, r, chunk, stride_sr, stride_c, n, k_out, CHUNK)
        thr, greater = _radix_prefix(HIST, r, rows, count, 4)
        ties = count - greater  # keys equal to the threshold to take, lowest index first
        earlier = tl.arange(0, CHUNKS_P2)
        before = earlier < chunk
        tiles = TILES + (r * chunks + earlier) * 2
        above_before = tl.sum(tl.load(tiles, mask=before, other=0), 0)
        equal_before = tl.sum(tl.load(tiles + 1, mask=before, other=0), 0)
        take, _ = _take(key, valid, thr, ties, equal_before, count)
        start = above_before + tl.minimum(equal_before, ties)
        out = OUT + r * stride_or
        tl.store(out + start + tl.cumsum(take, 0) - take, offs.to(tl.int64), mask=take > 0)
        for base in range(chunk * CHUNK, k_out, chunks * CHUNK):
            idx = base + tl.arange(0, CHUNK)
            tl.store(out + idx, tl.full([CHUNK], -1, tl.int64), mask=(idx < k_out) & (idx >= count))


SEARCHES = ("bisect", "bit", "byte")  # the kernel's SEARCH constexpr is the index
LONG_SEARCHES = ("torch", "radix")
# Rows past the one-program tile: the radix select (4x faster than the torch path at 131K scores on the H200).
LONG_SEARCH = "radix"
# Rows of at least this many scores take the radix select even within one program's tile (None: never). Quest's 32
# rows of 8,208 pages at 128K x 4 fill 32 of 132 SMs with one program each; on the H200 the radix select's rows x
# chunks programs took 41.7-45.1 us there against the one-program bisection's 18.0
# (``results/kernels_ops_h200_argmax_radix_quest.jsonl``), so no row length takes it.
RADIX_FROM: int | None = None


def _tiles(n: int, search: str) -> tuple[int, int]:
    """Main and tail tile sizes for a row of ``n`` scores: the largest power of two <= n and the power of two that
    covers the rest (0: none), so a row just past a power of two (Quest's 8,203 pages at 128K) takes 8,192 + 16
    entries, not 16,384. One tile for the 8-bit histogram select."""
    whole = max(16, triton.next_power_of_2(n))
    if search == "byte" or whole == n or n <= 16:
        return whole, 0
    main = whole // 2
    return main, max(16, triton.next_power_of_2(n - main))


def topk_select_radix(scores: torch.Tensor, counts: torch.Tensor, k: int, chunk: int = 2048) -> torch.Tensor:
    """Long rows over many programs, with the semantics of :func:`topk_select_reference`: four 8-bit radix passes
    find each row's ``count``-th largest key (a pass: every ``chunk`` of a row adds its digit histogram into the
    row's with atomics), a count pass gives each chunk's entries above and at the threshold, and a write pass
    places each chunk's winners after the earlier chunks' (ties lowest index first). Six launches and a zeroed
    histogram, each over ``rows x n / chunk`` programs, where ``torch.topk``'s path takes about a dozen kernels and
    a sort of the top values."""
    batch, heads, n = scores.shape
    rows = batch * heads
    s = scores.reshape(rows, n)
    if s.stride(1) != 1:
        s = s.contiguous()
    c = counts.reshape(rows)
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if rows == 0 or k == 0:
        return out.view(batch, heads, k)
    chunks = triton.cdiv(n, chunk)
    hist = torch.zeros(4, rows, 256, dtype=torch.int32, device=scores.device)
    tiles = torch.empty(rows, chunks, 2, dtype=torch.int32, device=scores.device)
    grid = (rows, chunks)
    for p in range(4):
        _radix_hist_kernel[grid](s, c, hist, s.stride(0), c.stride(0), rows, n, k, PASS=p, CHUNK=chunk, **FP_FUSION)
    _radix_count_kernel[grid](s, c, hist, tiles, s.stride(0), c.stride(0), rows, n, k, CHUNK=chunk, **FP_FUSION)
    _radix_write_kernel[grid](s, c, hist, tiles, out, s.stride(0), c.stride(0), out.stride(0), rows, n, k,
                              CHUNK=chunk, CHUNKS_P2=max(2, triton.next_power_of_2(chunks)), **FP_FUSION)
    return out.view(batch, heads, k)


def topk_select_triton(scores: torch.Tensor, counts: torch.Tensor, k: int, max_tile: int = 16384,
                       search: str = "bisect", num_warps: int | None = None,
                       long_search: str | None = None) -> torch.Tensor:
    """CUDA implementation with the semantics of :func:`topk_select_reference`.

    Rows of up to ``max_tile`` scores: the Triton select, one program per row; ``search`` picks how the threshold
    is found: ``"bisect"`` (the default), ``"bit"`` (32 one-bit radix passes) or ``"byte"`` (four 8-bit
    histograms). Longer rows (OmniKV's prompt-long rows), by ``long_search`` (None: ``LONG_SEARCH``): ``"torch"``
    :func:`_topk_select_long`, whose ``torch.topk`` spreads a row over many blocks, or ``"radix"``
    :func:`topk_select_radix`. ``num_warps``: the program's warps (None: 4, 8 or 16 by tile size; benchmarks sweep
    it).
    """
    if search not in SEARCHES:
        raise ValueError(f"search is one of {SEARCHES}, got {search!r}")
    long_search = long_search or LONG_SEARCH
    if long_search not in LONG_SEARCHES:
        raise ValueError(f"long_search is one of {LONG_SEARCHES}, got {long_search!r}")
    batch, heads, n = scores.shape
    if n > max_tile:
        return topk_select_radix(scores, counts, k) if long_search == "radix" else _topk_select_long(scores, counts, k)
    if RADIX_FROM is not None and n >= RADIX_FROM:
        return topk_select_radix(scores, counts, k)
    if scores.stride(2) != 1:
        scores = scores.contiguous()
    out = torch.empty(batch, heads, k, dtype=torch.int64, device=scores.device)
    if batch * heads == 0 or k == 0:
        return out
    block, tail = _tiles(n, search)
    _topk_select_kernel[(batch * heads,)](
        scores, counts, out, scores.stride(0), scores.stride(1), counts.stride(0), counts.stride(1),
        out.stride(0), out.stride(1), n, k, HEADS=heads, BLOCK=block, TAIL=max(tail, 16), HAS_TAIL=tail > 0,
        SEARCH=SEARCHES.index(search), num_warps=num_warps or (16 if block >= 16384 else 8 if block >= 4096 else 4),
        **FP_FUSION,
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
