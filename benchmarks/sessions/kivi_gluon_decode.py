"""Session probe (#20, 2026-12-04; written offline, not run on a GPU yet): the quantized part of KIVI decode
attention in Gluon, every operand in a layout the kernel names, so no code tile goes through shared memory.

Why: the Triton kernel (``sparsecompile/kernels/kivi_triton.py``) is latency-bound on the shared-memory layout
conversions plain Triton inserts (ncu: L1 / shared memory 74 % busy, 0.83 eligible warps a scheduler; 18-29 % of
the bandwidth at 2 bits). Here, one warp a program (no cross-warp reduction or barrier):

* keys: a group's 32 slots x 32 bytes loaded once, straight into the MMA's A-operand registers
  (``DotOperandLayout(0, mma, k_width=8)``: 64-bit loads), dequantized there per channel chunk (``_code_asm``, the
  package kernel's PTX), ``s^T [slots, rows] += K_i . q_i^T`` with the query held in B-operand registers;
* values: stored transposed per group (``[B bytes, G slots]``; their scales and zeros ``[D / G, P]`` per page: layouts
  this probe builds from the pool's, which the pool would have to store) so that the A operand ``V_i^T [channels,
  slots]`` loads 8 consecutive slots a thread; their exact codes enter the MMA, the slots' scales multiply the
  probabilities in the B-operand registers (one layout conversion of ``p`` a group, not one a chunk) and the zeros'
  share is a reduction of ``p`` over slots.

Compared with a torch reference (fp32) and timed against the package kernel at the four decode points (2 bits,
Llama-3.1-8B attention, group 32, pages 32; every slot quantized, no residual or masking). Offline (Triton 3.9,
sm_90a): ``--compile-only`` prints the loop's instruction mix.

    python benchmarks/sessions/kivi_gluon_decode.py [--compile-only]
"""

from __future__ import annotations

import argparse
import collections
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparsecompile.kernels.kivi_triton import _code_asm  # noqa: E402

KV_HEADS, GQA, D, G, PAGE, BITS = 8, 4, 128, 32, 32, 2
NB = D * BITS // 8  # bytes a slot


