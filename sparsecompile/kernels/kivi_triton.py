"""The Triton KIVI decode kernel (``sparsecompile::kivi_decode_attention``'s, launched by ``kivi_attention.py``).

Flash-decoding over a ``(sequence, kv_head)`` list of KIVI pages plus the residual ring, split across programs and
merged by :func:`.paged_attention._combine_kernel`; every GQA query head of a KV head shares one program. A
quantized tile is one key group, computed transposed (the codes are the MMAs' first operand): keys are dequantized
in the MMA operand registers, four codes a register (:func:`_code_asm`); values enter the MMA as exact codes, their
per-slot scales multiplied into the probabilities and their zeros' share added per value group (the kernel's
docstring); accumulation in fp32. It serves every shape :func:`fast_path_supported` takes; where the Gluon kernel
(``kivi_gluon.py``) takes the quantized slots, this one reads only the residual ring (``RESIDUAL_ONLY``).
"""

from __future__ import annotations

import functools

import torch

from .kivi_quant import triton_supported
from .tiles import natural_lse, visible

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

def _code_asm(bits: int, shift: int, dtype: torch.dtype, scaled: bool = True) -> str:
    """PTX of :func:`_dequantize` for four codes: the ``bits``-bit code at bit ``shift`` of each byte of ``$2``,
    dequantized as ``code * scale + zero`` (``$3, $4`` scales and ``$5, $6`` zeros, two 16-bit floats each) into
    ``$0, $1``. Exact int -> float without a conversion instruction: a byte permute puts each code under the exponent
    of ``2^7`` (bf16 ``0x43XX`` = 128 + code) or ``2^10`` (fp16 ``0x64XX`` = 1024 + code), an exact subtraction
    leaves the code, and one fused multiply-add rounds ``code * scale + zero`` once. ``scaled=False``: the PTX of
    :func:`_codes`, the exact codes as floats in ``$0, $1`` (no scale or zero operands)."""
    mask = "0x03030303" if bits == 2 else "0x0F0F0F0F"
    if dtype == torch.bfloat16:
        magic, one, minus, ty = "0x43434343", "0x3F803F80", "0xC300C300", "bf16x2"
    else:
        magic, one, minus, ty = "0x64646464", "0x3C003C00", "0xE400E400", "f16x2"
    codes = f"shr.b32 t, $2, {shift}; and.b32 t, t, {mask};" if shift else f"and.b32 t, $2, {mask};"
    head = ("{ .reg .b32 t, c, one, m, u0, u1; " + codes + f" mov.b32 c, {magic};"
            " prmt.b32 u0, t, c, 0x5140; prmt.b32 u1, t, c, 0x7362;"
            f" mov.b32 one, {one}; mov.b32 m, {minus};")
    if not scaled:
        return head + f" fma.rn.{ty} $0, u0, one, m; fma.rn.{ty} $1, u1, one, m; }}"
    return head + (f" fma.rn.{ty} u0, u0, one, m; fma.rn.{ty} u1, u1, one, m;"
                   f" fma.rn.{ty} $0, u0, $3, $5; fma.rn.{ty} $1, u1, $4, $6; }}")


def chunk_layout(dim: int, bits: int, group: int) -> tuple[int, int]:
    """``(C, B)``: the decode kernel's channel chunk and the bytes per slot (``kivi_quant``'s byte layout). Chunk
    ``i`` holds channels ``[i * C, (i + 1) * C)``, inside one value group (``C <= group``), stored at bit
    ``(i * C // B) * bits`` of bytes ``[(i * C) % B, (i * C) % B + C)``."""
    nbytes = dim * bits // 8
    return min(32, nbytes, group), nbytes


def fast_path_supported(group: int, dim: int, bits: int) -> bool:
    """Shapes of the Triton decode kernel: 2 or 4 chunks of 16 or 32 channels over one or two byte blocks (the
    Llama / Qwen / Mistral head dim 128 and SmolLM2's 64, 2 or 4 bits, groups of 16 and more); others run the
    torch reference."""
    if bits not in (2, 4) or not triton_supported(group, dim):
        return False
    chunk, nbytes = chunk_layout(dim, bits, group)
    return chunk >= 16 and nbytes in (chunk, 2 * chunk) and dim // chunk in (2, 4) and dim // group <= 32


