"""The quantized part of KIVI decode attention in Gluon (Triton's explicit-layout dialect), CUDA sm_90, 2 / 4 bits.

Why not plain Triton (``kivi_triton.py``'s kernel, kept for every other case): there the packed codes reach the
MMA operand layout through shared-memory layout conversions and their barriers, and the kernel is latency-bound at
18-29 % of the H200's bandwidth (``benchmarks/results/kivi_kernel_variants_h200.md``). Here every operand is in a
layout the kernel names (one warp a program, no cross-warp reduction):

* **codes enter the MMA as subnormal floats**: a 16-bit float whose bit pattern is ``N < 256`` is exactly
  ``N * 2^-133`` (bf16; the subnormals join the first binade without a gap), so after two byte permutes a word,
  ``x & (3 << 2j) * 0x00010001`` is two exact floats ``code * 4^j * 2^-133`` (4 bits: ``15 << 4j``, ``16^j``) —
  one instruction a pair, no conversion arithmetic (:data:`_PLANES`; in fp16 the same patterns are ``N * 2^-24``,
  the lifts below then smaller, :data:`_UNITS`);
* the missing factors go to the other operand: the keys' per-channel scales, ``4^-j`` and a lift of ``2^100`` into
  the query once a group (``q' = q * scale * 2^(100 - 2j)``), the values' per-slot scales into the probabilities
  (lifted by ``2^80``, :data:`P_LIFT`); the codes' logits come out in units of ``2^-33``, joined to the keys'
  zeros' (one MMA of the broadcast zeros against ``q``) by one FMA; the output's ``2^(53 - 2j)`` once at the end
  (bf16; fp16's units in :data:`_UNITS`); the values' zeros' shares
  ``sum_s p_s zero_s`` of the four chunks and the softmax sum ``sum_s p_s`` by one more MMA a group (an A tile of
  the group's value zeros and a row of ones against the bf16 probabilities; per-thread partials before: 205
  registers and 707 instructions a group at 2 bits, now 156 and 492 (offline, Triton 3.9), the keys' logits in two MMA
  chains);
* a ring of ``STAGES`` shared-memory buffers filled by ``cp.async``: group ``g + STAGES - 1``'s codes, scales,
  zeros and positions are in flight while group ``g`` computes; the page index is read a group ahead.

It needs the pool's byte-major value groups and ``[D / G, P]`` value metadata (``kivi_quant.py``). The lists'
quantized slots ``[0, quantized)`` are split over programs; each split's normalized output and natural log-sum-exp
go to the split buffers :func:`.paged_attention._combine_kernel` merges, the residual ring's splits (the last
ones) written by the Triton kernel. H200, Llama-3.1-8B attention, the whole op (``benchmarks/results/
kivi_gluon_fp16_after_h200.jsonl``, bf16, this kernel; % of 4.44 TB/s): 2 bits 135.4 us at 128K x 4 (70 %; the
Triton kernel 449.1 in ``kernels_kivi_fp16_h200.jsonl``), 136.6 at 32K x 16 (70 %), 45.5 at 128K x 1 (52 %), 23.0 at
32K x 1 (26 %); 4 bits 206.0 / 207.9 / 72.8 / 33.7; fp16 (``kivi_fp16_rows_h200.jsonl``) 2 bits 136.5 us at 128K x 4
(the Triton kernel: 480.6).
"""

from __future__ import annotations

import functools

import torch

from .kivi_quant import storage_bits
from .tiles import FP_FUSION

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except ImportError:  # pragma: no cover - no Triton, or one without Gluon
    gluon = None

#: Launch configuration per bit width (``results/kivi_gluon_stages_sweep_h200.jsonl``, 2026-12-04 fourteenth session:
#: 2 bits, 3 stages x 12 programs an SM the fastest at all four points, 1-4 % ahead of 4 stages; 4 bits, 4 stages x
#: 16 the fastest at 32K x 16, 128K x 1 and 128K x 4 (3 x 12 at 32K x 1); register caps of 144 or 128, which fit
#: 13-16 programs an SM instead of 12, 10-25 % slower: each warp's own overlap counts more than their number).
#: ``min_groups``: the fewest key groups a split holds (fewer splits at short lists).
#: The probabilities' lift ``2^P_LIFT`` (bf16 MMA operands against codes at ``2^-133``): a product ``p * scale *
#: code`` stays a normal fp32 down to ``p * scale * code ~ 2^-73``, and a split's zero-share sum ``sum_s p_s *
#: zero_s * 2^P_LIFT`` overflows fp32 only past ``2^48`` (at 2^100, the earlier lift, a value zero of 2^11 over a
#: 128K-token split did).
P_LIFT = 80

