"""Session probe (#20, 2026-12-04, thirteenth session): the Gluon KIVI decode with the codes entering the MMA as
**subnormal floats**, no conversion arithmetic at all.

v1 (``kivi_gluon_decode.py``, 23.1 / 242.8 / 67.1 / 237.1 us at the four points: 1.4x the package kernel) spends
898 instructions a 32-slot group, 1 per code on bit fields and byte permutes plus 2 HFMA2 a pair on ``code - 128``
and ``* scale + zero``. Here:

* a 16-bit float whose bit pattern is ``N < 256`` (exponent field 0 or 1) is exactly ``N * 2^-133`` (bf16; fp16:
  ``N * 2^-24``): the denormal range joins the first binade without a gap. So ``x & (0x00030003 << 2j)`` on a word
  holding two code bytes in its 16-bit halves is two exact floats ``code * 4^j * 2^-133``: **one LOP3 a pair**
  (plus two byte permutes a word that spread bytes ``0, 1`` and ``2, 3`` into the halves);
* the missing factors go to the other operand: keys' per-channel scale, ``4^-j`` and ``2^100`` into the query
  (``q' = q * 2^(100 - 2j) * scale``: one bf16 multiply a pair, once a group, in the B-operand registers), values'
  per-slot scale into the probabilities; the logits come out in units of ``2^-33`` (folded into the ``exp2``'s
  fused multiply-add), the output's ``2^(33 - 2j)`` once at the end;
* keys' zeros: ``sum_c zero_c q_c`` by one more MMA of the broadcast zeros against ``q * 2^-33`` (the same units);
  values' zeros: ``sum_s p_s zero_s`` kept per thread (no shuffle) and reduced once at the end, like the softmax sum.

Layouts as v1 (values' codes transposed per group ``[B, G]``, their scales / zeros ``[D / G, P]``). 2 bits.

    python benchmarks/sessions/kivi_gluon_v2.py [--compile-only]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kivi_gluon_decode import (  # noqa: E402
    BITS,
    GQA,
    KV_HEADS,
    PAGE,
    D,
    _asm,
    _keys,
    combine,
    inputs,
    loop_mix,
    reference,
    shared_ops,
)

from sparsecompile.kernels.kivi_gluon import _planes  # noqa: E402  (the package kernel's copy of the code planes)

LOG_UP = gl.constexpr(100)  # the query's / probabilities' exponent lift: codes are 2^-133, so products land at 2^-33


@gluon.jit
def _decode2(Q, KC, KS, KZ, VT, VS, VZ, INDEX, OUT, MAX, SUM, groups_per_split, n_groups, stride_ib, stride_ih,
             qk_scale, KV_HEADS: gl.constexpr, GQA: gl.constexpr, PAGE: gl.constexpr, NSPLIT: gl.constexpr,
             LAZY: gl.constexpr, KEYS_V1: gl.constexpr = False, VALS_V1: gl.constexpr = False,
             K0: gl.constexpr = "", K1: gl.constexpr = "", K2: gl.constexpr = "", K3: gl.constexpr = "",
             V0: gl.constexpr = "", V1: gl.constexpr = "", V2: gl.constexpr = "", V3: gl.constexpr = ""):
    G: gl.constexpr = 32
    C: gl.constexpr = 32
    B: gl.constexpr = 32
    R: gl.constexpr = 8
    D: gl.constexpr = 128
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // KV_HEADS
    h = pid % KV_HEADS
    qr = gl.arange(0, R, layout=gl.SliceLayout(0, b_l))
    qc = gl.arange(0, C, layout=gl.SliceLayout(1, b_l))
    qp = Q + (b * (KV_HEADS * GQA) + h * GQA + qr)[None, :] * D + qc[:, None]
    qok = (qr < GQA)[None, :]
    # q * 2^(100 - 2j) for chunk j (times the group's key scale each group), q * 2^-33 for the zeros' MMA
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
    ks_ = gl.arange(0, G, layout=gl.SliceLayout(1, a_l))  # key tile rows: slots
    kc_ = gl.arange(0, C, layout=gl.SliceLayout(0, a_l))  # key tile columns: bytes
    vc_ = gl.arange(0, C, layout=gl.SliceLayout(1, a_l))  # value tile rows: bytes
    vs_ = gl.arange(0, G, layout=gl.SliceLayout(0, a_l))  # value tile columns: slots
    ps_ = gl.arange(0, G, layout=gl.SliceLayout(1, b_l))  # p^T rows: slots
    m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_t = gl.zeros([G, R], gl.float32, layout=mma)  # per-thread partial sums of p, reduced at the end
    o0 = gl.zeros([C, R], gl.float32, layout=mma)
    o1 = gl.zeros([C, R], gl.float32, layout=mma)
    o2 = gl.zeros([C, R], gl.float32, layout=mma)
    o3 = gl.zeros([C, R], gl.float32, layout=mma)
    w0 = gl.zeros([G, R], gl.float32, layout=b_l)  # per-thread partial sums of p * value zero, per chunk
    w1 = gl.zeros([G, R], gl.float32, layout=b_l)
    w2 = gl.zeros([G, R], gl.float32, layout=b_l)
    w3 = gl.zeros([G, R], gl.float32, layout=b_l)
    zt = gl.zeros([G, C], gl.bfloat16, layout=a_l)
    first = split * groups_per_split
    last = gl.minimum(first + groups_per_split, n_groups)
    for grp in range(first, last):
        page = gl.load(INDEX + b * stride_ib + h * stride_ih + grp * G // PAGE).to(gl.int64)
        gidx = (page * KV_HEADS + h) * (PAGE // G) + (grp * G % PAGE) // G
        slot0 = gl.multiple_of((page * KV_HEADS + h) * PAGE + grp * G % PAGE, G)
        kat = gl.multiple_of(gidx * D, D)
        kb = gl.load(KC + (slot0 + ks_)[:, None] * B + kc_[None, :])
        s = gl.zeros([G, R], gl.float32, layout=mma)
        if KEYS_V1:  # diagnosis: v1's keys (dequantized in bf16 registers), logits brought to v2's 2^-33 units
            s = mma_v2(_keys(kb, KS, KZ, kat, kc_, zt, K0), q0.to(gl.bfloat16), s)
            s = mma_v2(_keys(kb, KS, KZ, kat + C, kc_, zt, K1), q1.to(gl.bfloat16), s)
            s = mma_v2(_keys(kb, KS, KZ, kat + 2 * C, kc_, zt, K2), q2.to(gl.bfloat16), s)
            s = mma_v2(_keys(kb, KS, KZ, kat + 3 * C, kc_, zt, K3), q3.to(gl.bfloat16), s)
            s = s * 1.1641532182693481e-10
        else:
            k0, k1, k2, k3 = _planes(kb)
            s = mma_v2(_bcast(KZ, kat, kc_, zt), z0, s)
            s = mma_v2(_bcast(KZ, kat + C, kc_, zt), z1, s)
            s = mma_v2(_bcast(KZ, kat + 2 * C, kc_, zt), z2, s)
            s = mma_v2(_bcast(KZ, kat + 3 * C, kc_, zt), z3, s)
            s = mma_v2(k0, u0 * gl.load(KS + kat + qc)[:, None], s)
            s = mma_v2(k1, u1 * gl.load(KS + kat + C + qc)[:, None], s)
            s = mma_v2(k2, u2 * gl.load(KS + kat + 2 * C + qc)[:, None], s)
            s = mma_v2(k3, u3 * gl.load(KS + kat + 3 * C + qc)[:, None], s)
        m_new = gl.maximum(m_i, gl.max(s, axis=0) * 8589934592.0)  # logits = s * 2^33
        # p * 2^100 (the lift cancels at the end): exp2(s * 2^33 - m + 100), one fused multiply-add an element
        p = gl.exp2(s * 8589934592.0 - (m_new - LOG_UP)[None, :])
        if LAZY:
            if gl.max(m_new - m_i, axis=0) > 0:
                alpha = gl.exp2(m_i - m_new)
                a = alpha[None, :]
                ab = gl.convert_layout(alpha, gl.SliceLayout(0, b_l))[None, :]
                l_t = l_t * a
                o0, o1, o2, o3 = o0 * a, o1 * a, o2 * a, o3 * a
                w0, w1, w2, w3 = w0 * ab, w1 * ab, w2 * ab, w3 * ab
        else:
            alpha = gl.exp2(m_i - m_new)
            a = alpha[None, :]
            ab = gl.convert_layout(alpha, gl.SliceLayout(0, b_l))[None, :]
            l_t = l_t * a
            o0, o1, o2, o3 = o0 * a, o1 * a, o2 * a, o3 * a
            w0, w1, w2, w3 = w0 * ab, w1 * ab, w2 * ab, w3 * ab
        m_i = m_new
        l_t = l_t + p
        pb = gl.convert_layout(p, b_l)
        vb = gl.load(VT + gidx * (B * G) + vc_[:, None] * G + vs_[None, :])
        if VALS_V1:  # diagnosis: v1's exact codes (magic exponent, one subtraction a pair)
            v0 = gl.inline_asm_elementwise(V0, "=r,=r,r", [vb], dtype=gl.bfloat16, is_pure=True, pack=4)
            v1 = gl.inline_asm_elementwise(V1, "=r,=r,r", [vb], dtype=gl.bfloat16, is_pure=True, pack=4)
            v2 = gl.inline_asm_elementwise(V2, "=r,=r,r", [vb], dtype=gl.bfloat16, is_pure=True, pack=4)
            v3 = gl.inline_asm_elementwise(V3, "=r,=r,r", [vb], dtype=gl.bfloat16, is_pure=True, pack=4)
        else:
            v0, v1, v2, v3 = _planes(vb)
        vrow = gl.multiple_of((page * KV_HEADS + h) * (D // G) * PAGE + grp * G % PAGE, G) + ps_
        o0, w0 = _values(o0, w0, v0, pb, VS, VZ, vrow)
        o1, w1 = _values(o1, w1, v1, pb, VS, VZ, vrow + PAGE)
        o2, w2 = _values(o2, w2, v2, pb, VS, VZ, vrow + 2 * PAGE)
        o3, w3 = _values(o3, w3, v3, pb, VS, VZ, vrow + 3 * PAGE)
    # o_j * 2^(33 - 2j) + sum_s p z (2^-100 for the lift), l * 2^-100
    orow = gl.arange(0, C, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, R, layout=gl.SliceLayout(0, mma))
    out = OUT + ((pid * NSPLIT + split) * R + ocol)[None, :] * D + orow[:, None]
    if VALS_V1:
        o0, o1, o2, o3 = (o0 * 7.888609052210118e-31, o1 * 7.888609052210118e-31, o2 * 7.888609052210118e-31,
                          o3 * 7.888609052210118e-31)
    else:
        o0, o1, o2, o3 = o0 * 8589934592.0, o1 * 2147483648.0, o2 * 536870912.0, o3 * 134217728.0
    gl.store(out, o0 + _share(w0, ocol))
    gl.store(out + C, o1 + _share(w1, ocol))
    gl.store(out + 2 * C, o2 + _share(w2, ocol))
    gl.store(out + 3 * C, o3 + _share(w3, ocol))
    gl.store(MAX + (pid * NSPLIT + split) * R + ocol, m_i)
    gl.store(SUM + (pid * NSPLIT + split) * R + ocol, gl.sum(l_t, axis=0) * 7.888609052210118e-31)


@gluon.jit
def _bcast(KZ, at, kc_, zt):
    """A group's zeros of one chunk broadcast over the tile's rows (A operand)."""
    z, _ = gl.broadcast(gl.load(KZ + at + kc_)[None, :], zt)
    return z


@gluon.jit
def _values(acc, w, codes, pb, VS, VZ, vrow):
    """``acc += codes . (p * scale)^T`` (codes at ``2^-133 * 4^j``), ``w += p * zero`` (per thread)."""
    scale = gl.load(VS + vrow).to(gl.float32)
    zero = gl.load(VZ + vrow).to(gl.float32)
    acc = mma_v2(codes, (pb * scale[:, None]).to(gl.bfloat16), acc)
    return acc, w + pb * zero[:, None]


@gluon.jit
def _share(w, like):
    """``sum_s p_s zero_s`` of the per-thread partials, in the output's column layout, with the lift removed."""
    return gl.convert_layout(gl.sum(w, axis=0), gl.SliceLayout(0, gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])))[None, :] * 7.888609052210118e-31


