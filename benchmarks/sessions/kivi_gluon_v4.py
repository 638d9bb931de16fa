"""Session probe (#20, 2026-12-04, thirteenth session): v3 (``kivi_gluon_v3.py``) on the pool's own layouts: value
codes ``[slots, bytes]`` and value scales / zeros ``[slots, D / G]`` copied as stored, transposed by the reads from
shared memory (byte loads) instead of by a second storage layout. v3's docstring follows.

v3: v2's arithmetic (``kivi_gluon_v2.py``: codes as subnormal
floats) fed by a ring of ``STAGES`` shared-memory buffers filled with ``cp.async``.

Why: v2 cut the loop from 898 to 637 instructions a group and ran no faster (259 vs 237 us at 128K x 4): a warp
waits for each group's loads (the page index, then codes and metadata) before it computes, and at ~200 registers
only 9-10 warps an SM hide that. Here the copies of group ``g + STAGES - 1`` are in flight while group ``g``
computes (no registers held for them), and the page index is read one group ahead of its copies.

    python benchmarks/sessions/kivi_gluon_v3.py [--compile-only]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kivi_gluon_decode import BITS, D, GQA, KV_HEADS, PAGE, combine, inputs, loop_mix, reference, shared_ops  # noqa: E402
from kivi_gluon_v2 import _bcast, _planes, _share, _values, registers  # noqa: E402

# Triton 3.6 names the copy async_copy_global_to_shared, 3.7+ async_load (the old name raises)
_copy = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # 3.6: thread_barrier


@gluon.jit
def _issue(KC, KS, KZ, VT, VS, VZ, kcs, kss, kzs, vts, vss, vzs, page, h, ok,
           KV_HEADS: gl.constexpr, PAGE: gl.constexpr):
    """cp.async of one group's codes and metadata (the group at the start of ``page``) into one ring stage."""
    G: gl.constexpr = 32
    B: gl.constexpr = 32
    D: gl.constexpr = 128
    t16: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [1, 1], [1, 0])  # 32 x 32 bytes, 16 a copy
    t4: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])  # 128 halves, 8 bytes a copy
    r = gl.arange(0, G, layout=gl.SliceLayout(1, t16))
    c = gl.arange(0, B, layout=gl.SliceLayout(0, t16))
    base = page * KV_HEADS + h
    tile = (base * PAGE + r)[:, None] * B + c[None, :]  # [slots, bytes] of the key codes
    _copy(kcs, KC + tile, mask=ok)
    _copy(vts, VT + tile, mask=ok)  # [slots, bytes] as stored
    d = gl.arange(0, D, layout=t4)
    _copy(kss, KS + base * D + d, mask=ok)
    _copy(kzs, KZ + base * D + d, mask=ok)
    meta = base * PAGE * (D // G) + d  # [G, D / G] per-slot metadata as stored, contiguous
    _copy(vss, VS + meta, mask=ok)
    _copy(vzs, VZ + meta, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _decode4(Q, KC, KS, KZ, VT, VS, VZ, INDEX, OUT, MAX, SUM, groups_per_split, n_groups, stride_ib, stride_ih,
             qk_scale, KV_HEADS: gl.constexpr, GQA: gl.constexpr, PAGE: gl.constexpr, NSPLIT: gl.constexpr,
             STAGES: gl.constexpr):
    G: gl.constexpr = 32
    C: gl.constexpr = 32
    B: gl.constexpr = 32
    R: gl.constexpr = 8
    D: gl.constexpr = 128
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # a stage's layout (the ring's first index apart)
    flat1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    kcs = gl.allocate_shared_memory(gl.uint8, [STAGES, G, B], flat)
    vts = gl.allocate_shared_memory(gl.uint8, [STAGES, B, G], flat)
    kss = gl.allocate_shared_memory(gl.bfloat16, [STAGES, D], flat1)
    kzs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, D], flat1)
    vss = gl.allocate_shared_memory(gl.bfloat16, [STAGES, D], flat1)
    vzs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, D], flat1)
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // KV_HEADS
    h = pid % KV_HEADS
    qr = gl.arange(0, R, layout=gl.SliceLayout(0, b_l))
    qc = gl.arange(0, C, layout=gl.SliceLayout(1, b_l))
    qp = Q + (b * (KV_HEADS * GQA) + h * GQA + qr)[None, :] * D + qc[:, None]
    qok = (qr < GQA)[None, :]
    q0 = gl.load(qp, mask=qok, other=0.0).to(gl.float32) * qk_scale
    q1 = gl.load(qp + C, mask=qok, other=0.0).to(gl.float32) * qk_scale
    q2 = gl.load(qp + 2 * C, mask=qok, other=0.0).to(gl.float32) * qk_scale
    q3 = gl.load(qp + 3 * C, mask=qok, other=0.0).to(gl.float32) * qk_scale
    u0 = (q0 * 1.2676506002282294e30).to(gl.bfloat16)  # 2^100
    u1 = (q1 * 3.1691265005705735e29).to(gl.bfloat16)  # 2^98
    u2 = (q2 * 7.922816251426434e28).to(gl.bfloat16)  # 2^96
    u3 = (q3 * 1.9807040628566084e28).to(gl.bfloat16)  # 2^94
    z0 = (q0.to(gl.bfloat16).to(gl.float32) * 1.1641532182693481e-10).to(gl.bfloat16)  # 2^-33
    z1 = (q1.to(gl.bfloat16).to(gl.float32) * 1.1641532182693481e-10).to(gl.bfloat16)
    z2 = (q2.to(gl.bfloat16).to(gl.float32) * 1.1641532182693481e-10).to(gl.bfloat16)
    z3 = (q3.to(gl.bfloat16).to(gl.float32) * 1.1641532182693481e-10).to(gl.bfloat16)
    m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_t = gl.zeros([G, R], gl.float32, layout=mma)
    o0 = gl.zeros([C, R], gl.float32, layout=mma)
    o1 = gl.zeros([C, R], gl.float32, layout=mma)
    o2 = gl.zeros([C, R], gl.float32, layout=mma)
    o3 = gl.zeros([C, R], gl.float32, layout=mma)
    w0 = gl.zeros([G, R], gl.float32, layout=b_l)
    w1 = gl.zeros([G, R], gl.float32, layout=b_l)
    w2 = gl.zeros([G, R], gl.float32, layout=b_l)
    w3 = gl.zeros([G, R], gl.float32, layout=b_l)
    zt = gl.zeros([G, C], gl.bfloat16, layout=a_l)
    first = split * groups_per_split
    last = gl.minimum(first + groups_per_split, n_groups)
    pages = INDEX + b * stride_ib + h * stride_ih
    # prologue: the first STAGES - 1 groups' copies; the page of the next one read ahead
    for i in gl.static_range(STAGES - 1):
        g = first + i
        page = gl.load(pages + gl.minimum(g, last - 1) * G // PAGE).to(gl.int64)
        _issue(KC, KS, KZ, VT, VS, VZ, kcs.index(i), kss.index(i), kzs.index(i), vts.index(i), vss.index(i),
               vzs.index(i), page, h, g < last, KV_HEADS, PAGE)
    ahead = gl.load(pages + gl.minimum(first + STAGES - 1, last - 1) * G // PAGE).to(gl.int64)
    for grp in range(first, last):
        st = (grp - first) % STAGES
        async_copy.wait_group(STAGES - 2)  # this group's copies landed (this thread's)
        _barrier()  # ... every lane's; and every lane is done with the stage refilled next
        nxt = grp + STAGES - 1
        ns = (nxt - first) % STAGES
        _issue(KC, KS, KZ, VT, VS, VZ, kcs.index(ns), kss.index(ns), kzs.index(ns), vts.index(ns), vss.index(ns),
               vzs.index(ns), ahead, h, nxt < last, KV_HEADS, PAGE)
        ahead = gl.load(pages + gl.minimum(nxt + 1, last - 1) * G // PAGE).to(gl.int64)
        kb = kcs.index(st).load(a_l)
        ksm = kss.index(st)
        kzm = kzs.index(st)
        k0, k1, k2, k3 = _planes(kb)
        s = gl.zeros([G, R], gl.float32, layout=mma)
        s = mma_v2(_zeros_a(kzm, 0, zt), z0, s)
        s = mma_v2(_zeros_a(kzm, C, zt), z1, s)
        s = mma_v2(_zeros_a(kzm, 2 * C, zt), z2, s)
        s = mma_v2(_zeros_a(kzm, 3 * C, zt), z3, s)
        s = mma_v2(k0, u0 * ksm.slice(0, C).load(gl.SliceLayout(1, b_l))[:, None], s)
        s = mma_v2(k1, u1 * ksm.slice(C, C).load(gl.SliceLayout(1, b_l))[:, None], s)
        s = mma_v2(k2, u2 * ksm.slice(2 * C, C).load(gl.SliceLayout(1, b_l))[:, None], s)
        s = mma_v2(k3, u3 * ksm.slice(3 * C, C).load(gl.SliceLayout(1, b_l))[:, None], s)
        m_new = gl.maximum(m_i, gl.max(s, axis=0) * 8589934592.0)
        p = gl.exp2(s * 8589934592.0 - (m_new - 100.0)[None, :])
        if gl.max(m_new - m_i, axis=0) > 0:
            alpha = gl.exp2(m_i - m_new)
            a = alpha[None, :]
            ab = gl.convert_layout(alpha, gl.SliceLayout(0, b_l))[None, :]
            l_t = l_t * a
            o0, o1, o2, o3 = o0 * a, o1 * a, o2 * a, o3 * a
            w0, w1, w2, w3 = w0 * ab, w1 * ab, w2 * ab, w3 * ab
        m_i = m_new
        l_t = l_t + p
        pb = gl.convert_layout(p, b_l)
        v0, v1, v2, v3 = _planes(vts.index(st).permute([1, 0]).load(a_l))  # [bytes, slots]: byte reads
        vsm = vss.index(st)
        vzm = vzs.index(st)
        o0, w0 = _values_s(o0, w0, v0, pb, _col(vsm, 0), _col(vzm, 0))
        o1, w1 = _values_s(o1, w1, v1, pb, _col(vsm, 1), _col(vzm, 1))
        o2, w2 = _values_s(o2, w2, v2, pb, _col(vsm, 2), _col(vzm, 2))
        o3, w3 = _values_s(o3, w3, v3, pb, _col(vsm, 3), _col(vzm, 3))
    async_copy.wait_group(0)
    orow = gl.arange(0, C, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, R, layout=gl.SliceLayout(0, mma))
    out = OUT + ((pid * NSPLIT + split) * R + ocol)[None, :] * D + orow[:, None]
    gl.store(out, o0 * 8589934592.0 + _share(w0, ocol))
    gl.store(out + C, o1 * 2147483648.0 + _share(w1, ocol))
    gl.store(out + 2 * C, o2 * 536870912.0 + _share(w2, ocol))
    gl.store(out + 3 * C, o3 * 134217728.0 + _share(w3, ocol))
    gl.store(MAX + (pid * NSPLIT + split) * R + ocol, m_i)
    gl.store(SUM + (pid * NSPLIT + split) * R + ocol, gl.sum(l_t, axis=0) * 7.888609052210118e-31)


@gluon.jit
def _zeros_a(kzm, start: gl.constexpr, zt):
    """A chunk's key zeros from the stage, broadcast over the A tile's rows."""
    z = kzm.slice(start, 32).load(gl.SliceLayout(0, zt.type.layout))
    zz, _ = gl.broadcast(z[None, :], zt)
    return zz


@gluon.jit
def _col(m, j: gl.constexpr):
    """Column ``j`` of a stage's ``[G, D / G]`` per-slot metadata."""
    idx = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.DotOperandLayout(operand_index=1, parent=gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]), k_width=8))) * 4 + j
    return m.gather(idx, 0)