@gluon.jit
def _decode(Q, KC, KS, KZ, VT, VS, VZ, INDEX, OUT, MAX, SUM, groups_per_split, n_groups, stride_ib, stride_ih, qk_scale,
            KV_HEADS: gl.constexpr, GQA: gl.constexpr, PAGE: gl.constexpr, NSPLIT: gl.constexpr,
            K0: gl.constexpr, K1: gl.constexpr, K2: gl.constexpr, K3: gl.constexpr,
            V0: gl.constexpr, V1: gl.constexpr, V2: gl.constexpr, V3: gl.constexpr):
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
    # the query, q^T [C, R] per chunk, in the B-operand registers for the whole loop (base-2 logits)
    qr = gl.arange(0, R, layout=gl.SliceLayout(0, b_l))
    qc = gl.arange(0, C, layout=gl.SliceLayout(1, b_l))
    qp = Q + (b * (KV_HEADS * GQA) + h * GQA + qr)[None, :] * D + qc[:, None]
    qok = (qr < GQA)[None, :]
    q0 = (gl.load(qp, mask=qok, other=0.0).to(gl.float32) * qk_scale).to(gl.bfloat16)
    q1 = (gl.load(qp + C, mask=qok, other=0.0).to(gl.float32) * qk_scale).to(gl.bfloat16)
    q2 = (gl.load(qp + 2 * C, mask=qok, other=0.0).to(gl.float32) * qk_scale).to(gl.bfloat16)
    q3 = (gl.load(qp + 3 * C, mask=qok, other=0.0).to(gl.float32) * qk_scale).to(gl.bfloat16)
    ks_ = gl.arange(0, G, layout=gl.SliceLayout(1, a_l))  # key tile rows: slots
    kc_ = gl.arange(0, C, layout=gl.SliceLayout(0, a_l))  # key tile columns: channels of a chunk
    vc_ = gl.arange(0, C, layout=gl.SliceLayout(1, a_l))  # value tile rows: byte positions (channels of a chunk)
    vs_ = gl.arange(0, G, layout=gl.SliceLayout(0, a_l))  # value tile columns: slots
    ps_ = gl.arange(0, G, layout=gl.SliceLayout(1, b_l))  # p^T rows: slots
    m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_i = gl.zeros([R], gl.float32, layout=gl.SliceLayout(0, mma))
    o0 = gl.zeros([C, R], gl.float32, layout=mma)
    o1 = gl.zeros([C, R], gl.float32, layout=mma)
    o2 = gl.zeros([C, R], gl.float32, layout=mma)
    o3 = gl.zeros([C, R], gl.float32, layout=mma)
    first = split * groups_per_split
    last = gl.minimum(first + groups_per_split, n_groups)
    for grp in range(first, last):
        page = gl.load(INDEX + b * stride_ib + h * stride_ih + grp * G // PAGE).to(gl.int64)
        gidx = (page * KV_HEADS + h) * (PAGE // G) + (grp * G % PAGE) // G  # the key group / value group block
        slot0 = gl.multiple_of((page * KV_HEADS + h) * PAGE + grp * G % PAGE, G)
        kb = gl.load(KC + (slot0 + ks_)[:, None] * B + kc_[None, :])  # [G, C] bytes: every chunk's codes
        zero = gl.zeros([G, C], gl.bfloat16, layout=a_l)
        s = gl.zeros([G, R], gl.float32, layout=mma)
        kat = gl.multiple_of(gidx * D, D)
        s = mma_v2(_keys(kb, KS, KZ, kat, kc_, zero, K0), q0, s)
        s = mma_v2(_keys(kb, KS, KZ, kat + C, kc_, zero, K1), q1, s)
        s = mma_v2(_keys(kb, KS, KZ, kat + 2 * C, kc_, zero, K2), q2, s)
        s = mma_v2(_keys(kb, KS, KZ, kat + 3 * C, kc_, zero, K3), q3, s)
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        pb = gl.convert_layout(p, b_l)  # p^T [G, R] as the B operand (fp32; rounded with each chunk's scale)
        vb = gl.load(VT + gidx * (B * G) + vc_[:, None] * G + vs_[None, :])  # [C, G] bytes, slots contiguous
        vrow = gl.multiple_of((page * KV_HEADS + h) * (D // G) * PAGE + grp * G % PAGE, G) + ps_
        a = alpha[None, :]
        o0 = _values(o0 * a, vb, pb, VS, VZ, vrow, V0)
        o1 = _values(o1 * a, vb, pb, VS, VZ, vrow + PAGE, V1)
        o2 = _values(o2 * a, vb, pb, VS, VZ, vrow + 2 * PAGE, V2)
        o3 = _values(o3 * a, vb, pb, VS, VZ, vrow + 3 * PAGE, V3)
    orow = gl.arange(0, C, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, R, layout=gl.SliceLayout(0, mma))
    out = OUT + ((pid * NSPLIT + split) * R + ocol)[None, :] * D + orow[:, None]
    gl.store(out, o0)
    gl.store(out + C, o1)
    gl.store(out + 2 * C, o2)
    gl.store(out + 3 * C, o3)
    mr = gl.arange(0, R, layout=gl.SliceLayout(0, mma))
    gl.store(MAX + (pid * NSPLIT + split) * R + mr, m_i)
    gl.store(SUM + (pid * NSPLIT + split) * R + mr, l_i)


@gluon.jit
def _keys(kb, KS, KZ, at, kc_, zero, ASM: gl.constexpr):
    """One chunk's keys ``[G, C]`` dequantized in the A-operand registers (the group's per-channel scale / zero)."""
    ks, _ = gl.broadcast(gl.load(KS + at + kc_)[None, :], zero)
    kz, _ = gl.broadcast(gl.load(KZ + at + kc_)[None, :], zero)
    return gl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r,r", [kb, ks, kz], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def _values(acc, vb, pb, VS, VZ, vrow, ASM: gl.constexpr):
    """``acc += codes . (p * scale)^T + (sum_s zero[s] p[s])`` for one value chunk (its group's per-slot scale and
    zero at ``vrow``)."""
    codes = gl.inline_asm_elementwise(ASM, "=r,=r,r", [vb], dtype=gl.bfloat16, is_pure=True, pack=4)
    scale = gl.load(VS + vrow).to(gl.float32)
    zero = gl.load(VZ + vrow).to(gl.float32)
    acc = mma_v2(codes, (pb * scale[:, None]).to(gl.bfloat16), acc)
    share = gl.convert_layout(gl.sum(pb * zero[:, None], axis=0), gl.SliceLayout(0, acc.type.layout))
    return acc + share[None, :]


def _asm() -> dict:
    shifts = [(i * 32 // NB) * BITS for i in range(4)]
    return {**{f"K{i}": _code_asm(BITS, sh, torch.bfloat16) for i, sh in enumerate(shifts)},
            **{f"V{i}": _code_asm(BITS, sh, torch.bfloat16, scaled=False) for i, sh in enumerate(shifts)}}


def loop_mix(cubin: bytes) -> collections.Counter:
    """The instruction mix of a kernel's loop (from a backward branch's target to the branch) in sm_90a SASS."""
    path = Path("/tmp/kivi_gluon.cubin")
    path.write_bytes(cubin)
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    ins, labels = [], {}
    for line in subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True).stdout.splitlines():
        if m := re.match(r"(\.L_x_\d+):", line.strip()):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?(\S+)(.*?);", line):
            ins.append((m.group(1).split(".")[0], m.group(2)))
    for i, (op, rest) in enumerate(ins):
        target = re.search(r"(\.L_x_\d+)", rest)
        if op == "BRA" and target and labels.get(target.group(1), i) < i:
            return collections.Counter(o for o, _ in ins[labels[target.group(1)]:i + 1])
    return collections.Counter()


def shared_ops(mix: collections.Counter) -> int:
    return sum(n for o, n in mix.items() if o.startswith(("LDS", "STS", "BAR", "LDSM", "STSM")))


def compile_only() -> None:
    """sm_90a SASS of the kernel on a machine without a GPU: the loop's instruction mix."""
    ptrs = {"Q": "*bf16", "KC": "*u8", "KS": "*bf16", "KZ": "*bf16", "VT": "*u8", "VS": "*bf16", "VZ": "*bf16",
            "INDEX": "*i32", "OUT": "*fp32", "MAX": "*fp32", "SUM": "*fp32"}
    sig = {**ptrs, "groups_per_split": "i32", "n_groups": "i32", "stride_ib": "i32", "stride_ih": "i32",
           "qk_scale": "fp32", **{k: "constexpr" for k in ("KV_HEADS", "GQA", "PAGE", "NSPLIT", *_asm())}}
    consts = {"KV_HEADS": KV_HEADS, "GQA": GQA, "PAGE": PAGE, "NSPLIT": 33, **_asm()}
    src = GluonASTSource(_decode, sig, consts, {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 1})
    mix = loop_mix(k.asm["cubin"])
    print(f"loop: {sum(mix.values())} instructions a group (one warp), shared-memory ops {shared_ops(mix)};",
          ", ".join(f"{o}={n}" for o, n in mix.most_common(18)))


def inputs(batch: int, context: int, copies: int) -> list[dict]:
    """Random pages in the pool's layout (codes, bf16 scales), the values' codes also transposed per group."""
    n_groups, per_seq = context // G, context // PAGE
    sets = []
    for _ in range(copies):
        pages = batch * per_seq
        kc = torch.randint(0, 256, (pages, KV_HEADS, PAGE, NB), dtype=torch.uint8, device="cuda")
        vc = torch.randint(0, 256, (pages, KV_HEADS, PAGE, NB), dtype=torch.uint8, device="cuda")
        vt = vc.view(pages, KV_HEADS, PAGE // G, G, NB).transpose(-1, -2).contiguous()  # [.., B, G] per group
        ks = (torch.rand(pages, KV_HEADS, PAGE // G, D, device="cuda") * 0.5).bfloat16()
        kz = (torch.randn(pages, KV_HEADS, PAGE // G, D, device="cuda")).bfloat16()
        vs = (torch.rand(pages, KV_HEADS, PAGE, D // G, device="cuda") * 0.5).bfloat16()
        vz = torch.randn(pages, KV_HEADS, PAGE, D // G, device="cuda").bfloat16()
        vs_t, vz_t = (x.transpose(-1, -2).contiguous() for x in (vs, vz))  # [.., D / G, P]: a group's slots together
        index = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, 1, per_seq)
        index = index.expand(batch, KV_HEADS, per_seq).contiguous()
        q = torch.randn(batch, KV_HEADS * GQA, D, device="cuda").bfloat16()
        sets.append(dict(q=q, kc=kc, ks=ks, kz=kz, vc=vc, vt=vt, vs=vs, vz=vz, vs_t=vs_t, vz_t=vz_t, index=index,
                         n_groups=n_groups))
    return sets


def launch(t: dict, splits: int):
    batch = t["q"].shape[0]
    lists = batch * KV_HEADS
    per = -(-t["n_groups"] // splits)
    o = torch.empty(lists * splits * 8 * D, device="cuda")
    m = torch.empty(lists * splits * 8, device="cuda")
    l_ = torch.empty_like(m)
    _decode[(lists, splits)](t["q"], t["kc"], t["ks"], t["kz"], t["vt"], t["vs_t"], t["vz_t"], t["index"], o, m, l_,
                             per, t["n_groups"], t["index"].stride(0), t["index"].stride(1),
                             D ** -0.5 * 1.4426950408889634, KV_HEADS=KV_HEADS, GQA=GQA, PAGE=PAGE, NSPLIT=splits,
                             **_asm(), num_warps=1)
    return o, m, l_


def combine(o, m, l_, batch: int, splits: int) -> torch.Tensor:
    o = o.view(batch, KV_HEADS, splits, 8, D)[:, :, :, :GQA]
    m = m.view(batch, KV_HEADS, splits, 8)[:, :, :, :GQA]
    l_ = l_.view(batch, KV_HEADS, splits, 8)[:, :, :, :GQA]
    w = torch.exp2(m - m.amax(2, keepdim=True))
    out = (o * w[..., None]).sum(2) / (l_ * w).sum(2)[..., None]
    return out.reshape(batch, KV_HEADS * GQA, D)


def reference(t: dict) -> torch.Tensor:
    """fp32 attention over the dequantized pages (the formulas of ``kivi_quant``)."""
    batch = t["q"].shape[0]
    shifts = torch.arange(8 // BITS, device="cuda") * BITS

    def unpack(c):  # [.., NB] bytes -> [.., D] codes, channel j * NB + byte at plane j
        return ((c[..., None, :].long() >> shifts[:, None]) & ((1 << BITS) - 1)).flatten(-2).float()

    out = []
    for bi in range(batch):
        pages = t["index"][bi, 0].long()
        k = unpack(t["kc"][pages]) * t["ks"][pages].float().repeat_interleave(G, 2) \
            + t["kz"][pages].float().repeat_interleave(G, 2)  # [n, H, P, D]
        v = unpack(t["vc"][pages]) * t["vs"][pages].float().repeat_interleave(G, -1) \
            + t["vz"][pages].float().repeat_interleave(G, -1)
        k = k.transpose(0, 1).reshape(KV_HEADS, -1, D)
        v = v.transpose(0, 1).reshape(KV_HEADS, -1, D)
        q = t["q"][bi].float().view(KV_HEADS, GQA, D)
        p = torch.softmax(q @ k.transpose(1, 2) * D ** -0.5, -1)
        out.append((p @ v).reshape(KV_HEADS * GQA, D))
    return torch.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return
    from bandwidth import time_graph
    from kivi_kernels import decode_bytes, decode_inputs

    from sparsecompile.kernels.kivi_attention import kivi_decode_attention_triton  # the package kernel, for timing

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, context in ((1, 32768), (16, 32768), (1, 131072), (4, 131072)):
        sets = inputs(batch, context, 2)
        splits = max(1, min(sms * 12 // (batch * KV_HEADS), context // 128))  # 1-warp programs, 165 registers: 12 an SM
        got = combine(*launch(sets[0], splits), batch, splits)
        err = (got - reference(sets[0])).abs().max().item() if context <= 32768 and batch == 1 else None
        us = time_graph([lambda t=t, n=splits: launch(t, n) for t in sets], 10) * 1e6
        del sets
        pkg = decode_inputs(batch, context, BITS, 2)
        pkg_us = time_graph([lambda a=a: kivi_decode_attention_triton(*a) for a in pkg], 10) * 1e6
        del pkg
        torch.cuda.empty_cache()
        print(json.dumps({"batch": batch, "context": context, "splits": splits, "gluon_us": us, "package_us": pkg_us,
                          "GBps": decode_bytes(batch, context, BITS) / us / 1e3, "max_err_vs_fp32": err}),
              flush=True)


if __name__ == "__main__":
    main()
