"""``sparsecompile::kivi_decode_attention``: decode attention over KIVI pages plus the full-precision residual.

A ``(sequence, kv_head)`` list of ``lengths`` row-local slots is split in two: slots ``[0, quantized)`` live in
KIVI pages (``kivi_quant.py``: codes, per-group scales and zeros; ``index`` names the list's pages, ``P`` slots
each), slots ``[quantized, lengths)`` in the residual ring ``ring_k / ring_v [rows, kv_heads, RING, D]`` at
``slot % RING`` of ring row ``ring_rows[b]``. Logical positions of every slot are in ``pos_pool`` (page layout),
and visibility is :mod:`.paged_attention`'s (inside ``lengths``, position >= 0, not in the future, inside a
sliding window ``w > 0``).

Triton kernel (CUDA): flash-decoding over the list, split across programs and merged by
:func:`.paged_attention._combine_kernel`; every GQA query head of a KV head shares one program. A quantized tile is
one key group: the scores are ``(q * scale) . codes + q . zero`` (the key scales folded into the query, the codes
converted to floats without dequantizing), the values are dequantized in registers; accumulation in fp32.
"""

from __future__ import annotations

import torch

from .kivi_quant import dequantize_keys, dequantize_values, storage_bits, triton_supported, unpack_codes
from .library import define_op
from .pool import launch_inputs, visibility
from .tiles import natural_lse, query_rows, softmax_step, visible

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


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
    v = dequantize_values(unpack_codes(vcode[pages, head], bits), vscale[pages, head], vzero[pages, head])
    v = v.flatten(2, 3)[:, :, :span]
    pos = pos_pool[pages, head].flatten(2, 3)[:, :, :span].long()
    j = torch.arange(span, device=index.device)
    ring_idx = (j % ring_k.shape[2])[None, None, :].expand(batch, heads, -1)
    rows = ring_rows.long()[:, None, None].expand_as(ring_idx)
    rk = ring_k[rows, head.expand_as(ring_idx), ring_idx].float()
    rv = ring_v[rows, head.expand_as(ring_idx), ring_idx].float()
    in_ring = (j[None, :] >= quantized.long()[:, None])[:, None, :, None]
    valid = j[None, None, :] < lengths.long()[..., None]
    return (torch.where(in_ring, rk, k), torch.where(in_ring, rv, v), torch.where(valid, pos, -1), valid)


def kivi_decode_attention_reference(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v,
                                    ring_rows, index, lengths, quantized, q_positions, scale: float,
                                    sliding_window: int) -> torch.Tensor:
    """Torch reference: rebuild the floats of every list, then fp32 softmax attention.

    Args:
        query: ``[batch, q_heads, queries, D]``.
        kcode ... vzero: KIVI page tensors; pos_pool ``[pages, kv_heads, P]``.
        ring_k, ring_v: ``[rows, kv_heads, RING, D]``; ring_rows ``[batch]`` int64.
        index: ``[batch, kv_heads, pages]`` page ids; lengths ``[batch, kv_heads]``; quantized ``[batch]`` (a multiple
            of the group size; the quantized prefix of every head of the row).
        q_positions: ``[batch, queries]`` (-1: padding query).
    Returns:
        ``[batch, queries, q_heads, D]`` in ``query.dtype``.
    """
    batch, q_heads, queries, dim = query.shape
    heads = index.shape[1]
    group = q_heads // heads
    span = int(lengths.max()) if lengths.numel() else 0
    out = torch.zeros(batch, queries, q_heads, dim, dtype=query.dtype, device=query.device)
    if span == 0:
        return out
    k, v, kpos, valid = kivi_view_kv(kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows,
                                     index, lengths, quantized, span)
    q = query.float().reshape(batch, heads, group * queries, dim)
    mask = visibility(kpos, valid, q_positions.repeat(1, group), sliding_window)  # [B, H, g*T, span]
    logits = torch.einsum("bhqd,bhnd->bhqn", q, k) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)  # a query that sees nothing returns zeros
    o = torch.einsum("bhqn,bhnd->bhqd", probs, v)  # [B, H, g*T, D], row = g * T + t
    return o.reshape(batch, q_heads, queries, dim).transpose(1, 2).to(query.dtype).contiguous()