@gluon.jit
def _values_s(acc, w, codes, pb, vsm, vzm):
    """v2's ``_values`` with the chunk's per-slot scale and zero read from the stage."""
    scale = vsm.to(gl.float32)
    zero = vzm.to(gl.float32)
    acc = mma_v2(codes, (pb * scale[:, None]).to(gl.bfloat16), acc)
    return acc, w + pb * zero[:, None]


SIG = {"Q": "*bf16", "KC": "*u8", "KS": "*bf16", "KZ": "*bf16", "VT": "*u8", "VS": "*bf16", "VZ": "*bf16",
       "INDEX": "*i32", "OUT": "*fp32", "MAX": "*fp32", "SUM": "*fp32"}


def compile_only(stages: int) -> None:
    sig = {**SIG, "groups_per_split": "i32", "n_groups": "i32", "stride_ib": "i32", "stride_ih": "i32",
           "qk_scale": "fp32", **{k: "constexpr" for k in ("KV_HEADS", "GQA", "PAGE", "NSPLIT", "STAGES")}}
    consts = {"KV_HEADS": KV_HEADS, "GQA": GQA, "PAGE": PAGE, "NSPLIT": 33, "STAGES": stages}
    src = GluonASTSource(_decode4, sig, consts, {(i,): [["tt.divisibility", 16]] for i in range(len(SIG))})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 1})
    mix = loop_mix(k.asm["cubin"])
    print(f"stages={stages}: loop {sum(mix.values())} instructions a group (the lazy rescale counted), shared-memory "
          f"ops {shared_ops(mix)}, registers {registers(k.asm['cubin'])}, shared bytes {k.metadata.shared};",
          ", ".join(f"{o}={n}" for o, n in mix.most_common(22)))