KIVI_GLUON_CONFIG = {2: {"stages": 3, "programs_per_sm": 12, "min_groups": 4},
                     4: {"stages": 4, "programs_per_sm": 16, "min_groups": 4}}

#: Per query (and scale) dtype: the codes' unit exponent ``E`` (a 16-bit pattern ``N < 256`` is ``N * 2^-E``), the
#: query lift ``LQ`` (the keys' operand ``q * scale * 2^(LQ - s_j)``, their logits in units of ``2^(LQ - E)``) and the
#: probabilities' lift ``P``. bf16 has fp32's exponent range: the query lift of 2^100 and :data:`P_LIFT` keep every
#: product normal. fp16 tops out at 65504: no query lift (where the keys' operand ``q * scale * 2^-s_j`` falls
#: subnormal, its absolute error, at most ``2^-25 * 2^s_j`` a channel, stays far under the 2-bit codes' own), and
#: ``p * 2^8``, finite for value scales up to 256, flushing only probabilities under ``2^-32 / scale`` of the row's
#: largest.
_UNITS = {torch.bfloat16: (133, 100, P_LIFT), torch.float16: (24, 0, 8)}


@functools.cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def gluon_supported(query: torch.Tensor, bits: int, group: int, dim: int, page: int, rows: int,
                    scale_dtype: torch.dtype) -> bool:
    """Shapes and devices this kernel takes: 2 or 4 bits, groups of 32, head dim 128, queries and scales both bf16 or
    both fp16, at most 8 query rows (queries x GQA) a KV head, pages of one group (the engine's default with KIVI:
    ``max(page_size, group_size)``), an sm_90 GPU."""
    return (gluon is not None and query.is_cuda and bits in (2, 4) and group == 32 and dim == 128 and page == group
            and rows <= 8 and query.dtype in _UNITS and scale_dtype == query.dtype
            and _sm90(query.device.index if query.device.index is not None else torch.cuda.current_device()))