SIG = {"Q": "*bf16", "KC": "*u8", "KS": "*bf16", "KZ": "*bf16", "VT": "*u8", "VS": "*bf16", "VZ": "*bf16",
       "INDEX": "*i32", "OUT": "*fp32", "MAX": "*fp32", "SUM": "*fp32"}


def registers(cubin: bytes) -> int:
    """Registers a thread, from cuobjdump's resource usage of the cubin."""
    path = Path("/tmp/kivi_gluon_v2.cubin")
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    out = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1))


def compile_only(lazy: bool) -> None:
    sig = {**SIG, "groups_per_split": "i32", "n_groups": "i32", "stride_ib": "i32", "stride_ih": "i32",
           "qk_scale": "fp32",
           **{k: "constexpr"
              for k in ("KV_HEADS", "GQA", "PAGE", "NSPLIT", "LAZY", "KEYS_V1", "VALS_V1", *_asm())}}
    consts = {"KV_HEADS": KV_HEADS, "GQA": GQA, "PAGE": PAGE, "NSPLIT": 33, "LAZY": lazy, "KEYS_V1": False,
              "VALS_V1": False, **_asm()}
    src = GluonASTSource(_decode2, sig, consts, {(i,): [["tt.divisibility", 16]] for i in range(len(SIG))})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 1})
    mix = loop_mix(k.asm["cubin"])
    print(f"lazy={lazy}: loop {sum(mix.values())} instructions a group (one warp; the lazy rescale's branch "
          f"counted when taken), shared-memory ops {shared_ops(mix)}, registers {registers(k.asm['cubin'])};",
          ", ".join(f"{o}={n}" for o, n in mix.most_common(20)))