if triton is not None:
    @triton.jit
    def _dequantize(x, scale, zero, SHIFT: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, DT: tl.constexpr):
        """uint8 bytes ``x`` -> ``code * scale + zero`` in ``DT`` (``scale`` / ``zero`` broadcast to ``x``'s shape):
        PTX over four codes a register (``ASM``, a :func:`_code_asm` string) or integer ops and fp32 math (the
        interpreter, fp32 queries)."""
        if ASM != "" and DT == tl.bfloat16:
            return tl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r,r", [x, scale, zero],
                                             dtype=tl.bfloat16, is_pure=True, pack=4)
        elif ASM != "":
            return tl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r,r", [x, scale, zero],
                                             dtype=tl.float16, is_pure=True, pack=4)
        else:
            codes = ((x.to(tl.int32) >> SHIFT) & ((1 << BITS) - 1)).to(tl.float32)
            return (codes * scale.to(tl.float32) + zero.to(tl.float32)).to(DT)

    @triton.jit
    def _key_chunk(kb, KS, KZ, SHIFT: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, DT: tl.constexpr,
                   G: tl.constexpr, C: tl.constexpr):
        """Keys ``[G, C]`` of one chunk from bytes ``kb [G, C]``: the group's per-channel scales and zeros at
        ``KS / KZ + [0, C)``."""
        c = tl.arange(0, C)
        return _dequantize(kb, tl.broadcast_to(tl.load(KS + c).to(DT)[None, :], (G, C)),
                           tl.broadcast_to(tl.load(KZ + c).to(DT)[None, :], (G, C)), SHIFT, BITS, ASM, DT)

    @triton.jit
    def _codes(x, SHIFT: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, DT: tl.constexpr):
        """uint8 bytes ``x`` -> the ``BITS``-bit codes at bit ``SHIFT`` as exact floats in ``DT`` (``ASM``: a
        :func:`_code_asm` string with ``scaled=False``, or empty for integer ops)."""
        if ASM != "" and DT == tl.bfloat16:
            return tl.inline_asm_elementwise(ASM, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=4)
        elif ASM != "":
            return tl.inline_asm_elementwise(ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return ((x.to(tl.int32) >> SHIFT) & ((1 << BITS) - 1)).to(tl.float32).to(DT)

    @triton.jit
    def _scaled(p, VS, DT: tl.constexpr):
        """``p [slots, rows]`` times each slot's value scale at the pointers ``VS [slots]``, as an MMA operand."""
        return (p * tl.load(VS).to(tl.float32)[:, None]).to(DT)

    @triton.jit
    def _row(z, i: tl.constexpr):
        """Row ``i`` of ``z [R, rows]`` as ``[1, rows]``."""
        return tl.sum(tl.where(tl.arange(0, z.shape[0])[:, None] == i, z, 0.0), 0)[None, :]

    @triton.jit
    def _mma(a, b, acc, DT: tl.constexpr):
        if DT == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _online(s, m_i, l_t):
        """Online softmax over a transposed tile ``s [slots, rows]`` of base-2 logits (-inf = masked). The row sums
        stay in the tile's shape, ``l_t [slots, rows]``, summed over slots once after the loop: one cross-warp
        reduction a tile (the maximum) instead of two."""
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay NaN-free
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        return m_new, alpha, p, l_t * alpha[None, :] + p

    @triton.jit
    def _kivi_decode_kernel(Q, KC, VC, KS, KZ, VS, VZ, POS, RK, RV, RROWS, INDEX, LENGTHS, QUANT, QPOS,
                            OUT, MID_O, MID_LSE, LOGITS, LSE,
                            stride_qb, stride_qh, stride_qt, stride_ib, stride_ih, stride_lb, stride_lh, stride_pb,
                            stride_rr, stride_rh, stride_rs, stride_ob, stride_ot, stride_oh,
                            scale, window, num_queries, logits_span,
                            KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr, G: tl.constexpr,
                            D: tl.constexpr, BITS: tl.constexpr, RING: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_F: tl.constexpr, C: tl.constexpr, NUM_SPLITS: tl.constexpr, DT: tl.constexpr,
                            ASM0: tl.constexpr, ASM1: tl.constexpr, ASM2: tl.constexpr, ASM3: tl.constexpr,
                            VSM0: tl.constexpr, VSM1: tl.constexpr, VSM2: tl.constexpr, VSM3: tl.constexpr,
                            WRITE_LOGITS: tl.constexpr, RSPLITS: tl.constexpr = 0, FIRST_SPLIT: tl.constexpr = 0):
        """One program: every query row of one (sequence, kv_head) over one split of its slots, computed transposed
        so the stored codes are the MMAs' first operand: ``s^T [slots, rows] = sum_i K_i [slots, C] . q_i^T`` and
        ``o_i^T [C, rows] += V_i^T [C, slots] . p^T`` per channel chunk ``i``. The compiler then moves the packed
        bytes, not the dequantized floats, into the MMA operand layout; each register of four codes is dequantized
        there (keys by ``ASM_i``: ``code * scale + zero`` with the group's per-channel scales). A quantized tile is
        one key group. Values' scales and zeros are per slot, which in the operand layout would be a scalar load per
        element pair; they are applied on the probabilities' side instead: ``V_i = codes_i * scale_g + zero_g``
        (``g`` the chunk's value group) gives ``o_i^T += codes_i . (p * scale_g)^T + sum_s zero_g[s] p[s]``, the
        codes exact floats (``VSM_i``) and the zeros' share of every group one small MMA a tile (``zacc``), added to
        the group's channels after the loops. ``WRITE_LOGITS`` (one query per sequence): every visible slot's
        scaled logit (natural units, -inf where masked) goes to ``LOGITS [batch, q_heads, logits_span]`` and, with
        one split, each row's log-sum-exp to ``LSE`` (with several, the combine kernel writes it). ``RSPLITS > 0``: the
        last ``RSPLITS`` splits are the residual ring's, ``BLOCK_F`` slots each from ``quantized`` (a program a
        block instead of one walking the ring: the 2-bit op 138.1 -> 134.3 us at 128K x 4, 26.1 -> 23.3 at 32K x 1 on
        the H200, ``results/kivi_ring_blocks_{before,after}_h200.jsonl``), the others share the
        quantized slots; the grid's programs are splits ``FIRST_SPLIT ..`` (the Gluon kernel, ``kivi_gluon.py``,
        computes the quantized ones: ``FIRST_SPLIT = NUM_SPLITS - RSPLITS``)."""
        pid_bh = tl.program_id(0)
        split = tl.program_id(1) + FIRST_SPLIT
        b = pid_bh // KV_HEADS
        h = pid_bh % KV_HEADS
        B: tl.constexpr = D * BITS // 8
        NCH: tl.constexpr = D // C
        rows = tl.arange(0, BLOCK_M)  # row = query * GROUP + head-in-group
        t = rows // GROUP
        qh = h * GROUP + rows % GROUP
        row_ok = t < num_queries
        c = tl.arange(0, C)
        qpos = tl.load(QPOS + b * stride_pb + t, mask=row_ok, other=-1).to(tl.int32)  # positions < 2^31
        # q^T chunks [C, rows], pre-scaled to base-2 logits
        qp = Q + b * stride_qb + qh[None, :] * stride_qh + t[None, :] * stride_qt + c[:, None]
        qk = tl.cast(scale, tl.float32) * 1.4426950408889634  # inductor passes Python floats as fp64
        q0 = (tl.load(qp, mask=row_ok[None, :], other=0.0).to(tl.float32) * qk).to(DT)
        q1 = (tl.load(qp + C, mask=row_ok[None, :], other=0.0).to(tl.float32) * qk).to(DT)
        q2 = q0
        q3 = q1
        if NCH == 4:
            q2 = (tl.load(qp + 2 * C, mask=row_ok[None, :], other=0.0).to(tl.float32) * qk).to(DT)
            q3 = (tl.load(qp + 3 * C, mask=row_ok[None, :], other=0.0).to(tl.float32) * qk).to(DT)
        length = tl.load(LENGTHS + b * stride_lb + h * stride_lh).to(tl.int32)  # as quant: one type for the bounds
        quant = tl.load(QUANT + b).to(tl.int32)
        if RSPLITS == 0:  # every split a share of the whole list
            per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), G) * G  # group-aligned: a tile never crosses a page
            lo = split * per_split
            hi = tl.minimum(length, lo + per_split)
        else:
            QSPLITS: tl.constexpr = NUM_SPLITS - RSPLITS
            per_split = tl.cdiv(tl.cdiv(quant, QSPLITS), G) * G
            lo = split * per_split
            hi = tl.minimum(quant, lo + per_split)
            if split >= QSPLITS:  # a residual block
                lo = quant + (split - QSPLITS) * BLOCK_F
                hi = tl.minimum(length, lo + BLOCK_F)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_q = tl.zeros([G, BLOCK_M], tl.float32)  # row sums, elementwise (_online): quantized tiles
        l_f = tl.zeros([BLOCK_F, BLOCK_M], tl.float32)  # and residual tiles
        a0 = tl.zeros([C, BLOCK_M], tl.float32)
        a1 = tl.zeros([C, BLOCK_M], tl.float32)
        a2 = tl.zeros([C, BLOCK_M], tl.float32)
        a3 = tl.zeros([C, BLOCK_M], tl.float32)
        index = INDEX + b * stride_ib + h * stride_ih
        tok = tl.arange(0, G)
        VG: tl.constexpr = D // G  # value groups per slot
        zg = tl.arange(0, 32)  # the zeros' MMA rows, VG of them real: 32 rows split over the warps like the others
        zacc = tl.zeros([32, BLOCK_M], tl.float32)  # sum_s zero_g[s] p[s] per value group g
        qhi = tl.minimum(hi, quant)
        for start in range(lo, qhi, G):  # quantized slots: whole groups (quant and the splits are group-aligned)
            page = tl.load(index + start // PAGE).to(tl.int64)
            slot = (page * KV_HEADS + h) * PAGE + start % PAGE + tok  # rows of the [pages, heads, P] layout
            grp = ((page * KV_HEADS + h) * (PAGE // G) + (start % PAGE) // G) * D  # the key group's scales / zeros
            ks, kz = KS + grp, KZ + grp
            kb0 = tl.load(KC + slot[:, None] * B + c[None, :])  # [G, C] bytes (two blocks when B = 2C)
            kb1 = kb0
            if B > C:
                kb1 = tl.load(KC + slot[:, None] * B + C + c[None, :])
            s = _mma(_key_chunk(kb0, ks, kz, 0, BITS, ASM0, DT, G, C), q0, tl.zeros([G, BLOCK_M], tl.float32), DT)
            s = _mma(_key_chunk(kb1, ks + C, kz + C, (C // B) * BITS, BITS, ASM1, DT, G, C), q1, s, DT)
            if NCH == 4:
                s = _mma(_key_chunk(kb0, ks + 2 * C, kz + 2 * C, (2 * C // B) * BITS, BITS, ASM2, DT, G, C), q2, s, DT)
                s = _mma(_key_chunk(kb1, ks + 3 * C, kz + 3 * C, (3 * C // B) * BITS, BITS, ASM3, DT, G, C), q3, s, DT)
            kpos = tl.load(POS + slot)
            s = tl.where(tl.trans(visible(kpos, qpos, window)), s, float("-inf"))
            if WRITE_LOGITS:  # base-2 logits back to natural units
                tl.store(LOGITS + (b * (KV_HEADS * GROUP) + qh)[None, :] * logits_span + (start + tok)[:, None],
                         s * 0.6931471805599453, mask=row_ok[None, :])
            m_i, alpha, p, l_q = _online(s, m_i, l_q)
            vgrp = VC + (grp // D) * (B * G)  # the group's byte-major value codes [B, G]
            vb0 = tl.load(vgrp + c[:, None] * G + tok[None, :])  # [C, G] bytes
            vb1 = vb0
            if B > C:
                vb1 = tl.load(vgrp + (C + c[:, None]) * G + tok[None, :])
            meta = (page * KV_HEADS + h) * (VG * PAGE) + start % PAGE  # VS / VZ [pages, heads, VG, P]
            vs = VS + meta + tok  # a slot's scale of chunk i: [meta + (i * C // G) * PAGE + slot]
            a0 = _mma(_codes(vb0, 0, BITS, VSM0, DT), _scaled(p, vs, DT), a0 * alpha[None, :], DT)
            a1 = _mma(_codes(vb1, (C // B) * BITS, BITS, VSM1, DT), _scaled(p, vs + (C // G) * PAGE, DT),
                      a1 * alpha[None, :], DT)
            if NCH == 4:
                a2 = _mma(_codes(vb0, (2 * C // B) * BITS, BITS, VSM2, DT), _scaled(p, vs + (2 * C // G) * PAGE, DT),
                          a2 * alpha[None, :], DT)
                a3 = _mma(_codes(vb1, (3 * C // B) * BITS, BITS, VSM3, DT), _scaled(p, vs + (3 * C // G) * PAGE, DT),
                          a3 * alpha[None, :], DT)
            zt = tl.load(VZ + meta + zg[:, None] * PAGE + tok[None, :], mask=zg[:, None] < VG, other=0.0)  # [32, G]
            zacc = _mma(zt.to(DT), p.to(DT), zacc * alpha[None, :], DT)
        ring = RK + tl.load(RROWS + b).to(tl.int64) * stride_rr + h * stride_rh
        vring = RV + tl.load(RROWS + b).to(tl.int64) * stride_rr + h * stride_rh
        for start in range(tl.maximum(lo, quant), hi, BLOCK_F):  # the full-precision residual
            j = start + tl.arange(0, BLOCK_F)
            jm = j < hi
            kr = ring + (j % RING)[:, None] * stride_rs + c[None, :]  # [BLOCK_F, C]
            vr = vring + (j % RING)[None, :] * stride_rs + c[:, None]  # [C, BLOCK_F]
            s = _mma(tl.load(kr, mask=jm[:, None], other=0.0).to(DT), q0, tl.zeros([BLOCK_F, BLOCK_M], tl.float32),
                     DT)
            s = _mma(tl.load(kr + C, mask=jm[:, None], other=0.0).to(DT), q1, s, DT)
            if NCH == 4:
                s = _mma(tl.load(kr + 2 * C, mask=jm[:, None], other=0.0).to(DT), q2, s, DT)
                s = _mma(tl.load(kr + 3 * C, mask=jm[:, None], other=0.0).to(DT), q3, s, DT)
            page = tl.load(index + j // PAGE, mask=jm, other=0).to(tl.int64)
            kpos = tl.load(POS + (page * KV_HEADS + h) * PAGE + j % PAGE, mask=jm, other=-1)
            s = tl.where(tl.trans(visible(kpos, qpos, window)) & jm[:, None], s, float("-inf"))
            if WRITE_LOGITS:
                tl.store(LOGITS + (b * (KV_HEADS * GROUP) + qh)[None, :] * logits_span + j[:, None],
                         s * 0.6931471805599453, mask=jm[:, None] & row_ok[None, :])
            m_i, alpha, p, l_f = _online(s, m_i, l_f)
            l_q *= alpha[None, :]
            zacc *= alpha[None, :]
            p = p.to(DT)
            a0 = _mma(tl.load(vr, mask=jm[None, :], other=0.0).to(DT), p, a0 * alpha[None, :], DT)
            a1 = _mma(tl.load(vr + C, mask=jm[None, :], other=0.0).to(DT), p, a1 * alpha[None, :], DT)
            if NCH == 4:
                a2 = _mma(tl.load(vr + 2 * C, mask=jm[None, :], other=0.0).to(DT), p, a2 * alpha[None, :], DT)
                a3 = _mma(tl.load(vr + 3 * C, mask=jm[None, :], other=0.0).to(DT), p, a3 * alpha[None, :], DT)
        a0 += _row(zacc, 0)
        a1 += _row(zacc, C // G)
        if NCH == 4:
            a2 += _row(zacc, 2 * C // G)
            a3 += _row(zacc, 3 * C // G)
        l_i = tl.sum(l_q, 0) + tl.sum(l_f, 0)
        inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        ok = row_ok[None, :]
        if NUM_SPLITS == 1:
            o = OUT + b * stride_ob + t[None, :] * stride_ot + qh[None, :] * stride_oh + c[:, None]
            ty = OUT.dtype.element_ty
            if WRITE_LOGITS:
                tl.store(LSE + (b * (KV_HEADS * GROUP) + qh) * num_queries + t,
                         natural_lse(m_i * 0.6931471805599453, l_i), mask=row_ok)
        else:
            mid = ((b * (KV_HEADS * GROUP) + qh) * num_queries + t) * NUM_SPLITS + split
            tl.store(MID_LSE + mid, natural_lse(m_i * 0.6931471805599453, l_i), mask=row_ok)  # m_i is base 2
            o = MID_O + mid[None, :] * D + c[:, None]
            ty = tl.float32
        tl.store(o, (a0 * inv[None, :]).to(ty), mask=ok)
        tl.store(o + C, (a1 * inv[None, :]).to(ty), mask=ok)
        if NCH == 4:
            tl.store(o + 2 * C, (a2 * inv[None, :]).to(ty), mask=ok)
            tl.store(o + 3 * C, (a3 * inv[None, :]).to(ty), mask=ok)


#: Launch configuration (``benchmarks/kernel_bench.py --only kivi --sweep`` on the H200, 2-bit, bf16 scales; the kernel
#: with values' scales on the probabilities' side, ``results/kivi_v3_sweep_all_h200.log``): 2 warps (the MMAs of a
#: 32-slot key group split over them, the dequantization not duplicated; 4 warps would dequantize each tile twice),
#: 2 stages, no register cap (the kernel fits 128 registers without spills; with the cap and without it, the same
#: program counts time within 1 % of each other). Splits per (sequence, KV head) list: as many as fill one wave of
#: ``programs_per_sm`` programs on every SM and no more (at 2 warps and 128 registers 8 fit an SM). In that sweep the
#: fastest program count at every point was the one closest to a single wave from below or at it (132 SMs x 8 =
#: 1,056): 31.8 us against 36.4 at 32K x 1 (132 splits), 94.2 against 100.3 at 128K x 1 (132), 329.8 against 333.1 at
#: 128K x 4 (33); at 32K x 16 (128 lists) 9 splits, 1,152 programs, a wave and a tail, took 476 us and 33 splits
#: (4,224 programs, four full waves) 345 us, which is why the count rounds down. With this rule, swept again
#: (``results/kivi_wave_sweep_h200.log``): within 1 % of the best of 16 configurations at every point.
KIVI_DECODE_CONFIG = {"block_f": 32, "num_warps": 2, "num_stages": 2, "programs_per_sm": 8}


@functools.cache
def _sm_count(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device; an H200's 132 off CUDA (the interpreter), so splits match it."""
    return 132 if device_index is None else torch.cuda.get_device_properties(device_index).multi_processor_count


def wave_splits(lists: int, span: int, min_slots: int, programs_per_sm: int, device: torch.device) -> int:
    """Splits per list so that ``lists x splits`` programs fill one wave (rounded down: a partial second wave costs
    more than the missing parallelism), each split at least ``min_slots`` slots long."""
    wave = _sm_count(device.index if device.type == "cuda" else None) * programs_per_sm
    return max(1, min(wave // lists, -(-span // min_slots)))


def _asm_strings(bits: int, dim: int, group: int, query_dtype: torch.dtype, on_gpu: bool) -> list[str]:
    """The four chunks' key :func:`_code_asm`, then their value codes' (``scaled=False``) (empty strings: integer
    ops and fp32 math)."""
    chunk, nbytes = chunk_layout(dim, bits, group)
    if not on_gpu or query_dtype not in (torch.bfloat16, torch.float16):
        return [""] * 8
    shifts = [(i * chunk // nbytes) * bits for i in range(4)]
    return ([_code_asm(bits, sh, query_dtype) for sh in shifts]
            + [_code_asm(bits, sh, query_dtype, scaled=False) for sh in shifts])