if gluon is not None:
    # Triton 3.6 names the copy async_copy_global_to_shared and the barrier thread_barrier; 3.7+ async_load, barrier
    _copy = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier

    # bytes 0, 1 and 2, 3 of a word into the low bytes of two words' 16-bit halves, then one mask a plane
    _PLANES = gl.constexpr(
        "{ .reg .b32 a, b, z; mov.b32 z, 0; prmt.b32 a, $8, z, 0x4140; prmt.b32 b, $8, z, 0x4342;"
        " and.b32 $0, a, 0x00030003; and.b32 $1, b, 0x00030003; and.b32 $2, a, 0x000C000C;"
        " and.b32 $3, b, 0x000C000C; and.b32 $4, a, 0x00300030; and.b32 $5, b, 0x00300030;"
        " and.b32 $6, a, 0x00C000C0; and.b32 $7, b, 0x00C000C0; }")

    @gluon.jit
    def _planes(x, DT: gl.constexpr):
        """``[.., 4k]`` bytes -> the four 2-bit planes as ``code * 4^j`` subnormals of ``DT`` (units ``2^-133`` in
        bf16, ``2^-24`` in fp16)."""
        dt = DT.value
        return gl.inline_asm_elementwise(_PLANES, "=r,=r,=r,=r,=r,=r,=r,=r,r", [x], dtype=(dt, dt, dt, dt),
                                         is_pure=True, pack=4)

    _PLANES4 = gl.constexpr(
        "{ .reg .b32 a, b, z; mov.b32 z, 0; prmt.b32 a, $4, z, 0x4140; prmt.b32 b, $4, z, 0x4342;"
        " and.b32 $0, a, 0x000F000F; and.b32 $1, b, 0x000F000F; and.b32 $2, a, 0x00F000F0;"
        " and.b32 $3, b, 0x00F000F0; }")

    @gluon.jit
    def _planes4(x, DT: gl.constexpr):
        """``[.., 4k]`` bytes -> the two 4-bit planes as ``code * 16^j`` subnormals of ``DT``."""
        return gl.inline_asm_elementwise(_PLANES4, "=r,=r,=r,=r,r", [x], dtype=(DT.value, DT.value), is_pure=True,
                                         pack=4)

    @gluon.jit
    def _chunks(tile, BITS: gl.constexpr, dim: gl.constexpr, a_l: gl.constexpr, DT: gl.constexpr):
        """A stage's codes (keys ``[G, B]``, ``dim`` 1; values ``[B, G]``, ``dim`` 0) -> the four channel chunks'
        A operands in layout ``a_l`` (chunk ``j``: channels ``32j ..``, at byte ``32j % B``, plane ``32j // B``)."""
        if BITS == 2:
            c0, c1, c2, c3 = _planes(tile.load(a_l), DT)
        else:
            c0, c2 = _planes4(tile.slice(0, 32, dim=dim).load(a_l), DT)
            c1, c3 = _planes4(tile.slice(32, 32, dim=dim).load(a_l), DT)
        return c0, c1, c2, c3

    @gluon.jit
    def _issue(KC, KS, KZ, VC, VS, VZ, POS, kcs, kss, kzs, vcs, vss, vzs, pss, page, h, ok, KV_HEADS: gl.constexpr,
               B: gl.constexpr, POSITIONS: gl.constexpr):
        """cp.async of one page (one key group) into one ring stage (``POSITIONS``: its positions too), then
        commit."""
        G: gl.constexpr = 32
        D: gl.constexpr = 128
        tk: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // B, B // 16], [1, 1], [1, 0])  # [G, B], 16 a copy
        tv: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [1, 1], [1, 0])  # [B, G]
        t4: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])  # 128 halves, 8 bytes a copy
        t1: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])  # 32 ints
        r = gl.arange(0, G, layout=gl.SliceLayout(1, tk))
        c = gl.arange(0, B, layout=gl.SliceLayout(0, tk))
        base = page * KV_HEADS + h  # (page, head): one group, so every block below is contiguous
        _copy(kcs, KC + ((base * G + r) * B)[:, None] + c[None, :], mask=ok)  # [slots, bytes]
        vr = gl.arange(0, B, layout=gl.SliceLayout(1, tv))
        vs = gl.arange(0, G, layout=gl.SliceLayout(0, tv))
        _copy(vcs, VC + base * (B * G) + (vr * G)[:, None] + vs[None, :], mask=ok)  # [bytes, slots] byte-major
        d = gl.arange(0, D, layout=t4)
        _copy(kss, KS + base * D + d, mask=ok)
        _copy(kzs, KZ + base * D + d, mask=ok)
        _copy(vss, VS + base * D + d, mask=ok)  # [D / G, G]
        tz: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])  # [D / G, G], 8 bytes a copy
        zr = gl.arange(0, D // G, layout=gl.SliceLayout(1, tz))
        zc = gl.arange(0, G, layout=gl.SliceLayout(0, tz))
        _copy(vzs.slice(0, D // G), VZ + base * D + (zr * G)[:, None] + zc[None, :], mask=ok)  # rows 0..3 of 16
        if POSITIONS:
            _copy(pss, POS + base * G + gl.arange(0, G, layout=t1), mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _zeros_a(kzm, start: gl.constexpr, zt):
        """A chunk's key zeros from the stage, broadcast over the A tile's rows."""
        z = kzm.slice(start, 32).load(gl.SliceLayout(0, zt.type.layout))
        zz, _ = gl.broadcast(z[None, :], zt)
        return zz

    @gluon.jit
    def _values(acc, codes, pb, vm):
        """``acc += codes . (p * scale)^T`` for one value chunk (codes at ``4^j * 2^-133``; ``p``, the scales and
        their product bf16)."""
        return mma_v2(codes, pb * vm.load(gl.SliceLayout(1, pb.type.layout))[:, None], acc)

    @gluon.jit
    def _row(sums, j: gl.constexpr):
        """Row ``j`` of the ``[16, R]`` sums tile (in the probabilities' lifted units)."""
        rows = gl.arange(0, 16, layout=gl.SliceLayout(1, sums.type.layout))
        return gl.sum(gl.where(rows[:, None] == j, sums, 0.0), axis=0)

    @gluon.jit
    def _finish(acc, sums, j: gl.constexpr, lift, unlift, inv):
        """Chunk ``j``'s normalized output: ``(acc * lift + sum_s p_s zero_s) / l`` (``unlift``: ``2^-PLIFT``)."""
        return (acc * lift + (_row(sums, j) * unlift)[None, :]) * inv[None, :]

    @gluon.jit
    def _kivi_gluon_kernel(Q, KC, KS, KZ, VC, VS, VZ, POS, INDEX, QUANT, QPOS, MID_O, MID_LSE, LOGITS,
                           stride_qb, stride_qh, stride_qt, stride_ib, stride_ih, stride_pb, qk_scale, window,
                           num_queries, logits_span, KV_HEADS: gl.constexpr, GROUP: gl.constexpr,
                           NUM_SPLITS: gl.constexpr, QSPLITS: gl.constexpr, STAGES: gl.constexpr, BITS: gl.constexpr,
                           WRITE_LOGITS: gl.constexpr, ALL_VISIBLE: gl.constexpr, DT: gl.constexpr,
                           KEY_UNITS: gl.constexpr,
                           PLIFT: gl.constexpr, UNLIFT: gl.constexpr,
                           U0: gl.constexpr, U1: gl.constexpr, U2: gl.constexpr, U3: gl.constexpr,
                           L0: gl.constexpr, L1: gl.constexpr, L2: gl.constexpr, L3: gl.constexpr):
        """One program (one warp): the 8 query rows of one (sequence, kv head) over one split of its quantized
        groups; writes split ``program_id(1)`` of ``MID_O / MID_LSE`` (``NUM_SPLITS`` a row, the last ones the
        residual ring's); ``WRITE_LOGITS`` (one query a sequence): every quantized slot's natural-log logit (-inf where
        masked) to ``LOGITS [batch, q_heads, logits_span]``. ``ALL_VISIBLE``: no positions copied or compared (every
        quantized slot visible, :func:`kivi_gluon_quantized`). With :data:`_UNITS`' ``E, LQ, P`` for ``DT``:
        ``U_j``, chunk ``j``'s query lift ``2^(LQ - s_j)``, ``L_j`` its output's ``2^(E - s_j - P)`` (``s_j`` the
        chunk's bit offset in a byte), ``KEY_UNITS = 2^(E - LQ)``, ``PLIFT = P``, ``UNLIFT = 2^-P``."""
        G: gl.constexpr = 32
        C: gl.constexpr = 32
        B: gl.constexpr = 32 * BITS // 2
        R: gl.constexpr = 8
        D: gl.constexpr = 128
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # a stage's layout (the ring index apart)
        flat1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        kcs = gl.allocate_shared_memory(gl.uint8, [STAGES, G, B], flat2)
        vcs = gl.allocate_shared_memory(gl.uint8, [STAGES, B, G], flat2)
        kss = gl.allocate_shared_memory(DT, [STAGES, D], flat1)
        kzs = gl.allocate_shared_memory(DT, [STAGES, D], flat1)
        vss = gl.allocate_shared_memory(DT, [STAGES, D], flat1)
        # the values' zeros [D / G, G] as rows 0..3 of an A tile whose row 4 is ones: one MMA a group gives every
        # chunk's zero share sum_s p_s zero_s and the softmax sum
        vzs = gl.allocate_shared_memory(DT, [STAGES, 16, G], flat2)
        pss = gl.allocate_shared_memory(gl.int32, [STAGES, G], flat1)
        pid = gl.program_id(0)
        split = gl.program_id(1)
        b = pid // KV_HEADS
        h = pid % KV_HEADS
        # rows: row = query * GROUP + head-in-group, as the Triton kernel's
        qr = gl.arange(0, R, layout=gl.SliceLayout(0, b_l))
        qc = gl.arange(0, C, layout=gl.SliceLayout(1, b_l))
        qp = Q + b * stride_qb + (h * GROUP + qr % GROUP)[None, :] * stride_qh + (qr // GROUP)[None, :] * stride_qt
        qok = (qr < num_queries * GROUP)[None, :]
        q0 = gl.load(qp + qc[:, None], mask=qok, other=0.0).to(gl.float32) * qk_scale
        q1 = gl.load(qp + C + qc[:, None], mask=qok, other=0.0).to(gl.float32) * qk_scale
        q2 = gl.load(qp + 2 * C + qc[:, None], mask=qok, other=0.0).to(gl.float32) * qk_scale
        q3 = gl.load(qp + 3 * C + qc[:, None], mask=qok, other=0.0).to(gl.float32) * qk_scale
        u0 = (q0 * U0).to(DT)  # times the group's key scales, once a group
        u1 = (q1 * U1).to(DT)
        u2 = (q2 * U2).to(DT)
        u3 = (q3 * U3).to(DT)
        z0 = q0.to(DT)  # for the zeros (logits in units of 1)
        z1 = q1.to(DT)
        z2 = q2.to(DT)
        z3 = q3.to(DT)
        mr = gl.arange(0, R, layout=gl.SliceLayout(0, mma))
        rok = mr < num_queries * GROUP
        qpos = gl.load(QPOS + b * stride_pb + mr // GROUP, mask=rok, other=-1).to(gl.int32)  # slots' dtype
        # visible: a token (position >= 0), not in the future, inside a sliding window (transformers' convention)
        qlo = gl.where(window > 0, qpos - window, -1)
        lrow = (b * (KV_HEADS * GROUP) + h * GROUP + mr).to(gl.int64) * logits_span  # WRITE_LOGITS: rows = heads
        lslot = gl.arange(0, G, layout=gl.SliceLayout(1, mma))
        m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
        sums = gl.zeros([16, R], gl.float32, layout=mma)  # rows 0..3: the chunks' zero shares, 4: sum_s p_s
        o0 = gl.zeros([C, R], gl.float32, layout=mma)
        o1 = gl.zeros([C, R], gl.float32, layout=mma)
        o2 = gl.zeros([C, R], gl.float32, layout=mma)
        o3 = gl.zeros([C, R], gl.float32, layout=mma)
        zt = gl.zeros([G, C], DT, layout=a_l)
        tone: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
        ones = gl.where(gl.arange(0, 4, layout=gl.SliceLayout(1, tone))[:, None] == 0,
                        gl.full([4, G], 1.0, DT, tone), gl.zeros([4, G], DT, tone))
        for i in gl.static_range(STAGES):  # rows 4..15 once (the copies write rows 0..3)
            vzs.index(i).slice(4, 4).store(ones)
            vzs.index(i).slice(8, 8).store(gl.zeros([8, G], DT, tone))
        n_groups = gl.load(QUANT + b).to(gl.int32) // G
        per = (n_groups + QSPLITS - 1) // QSPLITS
        first = split * per
        last = gl.minimum(first + per, n_groups)
        pages = INDEX + b * stride_ib + h * stride_ih
        for i in gl.static_range(STAGES - 1):  # prologue: the first STAGES - 1 groups' copies
            page = gl.load(pages + gl.minimum(first + i, gl.maximum(last - 1, 0))).to(gl.int64)
            _issue(KC, KS, KZ, VC, VS, VZ, POS, kcs.index(i), kss.index(i), kzs.index(i), vcs.index(i),
                   vss.index(i), vzs.index(i), pss.index(i), page, h, first + i < last, KV_HEADS, B,
                   not ALL_VISIBLE)
        ahead = gl.load(pages + gl.minimum(first + STAGES - 1, gl.maximum(last - 1, 0))).to(gl.int64)
        st = 0  # the stage of group grp; ns: the one refilled (group grp - 1's), carried instead of two modulos
        ns = STAGES - 1
        for grp in range(first, last):
            async_copy.wait_group(STAGES - 2)  # this group's copies landed (this thread's) ...
            _barrier()  # ... and every lane's; every lane is done with the stage refilled next
            nxt = grp + STAGES - 1
            _issue(KC, KS, KZ, VC, VS, VZ, POS, kcs.index(ns), kss.index(ns), kzs.index(ns), vcs.index(ns),
                   vss.index(ns), vzs.index(ns), pss.index(ns), ahead, h, nxt < last, KV_HEADS, B,
                   not ALL_VISIBLE)
            ahead = gl.load(pages + gl.minimum(nxt + 1, last - 1)).to(gl.int64)  # the page a group ahead
            ksm = kss.index(st)
            kzm = kzs.index(st)
            k0, k1, k2, k3 = _chunks(kcs.index(st), BITS, 1, a_l, DT)
            s = gl.zeros([G, R], gl.float32, layout=mma)
            # two independent MMA chains (the zeros', the codes'), summed: 1.4 % (2 bits) to 7 % (4 bits) faster at
            # 128K x 4 than one chain of eight, four chains no faster (results/kivi_gluon_chains_sweep_h200.jsonl)
            sz = mma_v2(_zeros_a(kzm, 0, zt), z0, s)
            sz = mma_v2(_zeros_a(kzm, C, zt), z1, sz)
            sz = mma_v2(_zeros_a(kzm, 2 * C, zt), z2, sz)
            sz = mma_v2(_zeros_a(kzm, 3 * C, zt), z3, sz)
            sc = mma_v2(k0, u0 * ksm.slice(0, C).load(gl.SliceLayout(1, b_l))[:, None], s)
            sc = mma_v2(k1, u1 * ksm.slice(C, C).load(gl.SliceLayout(1, b_l))[:, None], sc)
            sc = mma_v2(k2, u2 * ksm.slice(2 * C, C).load(gl.SliceLayout(1, b_l))[:, None], sc)
            sc = mma_v2(k3, u3 * ksm.slice(3 * C, C).load(gl.SliceLayout(1, b_l))[:, None], sc)
            if ALL_VISIBLE:  # base-2 logits (one FMA from the codes' units)
                s = sc * KEY_UNITS + sz
            else:
                kpos = pss.index(st).load(gl.SliceLayout(1, mma))
                vis = (kpos[:, None] > qlo[None, :]) & (kpos[:, None] <= qpos[None, :])
                s = gl.where(vis, sc * KEY_UNITS + sz, float("-inf"))
            if WRITE_LOGITS:  # natural units; a page is one group, so the list's slots grp * G ..
                gl.store(LOGITS + lrow[None, :] + (grp * G + lslot)[:, None], s * 0.6931471805599453,
                         mask=rok[None, :])
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - (m_use - PLIFT)[None, :])  # p * 2^PLIFT (the lift undone at the end)
            if gl.max(gl.where(m_new > m_i, 1, 0), axis=0) > 0:  # a row's max rose: rescale (rarely after the start)
                alpha = gl.exp2(m_i - m_use)
                a = alpha[None, :]
                sums = sums * a
                o0, o1, o2, o3 = o0 * a, o1 * a, o2 * a, o3 * a
            m_i = m_new
            pb = gl.convert_layout(p.to(DT), b_l)
            sums = mma_v2(vzs.index(st).load(a_l), pb, sums)
            v0, v1, v2, v3 = _chunks(vcs.index(st), BITS, 0, a_l, DT)
            vsm = vss.index(st)
            o0 = _values(o0, v0, pb, vsm.slice(0, G))
            o1 = _values(o1, v1, pb, vsm.slice(G, G))
            o2 = _values(o2, v2, pb, vsm.slice(2 * G, G))
            o3 = _values(o3, v3, pb, vsm.slice(3 * G, G))
            ns = st
            st = gl.where(st == STAGES - 1, 0, st + 1)
        async_copy.wait_group(0)
        l_i = _row(sums, 4) * UNLIFT
        inv = 1.0 / gl.where(l_i == 0.0, 1.0, l_i)
        lse = gl.where(l_i == 0.0, float("-inf"), m_i * 0.6931471805599453 + gl.log(gl.where(l_i == 0.0, 1.0, l_i)))
        qh = h * GROUP + mr % GROUP
        mid = ((b * (KV_HEADS * GROUP) + qh) * num_queries + mr // GROUP) * NUM_SPLITS + split
        gl.store(MID_LSE + mid, lse, mask=rok)
        orow = gl.arange(0, C, layout=gl.SliceLayout(1, mma))
        out = MID_O + mid[None, :] * D + orow[:, None]
        ok = rok[None, :]
        gl.store(out, _finish(o0, sums, 0, L0, UNLIFT, inv), mask=ok)
        gl.store(out + C, _finish(o1, sums, 1, L1, UNLIFT, inv), mask=ok)
        gl.store(out + 2 * C, _finish(o2, sums, 2, L2, UNLIFT, inv), mask=ok)
        gl.store(out + 3 * C, _finish(o3, sums, 3, L3, UNLIFT, inv), mask=ok)


def kivi_gluon_quantized(query, kcode, kscale, kzero, vcode, vscale, vzero, pos_pool, index, quantized, q_positions,
                         scale: float, sliding_window: int, mid_o: torch.Tensor, mid_lse: torch.Tensor,
                         qsplits: int, logits: torch.Tensor | None = None, all_visible: bool = False) -> None:
    """Splits ``0 .. qsplits - 1`` of ``mid_o [B, q_heads, queries, S, D] / mid_lse [B, q_heads, queries, S]``:
    every list's quantized slots (``query``, ``index``, ``q_positions`` as :func:`.pool.launch_inputs` returns
    them); with ``logits [B, q_heads, span]`` (one query a sequence) the quantized slots' logits too. Every list
    reads ``quantized[b]`` slots from pages, which the storage keeps ``<= lengths[b, h]`` (``Q(n) <= n``, one slot
    count a row, as the Triton kernel's quantized loop also assumes). ``all_visible``: the caller vouches that every
    quantized slot is visible to every query (no empty slot, none after a query, no sliding window): the kernel then
    reads no positions (H200, 2 bits at 128K x 4: the whole op 136.0 / 132.5 -> 125.9 / 125.8 us; 4 bits 206.6 /
    190.4 -> 181.7 / 181.8; bit-equal; ``results/kivi_all_visible_ab_h200.jsonl``)."""
    batch, q_heads, queries, dim = query.shape
    heads = kcode.shape[1]
    bits = storage_bits(kcode, dim)
    cfg = KIVI_GLUON_CONFIG[bits]
    _kivi_gluon_kernel[(batch * heads, qsplits)](
        query, kcode.view(torch.uint8), kscale, kzero, vcode.view(torch.uint8), vscale, vzero, pos_pool, index,
        quantized, q_positions, mid_o, mid_lse, mid_lse if logits is None else logits,
        query.stride(0), query.stride(1), query.stride(2), index.stride(0), index.stride(1), q_positions.stride(0),
        float(scale) * 1.4426950408889634, int(sliding_window), queries, 0 if logits is None else logits.shape[-1],
        KV_HEADS=heads, GROUP=q_heads // heads, NUM_SPLITS=mid_lse.shape[-1], QSPLITS=qsplits,
        **launch_constants(bits, logits is not None, query.dtype, all_visible), num_warps=1,
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
        **FP_FUSION,
    )


def launch_constants(bits: int, with_logits: bool, dtype: torch.dtype = torch.bfloat16,
                     all_visible: bool = False) -> dict:
    """The kernel's constexprs that depend on the bit width and the query dtype alone (the ring stages, the units of
    :data:`_UNITS`, the chunks' lifts ``U_j / L_j``), the logits switch and ``ALL_VISIBLE``; the shape's (heads,
    splits) are the launch's."""
    shifts = [(32 * j // (128 * bits // 8)) * bits for j in range(4)]  # chunk j's bit offset in its bytes
    e, lq, lift = _UNITS[dtype]
    return {"STAGES": KIVI_GLUON_CONFIG[bits]["stages"], "BITS": bits, "WRITE_LOGITS": with_logits,
            "ALL_VISIBLE": all_visible,
            "DT": gl.bfloat16 if dtype == torch.bfloat16 else gl.float16, "KEY_UNITS": 2.0 ** (e - lq),
            "PLIFT": float(lift), "UNLIFT": 2.0 ** -lift,
            **{f"U{j}": 2.0 ** (lq - sh) for j, sh in enumerate(shifts)},
            **{f"L{j}": 2.0 ** (e - sh - lift) for j, sh in enumerate(shifts)}}