def launch(t: dict, splits: int, lazy: bool, keys_v1: bool = False, vals_v1: bool = False):
    batch = t["q"].shape[0]
    lists = batch * KV_HEADS
    per = -(-t["n_groups"] // splits)
    o = torch.empty(lists * splits * 8 * D, device="cuda")
    m = torch.empty(lists * splits * 8, device="cuda")
    l_ = torch.empty_like(m)
    _decode2[(lists, splits)](t["q"], t["kc"], t["ks"], t["kz"], t["vt"], t["vs_t"], t["vz_t"], t["index"], o, m, l_,
                              per, t["n_groups"], t["index"].stride(0), t["index"].stride(1),
                              D ** -0.5 * 1.4426950408889634, KV_HEADS=KV_HEADS, GQA=GQA, PAGE=PAGE, NSPLIT=splits,
                              LAZY=lazy, KEYS_V1=keys_v1, VALS_V1=vals_v1, **_asm(), num_warps=1)
    return o, m, l_


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        for lazy in (False, True):
            compile_only(lazy)
        return
    from bandwidth import time_graph
    from kivi_kernels import decode_bytes

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sets = inputs(1, 32768, 1)
    ref = reference(sets[0])
    for keys_v1, vals_v1 in ((False, False), (True, False), (False, True), (True, True)):
        got = combine(*launch(sets[0], 256, False, keys_v1, vals_v1), 1, 256)
        print(json.dumps({"diagnosis": True, "keys_v1": keys_v1, "vals_v1": vals_v1,
                          "max_err": (got - ref).abs().max().item()}), flush=True)
    for batch, context in ((1, 32768), (16, 32768), (1, 131072), (4, 131072)):
        sets = inputs(batch, context, 2)
        ref = reference(sets[0]) if batch * context <= 131072 * 4 else None
        for lazy in (False, True):
            for per_sm in (12, 16, 24):
                splits = max(1, min(sms * per_sm // (batch * KV_HEADS), context // 128))
                got = combine(*launch(sets[0], splits, lazy), batch, splits)
                err = (got - ref).abs().max().item() if ref is not None else None
                scale = ref.abs().max().item() if ref is not None else None
                us = time_graph([lambda t=t, n=splits, z=lazy: launch(t, n, z) for t in sets], 10) * 1e6
                print(json.dumps({"batch": batch, "context": context, "lazy": lazy, "per_sm": per_sm,
                                  "splits": splits, "us": us, "GBps": decode_bytes(batch, context, BITS) / us / 1e3,
                                  "max_err": err, "ref_absmax": scale}), flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