if triton is not None:
    from .paged_attention import _combine_kernel, _num_splits

    @triton.jit
    def _unpack(words, ROWS: tl.constexpr, W: tl.constexpr, PER_WORD: tl.constexpr, BITS: tl.constexpr):
        """``[ROWS, W]`` int32 words -> ``[ROWS, W * PER_WORD]`` fp32 codes (channel order)."""
        shifts = tl.arange(0, PER_WORD) * BITS
        codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        # exact int -> float without a conversion instruction: the code in the mantissa of 2^23
        f = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return tl.reshape(f, (ROWS, W * PER_WORD))

    @triton.jit
    def _repeat(x, ROWS: tl.constexpr, COLS: tl.constexpr, TIMES: tl.constexpr):
        """``[ROWS, COLS]`` -> ``[ROWS, COLS * TIMES]``, each column repeated ``TIMES`` times in place (per-group
        metadata spread over its channels or slots in registers: loading it per channel costs one load per element,
        and the load units, not the bytes, then bound the kernel)."""
        return tl.reshape(tl.broadcast_to(x[:, :, None], (ROWS, COLS, TIMES)), (ROWS, COLS * TIMES))

    @triton.jit
    def _repeat_rows(x, ROWS: tl.constexpr, COLS: tl.constexpr, TIMES: tl.constexpr):
        """``[ROWS, COLS]`` -> ``[ROWS * TIMES, COLS]``, each row repeated ``TIMES`` times in place."""
        return tl.reshape(tl.broadcast_to(x[:, None, :], (ROWS, TIMES, COLS)), (ROWS * TIMES, COLS))

    @triton.jit
    def _kivi_decode_kernel(Q, KC, VC, KS, KZ, VS, VZ, POS, RK, RV, RROWS, INDEX, LENGTHS, QUANT, QPOS,
                            OUT, MID_O, MID_LSE,
                            stride_qb, stride_qh, stride_qt, stride_ib, stride_ih, stride_lb, stride_lh, stride_pb,
                            stride_rr, stride_rh, stride_rs, stride_ob, stride_ot, stride_oh,
                            scale, window, num_queries,
                            KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr, G: tl.constexpr,
                            D: tl.constexpr, BITS: tl.constexpr, RING: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_F: tl.constexpr, NG: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr):
        """One program: every query head of one (sequence, kv_head) over one split of its slots. A quantized tile is
        ``NG`` key groups (of one page or several): with one group the key scales fold into the query, with more the
        keys are dequantized in registers. Larger tiles issue more independent loads per iteration: the page-id ->
        codes -> scores -> values chain of one iteration is latency, and a 32-slot tile of 2-bit codes carries too
        few bytes to hide it."""
        pid_bh = tl.program_id(0)
        split = tl.program_id(1)
        b = pid_bh // KV_HEADS
        h = pid_bh % KV_HEADS
        PER_WORD: tl.constexpr = 32 // BITS
        W: tl.constexpr = D // PER_WORD
        rows = tl.arange(0, BLOCK_M)  # row = query * GROUP + head-in-group
        q, qpos, t, qh, row_ok, d, _ = query_rows(Q, QPOS, b, h, rows, stride_qb, stride_qh, stride_qt, stride_pb,
                                                  num_queries, GROUP, D, D)
        q = q.to(tl.float32)
        qpos = qpos.to(tl.int64)
        qk_scale = tl.cast(scale, tl.float32)  # inductor passes Python floats as fp64
        length = tl.load(LENGTHS + b * stride_lb + h * stride_lh)
        quant = tl.load(QUANT + b).to(tl.int32)
        TILE: tl.constexpr = NG * G
        per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), TILE) * TILE  # tile-aligned: a tile never crosses a page
        lo = split * per_split
        hi = tl.minimum(length, lo + per_split)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        index = INDEX + b * stride_ib + h * stride_ih
        tok = tl.arange(0, TILE)
        gi = tl.arange(0, NG)
        w = tl.arange(0, W)
        VG: tl.constexpr = D // G  # value groups per slot
        vg = tl.arange(0, VG)
        qhi = tl.minimum(hi, quant)
        for start in range(lo, qhi, TILE):  # quantized slots
            tm = start + tok < qhi
            if NG == 1:  # one group never crosses a page (G divides P): one page id per tile
                page = tl.load(index + start // PAGE).to(tl.int64)
                slot = (page * KV_HEADS + h) * PAGE + start % PAGE + tok  # rows of the [pages, heads, P] layout
                grp = (page * KV_HEADS + h) * (PAGE // G) + (start % PAGE) // G
            else:  # a tile of several groups may span pages: a page id per slot (repeated addresses, one fetch each)
                j = start + tok
                pages = tl.load(index + j // PAGE, mask=tm, other=0).to(tl.int64)
                slot = (pages * KV_HEADS + h) * PAGE + j % PAGE
                jg = start + gi * G  # the first slot of each group of the tile
                gm = jg < qhi
                gpages = tl.load(index + jg // PAGE, mask=gm, other=0).to(tl.int64)
                kg = (gpages * KV_HEADS + h) * (PAGE // G) + (jg % PAGE) // G  # [NG] key-group rows
            kcodes = _unpack(tl.load(KC + slot[:, None] * W + w[None, :], mask=tm[:, None], other=0), TILE, W,
                             PER_WORD, BITS)
            if NG == 1:  # one group: (q * scale) . codes + q . zero
                ks = tl.load(KS + grp * D + d).to(tl.float32)
                kz = tl.load(KZ + grp * D + d).to(tl.float32)
                bias = tl.sum(q * kz[None, :], 1)
                qs = q * ks[None, :]
                if IEEE:
                    s = tl.dot(qs, tl.trans(kcodes), input_precision="ieee")
                else:
                    s = tl.dot(qs.to(tl.bfloat16), tl.trans(kcodes.to(tl.bfloat16)))
                s = s + bias[:, None]
            else:  # several groups: dequantize the keys (each group's scales and zeros read once, spread over G slots)
                kmeta = kg[:, None] * D + d[None, :]
                ks = _repeat_rows(tl.load(KS + kmeta, mask=gm[:, None], other=0.0).to(tl.float32), NG, D, G)
                kz = _repeat_rows(tl.load(KZ + kmeta, mask=gm[:, None], other=0.0).to(tl.float32), NG, D, G)
                k = kcodes * ks + kz
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
            s = s * qk_scale
            kpos = tl.load(POS + slot, mask=tm, other=-1).to(tl.int64)
            s = tl.where(visible(kpos, qpos, window), s, float("-inf"))
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
            vcodes = _unpack(tl.load(VC + slot[:, None] * W + w[None, :], mask=tm[:, None], other=0), TILE, W,
                             PER_WORD, BITS)
            # a slot's value scales and zeros: D // G of each, loaded once and spread over their channels
            vmeta = slot[:, None] * VG + vg[None, :]
            vs = _repeat(tl.load(VS + vmeta, mask=tm[:, None], other=0.0).to(tl.float32), TILE, VG, G)
            vz = _repeat(tl.load(VZ + vmeta, mask=tm[:, None], other=0.0).to(tl.float32), TILE, VG, G)
            v = vcodes * vs + vz
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
        ring_row = tl.load(RROWS + b).to(tl.int64)
        ring = ring_row * stride_rr + h * stride_rh
        for start in range(tl.maximum(lo, quant), hi, BLOCK_F):  # the full-precision residual
            j = start + tl.arange(0, BLOCK_F)
            jm = j < hi
            ridx = j % RING
            k = tl.load(RK + ring + ridx[:, None] * stride_rs + d[None, :], mask=jm[:, None], other=0.0)
            v = tl.load(RV + ring + ridx[:, None] * stride_rs + d[None, :], mask=jm[:, None], other=0.0)
            page = tl.load(index + j // PAGE, mask=jm, other=0).to(tl.int64)
            kpos = tl.load(POS + (page * KV_HEADS + h) * PAGE + j % PAGE, mask=jm, other=-1).to(tl.int64)
            if IEEE:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q.to(k.dtype), tl.trans(k))
            s = s * qk_scale
            s = tl.where(jm[None, :] & visible(kpos, qpos, window), s, float("-inf"))
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if NUM_SPLITS == 1:
            tl.store(OUT + b * stride_ob + t[:, None] * stride_ot + qh[:, None] * stride_oh + d[None, :],
                     out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        else:
            mid = ((b * (KV_HEADS * GROUP) + qh) * num_queries + t) * NUM_SPLITS + split
            tl.store(MID_LSE + mid, natural_lse(m_i, l_i), mask=row_ok)
            tl.store(MID_O + mid[:, None] * D + d[None, :], out, mask=row_ok[:, None])


#: Launch configuration: the best of ``benchmarks/kernels.py --only kivi --sweep`` on the H200 at every swept point
#: (2-bit, 32K x 1, 32K x 16, 128K x 1: 409-537 GB/s against 180-233 GB/s for one key group per tile, 3 stages and
#: 264 programs; ``benchmarks/results/kivi_sweep_h200.log``): four key groups per tile amortise the scale / zero loads
#: and the per-tile softmax update, and four times as many programs fill the GPU at batch 1.
KIVI_DECODE_CONFIG = {"block_f": 32, "num_warps": 4, "num_stages": 2, "target_programs": 1056, "groups_per_tile": 4}


def kivi_decode_attention_triton(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v,
                                 ring_rows, index, lengths, quantized, q_positions, scale, sliding_window, *,
                                 num_splits: int | None = None, config: dict | None = None) -> torch.Tensor:
    """Triton launch with the semantics of :func:`kivi_decode_attention_reference`."""
    batch, q_heads, queries, dim = query.shape
    heads, page_size = kcode.shape[1], kcode.shape[2]
    group_size = page_size // kscale.shape[2]
    group = q_heads // heads
    if not triton_supported(group_size, dim) or queries * group > 64:
        return kivi_decode_attention_reference(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k,
                                               ring_v, ring_rows, index, lengths, quantized, q_positions, scale,
                                               sliding_window)
    query, index, q_positions = launch_inputs(query, index, q_positions)
    cfg = {**KIVI_DECODE_CONFIG, **(config or {})}
    block_m = max(16, triton.next_power_of_2(queries * group))
    out = torch.empty(batch, queries, q_heads, dim, dtype=query.dtype, device=query.device)
    span = index.shape[2] * page_size
    groups_per_tile = max(1, cfg["groups_per_tile"])
    min_split = max(4, groups_per_tile) * group_size
    splits = num_splits or _num_splits(batch * heads, span, min_split, cfg["target_programs"])
    if splits > 1:
        mid_o = torch.empty(batch, q_heads, queries, splits, dim, dtype=torch.float32, device=query.device)
        mid_lse = torch.empty(batch, q_heads, queries, splits, dtype=torch.float32, device=query.device)
    else:
        mid_o = mid_lse = out
    _kivi_decode_kernel[(batch * heads, splits)](
        query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows.contiguous(), index,
        lengths, quantized.contiguous(), q_positions, out, mid_o, mid_lse,
        query.stride(0), query.stride(1), query.stride(2), index.stride(0), index.stride(1),
        lengths.stride(0), lengths.stride(1), q_positions.stride(0),
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2), out.stride(0), out.stride(1), out.stride(2),
        float(scale), int(sliding_window), queries,
        KV_HEADS=heads, GROUP=group, PAGE=page_size, G=group_size, D=dim, BITS=storage_bits(kcode, dim),
        RING=ring_k.shape[2], BLOCK_M=block_m, BLOCK_F=cfg["block_f"], NG=groups_per_tile, NUM_SPLITS=splits,
        IEEE=query.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _combine_kernel[(batch * q_heads * queries,)](
            mid_o, mid_lse, out, out, out.stride(0), out.stride(1), out.stride(2), queries,
            Q_HEADS=q_heads, HEAD_DIM=dim, BLOCK_D=dim, NUM_SPLITS=splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)), WRITE_LSE=False,
        )
    return out


def _fake(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows, index, lengths,
          quantized, q_positions, scale, sliding_window):
    batch, q_heads, queries, dim = query.shape
    return query.new_empty(batch, queries, q_heads, dim)


kivi_decode_attention = define_op(
    "kivi_decode_attention(Tensor query, Tensor kcode, Tensor vcode, Tensor kscale, Tensor kzero, Tensor vscale, "
    "Tensor vzero, Tensor pos_pool, Tensor ring_k, Tensor ring_v, Tensor ring_rows, Tensor index, Tensor lengths, "
    "Tensor quantized, Tensor q_positions, float scale, int sliding_window) -> Tensor",
    cpu=kivi_decode_attention_reference,
    cuda=kivi_decode_attention_triton if triton is not None else None,
    fake=_fake,
)