def launch(t: dict, splits: int, stages: int):
    batch = t["q"].shape[0]
    lists = batch * KV_HEADS
    per = -(-t["n_groups"] // splits)
    o = torch.empty(lists * splits * 8 * D, device="cuda")
    m = torch.empty(lists * splits * 8, device="cuda")
    l_ = torch.empty_like(m)
    _decode4[(lists, splits)](t["q"], t["kc"], t["ks"], t["kz"], t["vc"], t["vs"], t["vz"], t["index"], o, m, l_,
                              per, t["n_groups"], t["index"].stride(0), t["index"].stride(1),
                              D ** -0.5 * 1.4426950408889634, KV_HEADS=KV_HEADS, GQA=GQA, PAGE=PAGE, NSPLIT=splits,
                              STAGES=stages, num_warps=1)
    return o, m, l_


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        for stages in (2, 4):
            compile_only(stages)
        return
    from bandwidth import time_graph
    from kivi_kernels import decode_bytes

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, context in ((1, 32768), (16, 32768), (1, 131072), (4, 131072)):
        sets = inputs(batch, context, 2)
        ref = reference(sets[0])
        for stages in (2, 4):
            for per_sm in (12, 16, 24):
                splits = max(1, min(sms * per_sm // (batch * KV_HEADS), context // 128))
                got = combine(*launch(sets[0], splits, stages), batch, splits)
                err = (got - ref).abs().max().item()
                us = time_graph([lambda t=t, n=splits, z=stages: launch(t, n, z) for t in sets], 10) * 1e6
                print(json.dumps({"batch": batch, "context": context, "stages": stages, "per_sm": per_sm,
                                  "splits": splits, "us": us, "GBps": decode_bytes(batch, context, BITS) / us / 1e3,
                                  "max_err": err, "ref_absmax": ref.abs().max().item()}), flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
