"""#20 experiment: KIVI decode attention on the CUDA cores (no ``tl.dot``) against the package's kernel.

The package's ``kivi_decode_attention`` (``sparsecompile/kernels/kivi_attention.py``) reaches 9-18 % of the H200's
bandwidth: ncu put it on the shared-memory pipe, every dequantized tile converted through shared memory into the MMA
operand layout, for a product whose M is a GQA group of 4 query heads padded to 16 (``results/kivi_kernel_variants_
h200.md``). Two bit-plane rewrites that kept ``tl.dot`` were slower. This variant drops the MMA instead: per key
group, ``s[g, t] = sum_d (q[g, d] * kscale[d]) * code[t, d] + q[g] . kzero`` and ``acc[g, d] += sum_t p[g, t] *
v[t, d]`` as broadcast products reduced in registers, for exactly ``GROUP`` query rows (4 for Llama-3.1-8B), one key
group (one page slice) per tile, the residual the same way over bf16 rows; partials merged by the package's
``_combine_kernel``. Not in the package: if it wins on the H200 it replaces the quantized loop there.

    TRITON_INTERPRET=1 python benchmarks/sessions/kivi_fma.py --check    # CPU: equals the torch reference
    python benchmarks/sessions/kivi_fma.py --out DIR                       # H200: both kernels, 2 / 4 bits, 4 points

Rows (JSON lines, ``DIR/kivi_fma_h200.jsonl``): ``variant`` ("package" or "fma" with its launch config), ``bits``,
``batch``, ``context``, ``us``, ``GBps`` on the bytes a call must read (``kivi_kernels.decode_bytes``), ``max_err``
against the package's output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sparsecompile.kernels.kivi_attention import (  # noqa: E402
    _repeat,
    _unpack,
    kivi_decode_attention_reference,
    kivi_decode_attention_triton,
)
from sparsecompile.kernels.kivi_quant import storage_bits  # noqa: E402
from sparsecompile.kernels.paged_attention import _combine_kernel, _num_splits  # noqa: E402
from sparsecompile.kernels.tiles import natural_lse, softmax_step, visible  # noqa: E402


@triton.jit
def _kivi_fma_kernel(Q, KC, VC, KS, KZ, VS, VZ, POS, RK, RV, RROWS, INDEX, LENGTHS, QUANT, QPOS, MID_O, MID_LSE,
                     stride_qb, stride_qh, stride_ib, stride_ih, stride_lb, stride_lh, stride_pb,
                     stride_rr, stride_rh, stride_rs, scale, window,
                     KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr, G: tl.constexpr,
                     D: tl.constexpr, BITS: tl.constexpr, RING: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """One program: the GROUP query heads of one (sequence, kv_head), one query, over one split of its slots."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // KV_HEADS
    h = pid_bh % KV_HEADS
    PER_WORD: tl.constexpr = 32 // BITS
    W: tl.constexpr = D // PER_WORD
    VG: tl.constexpr = D // G
    rows = tl.arange(0, GROUP)
    qh = h * GROUP + rows
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + qh[:, None] * stride_qh + d[None, :]).to(tl.float32)  # [GROUP, D]
    qpos = tl.load(QPOS + b * stride_pb + rows * 0).to(tl.int64)  # [GROUP] (one query)
    qk_scale = tl.cast(scale, tl.float32)
    length = tl.load(LENGTHS + b * stride_lb + h * stride_lh)
    quant = tl.load(QUANT + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), G) * G
    lo = split * per_split
    hi = tl.minimum(length, lo + per_split)
    m_i = tl.full([GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, D], tl.float32)
    index = INDEX + b * stride_ib + h * stride_ih
    tok = tl.arange(0, G)
    w = tl.arange(0, W)
    vg = tl.arange(0, VG)
    qhi = tl.minimum(hi, quant)
    for start in range(lo, qhi, G):  # one key group a tile: its scales fold into the query
        page = tl.load(index + start // PAGE).to(tl.int64)
        slot = (page * KV_HEADS + h) * PAGE + start % PAGE + tok
        grp = (page * KV_HEADS + h) * (PAGE // G) + (start % PAGE) // G
        tm = start + tok < qhi
        kc = _unpack(tl.load(KC + slot[:, None] * W + w[None, :], mask=tm[:, None], other=0), G, W, PER_WORD, BITS)
        ks = tl.load(KS + grp * D + d).to(tl.float32)
        kz = tl.load(KZ + grp * D + d).to(tl.float32)
        bias = tl.sum(q * kz[None, :], 1)
        s = tl.sum((q * ks[None, :])[:, None, :] * kc[None, :, :], 2) + bias[:, None]  # [GROUP, G]
        kpos = tl.load(POS + slot, mask=tm, other=-1).to(tl.int64)
        s = tl.where(visible(kpos, qpos, window), s * qk_scale, float("-inf"))
        m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
        vc = _unpack(tl.load(VC + slot[:, None] * W + w[None, :], mask=tm[:, None], other=0), G, W, PER_WORD, BITS)
        vmeta = slot[:, None] * VG + vg[None, :]
        vs = _repeat(tl.load(VS + vmeta, mask=tm[:, None], other=0.0).to(tl.float32), G, VG, G)
        vz = _repeat(tl.load(VZ + vmeta, mask=tm[:, None], other=0.0).to(tl.float32), G, VG, G)
        v = vc * vs + vz  # [G, D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
    ring = tl.load(RROWS + b).to(tl.int64) * stride_rr + h * stride_rh
    for start in range(tl.maximum(lo, quant), hi, G):  # the full-precision residual, G slots a tile
        j = start + tok
        jm = j < hi
        ridx = j % RING
        k = tl.load(RK + ring + ridx[:, None] * stride_rs + d[None, :], mask=jm[:, None], other=0.0).to(tl.float32)
        v = tl.load(RV + ring + ridx[:, None] * stride_rs + d[None, :], mask=jm[:, None], other=0.0).to(tl.float32)
        page = tl.load(index + j // PAGE, mask=jm, other=0).to(tl.int64)
        kpos = tl.load(POS + (page * KV_HEADS + h) * PAGE + j % PAGE, mask=jm, other=-1).to(tl.int64)
        s = tl.sum(q[:, None, :] * k[None, :, :], 2) * qk_scale
        s = tl.where(jm[None, :] & visible(kpos, qpos, window), s, float("-inf"))
        m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    mid = (b * (KV_HEADS * GROUP) + qh) * NUM_SPLITS + split  # partials [batch, q_heads, 1, splits, (D)]
    tl.store(MID_LSE + mid, natural_lse(m_i, l_i))
    tl.store(MID_O + mid[:, None] * D + d[None, :], out)


def kivi_fma_attention(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows, index,
                       lengths, quantized, q_positions, scale, sliding_window, *, num_warps: int = 4,
                       target_programs: int = 1056) -> torch.Tensor:
    """The package op's semantics for one decode query (``queries == 1``, a power-of-two GQA group)."""
    batch, q_heads, queries, dim = query.shape
    heads, page_size = kcode.shape[1], kcode.shape[2]
    group_size = page_size // kscale.shape[2]
    group = q_heads // heads
    assert queries == 1 and group & (group - 1) == 0, "decode: one query, a power-of-two GQA group"
    query, index = query.contiguous(), index.contiguous()
    splits = _num_splits(batch * heads, index.shape[2] * page_size, 4 * group_size, target_programs)
    mid_o = torch.empty(batch, q_heads, 1, splits, dim, dtype=torch.float32, device=query.device)
    mid_lse = torch.empty(batch, q_heads, 1, splits, dtype=torch.float32, device=query.device)
    _kivi_fma_kernel[(batch * heads, splits)](
        query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows.contiguous(), index,
        lengths, quantized.contiguous(), q_positions.contiguous(), mid_o, mid_lse,
        query.stride(0), query.stride(1), index.stride(0), index.stride(1), lengths.stride(0), lengths.stride(1),
        q_positions.stride(0), ring_k.stride(0), ring_k.stride(1), ring_k.stride(2), float(scale),
        int(sliding_window), KV_HEADS=heads, GROUP=group, PAGE=page_size, G=group_size, D=dim,
        BITS=storage_bits(kcode, dim), RING=ring_k.shape[2], NUM_SPLITS=splits, num_warps=num_warps)
    out = torch.empty(batch, 1, q_heads, dim, dtype=query.dtype, device=query.device)
    _combine_kernel[(batch * q_heads,)](
        mid_o, mid_lse, out, out, out.stride(0), out.stride(1), out.stride(2), 1, Q_HEADS=q_heads, HEAD_DIM=dim,
        BLOCK_D=dim, NUM_SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)), WRITE_LSE=False)
    return out


def _toy_case(bits: int, dim: int = 32, grp: int = 16, device: str = "cpu") -> tuple:
    """Two sequences, 2 KV heads x 4 query heads, head_dim ``dim``, pages of 32, groups of ``grp``, a ring of 48:
    one list mostly quantized, one shorter."""
    g = torch.Generator().manual_seed(bits)
    heads, group_q, page, ring = 2, 4, 32, 48
    pages = 12
    codes = [torch.randint(-(2**31), 2**31 - 1, (pages, heads, page, dim * bits // 32), generator=g,
                           dtype=torch.int32) for _ in range(2)]
    kmeta = [torch.rand(pages, heads, page // grp, dim, generator=g).half() for _ in range(2)]
    vmeta = [torch.rand(pages, heads, page, dim // grp, generator=g).half() for _ in range(2)]
    pos = torch.arange(pages * page, dtype=torch.int32).view(pages, 1, page).expand(pages, heads, page).contiguous()
    index = torch.randperm(pages, generator=g)[:10].view(2, 1, 5).expand(2, heads, 5).to(torch.int32).contiguous()
    lengths = torch.tensor([[150, 150], [70, 70]], dtype=torch.int32)
    quantized = torch.tensor([112, 32])
    ring_k = torch.randn(2, heads, ring, dim, generator=g).bfloat16()
    ring_v = torch.randn(2, heads, ring, dim, generator=g).bfloat16()
    query = torch.randn(2, heads * group_q, 1, dim, generator=g).bfloat16()
    q_positions = torch.tensor([[10**6], [10**6]])  # (check() sets them per case)
    args = (query, *codes, *kmeta, *vmeta, pos, ring_k, ring_v, torch.arange(2), index, lengths, quantized,
            q_positions, dim ** -0.5)
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in args)


def check() -> int:
    """Interpreter (CPU): the variant equals the torch reference at toy sizes and at Llama-3.1-8B's head (128) and
    group (32), 2 and 4 bits, with and without a sliding window; fp32 tightly, bf16 to an ulp of the output."""
    shapes = ((32, 16, 0, torch.float32), (32, 16, 100, torch.float32), (32, 16, 0, torch.bfloat16),
              (32, 16, 100, torch.bfloat16), (128, 32, 0, torch.bfloat16))
    for bits in (2, 4):
        for dim, grp, window, dtype in shapes:  # window 100: over part of the lists; 0: every slot visible
            newest, tol = (200 if window else 10**6), (1e-5 if dtype == torch.float32 else 1e-2)
            case = list(_toy_case(bits, dim, grp))
            case[0], case[-2] = case[0].to(dtype), torch.full_like(case[-2], newest)
            want = kivi_decode_attention_reference(*case, window).float()
            got = kivi_fma_attention(*case, window).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            print(f"bits {bits} head_dim {dim} group {grp} window {window} {dtype}: max |err| / max |out| {err:.2e}")
            assert want.abs().max() > 0 and err < tol, err
    return 0


def bench(out_dir: str) -> int:
    """H200: the package kernel and the variant's launch configs at the kivi_kernels.py points."""
    from bandwidth import measure_read_bandwidth, time_graph
    from kivi_kernels import decode_bytes, decode_inputs

    bandwidth = measure_read_bandwidth()["best_GBps"]
    path = os.path.join(out_dir, "kivi_fma_h200.jsonl")
    with open(path, "w") as handle:
        handle.write(json.dumps({"bandwidth_GBps": bandwidth}) + "\n")
        for bits in (2, 4):
            for batch, context in ((1, 32768), (16, 32768), (1, 131072), (4, 131072)):
                sets = decode_inputs(batch, context, bits, copies=3)
                gb = decode_bytes(batch, context, bits) / 1e9
                base = kivi_decode_attention_triton(*sets[0])
                variants = [("package", None)] + [("fma", {"num_warps": w, "target_programs": t})
                                                  for w in (2, 4, 8) for t in (264, 1056, 2112)]
                for name, cfg in variants:
                    try:
                        if cfg is None:
                            fns = [lambda s=s: kivi_decode_attention_triton(*s) for s in sets]
                            err = 0.0
                        else:
                            fns = [lambda s=s, c=cfg: kivi_fma_attention(*s, **c) for s in sets]
                            err = (kivi_fma_attention(*sets[0], **cfg).float() - base.float()).abs().max().item()
                        seconds = time_graph(fns)
                        row = {"variant": name, "config": cfg, "bits": bits, "batch": batch, "context": context,
                               "us": seconds * 1e6, "GBps": gb / seconds, "pct_of_bw": 100 * gb / seconds / bandwidth,
                               "max_err": err}
                    except Exception as exc:  # one failing config (registers, shared memory) must not end the sweep
                        row = {"variant": name, "config": cfg, "bits": bits, "batch": batch, "context": context,
                               "error": f"{type(exc).__name__}: {exc}"[:300]}
                    print(json.dumps(row), flush=True)
                    handle.write(json.dumps(row) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="CPU interpreter: compare with the torch reference")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    return check() if args.check else bench(args.out)


if __name__ == "__main__":
    sys.exit(main())
