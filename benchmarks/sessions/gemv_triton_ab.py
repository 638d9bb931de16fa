"""Session experiment (#20's decode targets; #14's `vanilla` roofline): can a plain Triton GEMV beat cuBLAS on the
decode step's projections at 1-16 rows?

The 128K x 4 `kivi2` step spends 3.96 ms in GEMMs against 3.37 ms of weight reads at the measured bandwidth; at 4 rows
cuBLAS reads q/k/v at 71 %, o at 59 % and down at 81 % of 4.44 TB/s (`gemv_ab_h200.jsonl`), gate/up at 91 %. The
kernel here streams ``W [N, K]`` once: each program owns ``BLOCK_N`` rows of ``W`` and ``K / SPLIT_K`` of its
columns, multiplies them with the (at most 16, zero-padded) rows of ``x`` by ``tl.dot`` and either stores (one
split) or adds into an fp32 buffer (atomics; then a cast). Every config is timed in one CUDA graph over enough
weight copies to defeat the L2, as `gemv_ab.py` times cuBLAS, which is timed again here in the same process.

    python benchmarks/sessions/gemv_triton_ab.py > benchmarks/results/gemv_triton_ab_h200.jsonl

Run once, on an H100 (2026-12-05, twenty-third session, ``results/gemv_triton_ab_h100.jsonl``; its percentages
assumed the H200's bandwidth and were dropped, GB/s kept): the best of 54 configs against cuBLAS at 4 rows, q/k/v
1.022x, o 1.116x, gate/up 0.991x, down 1.018x, lm_head 1.060x (0.99-1.12x at 1, 8 and 16 rows). 2.9 us a layer
where it wins and 20 us of lm_head, ~1 % of a decode step: not worth an op and a graph pass. The short
projections stay slow for both (q/k/v 2.5 TB/s, o 2.4 TB/s with the Triton kernel, of the H100's nominal 3.35):
too short a read to reach full bandwidth.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bandwidth import measure_read_bandwidth, time_graph  # noqa: E402

HIDDEN = 4096
SHAPES = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (28672, HIDDEN), "down": (HIDDEN, 14336),
          "lm_head": (128256, HIDDEN)}
L2_DEFEAT_BYTES = 256 << 20


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    span = K // SPLIT_K
    start = pid_k * span
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(start, start + span, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :])
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=offs_m[:, None] < M,
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=offs_m[:, None] < M)
    else:
        tl.atomic_add(ptrs, acc, mask=offs_m[:, None] < M, sem="relaxed")


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, split_k: int, stages: int,
         warps: int) -> torch.Tensor:
    """``x [M, K] @ w[N, K]^T`` for ``M <= 16`` (``K`` a multiple of ``split_k * block_k``, ``N`` of ``block_n``)."""
    M, K = x.shape
    N = w.shape[0]
    if split_k == 1:
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    else:
        y = torch.zeros(M, N, device=x.device, dtype=torch.float32)
    _gemv_kernel[(N // block_n, split_k)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=16,
                                          BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, STAGES=stages,
                                          num_warps=warps)
    return y if split_k == 1 else y.to(x.dtype)


CONFIGS = [dict(block_n=bn, block_k=bk, split_k=sk, stages=st, warps=wp)
           for bn, bk, sk, st, wp in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4), (3, 5), (4,))]


def main() -> None:
    dtype = torch.bfloat16
    torch.manual_seed(0)
    bandwidth = measure_read_bandwidth()["best_GBps"] * 1e9  # B/s, this device's
    device = torch.cuda.get_device_name()
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
        for m in (1, 4, 8, 16):
            xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(copies)]
            ref = F.linear(xs[0], weights[0])
            cublas = time_graph([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)])
            best = None
            for cfg in CONFIGS:
                if k % (cfg["split_k"] * cfg["block_k"]) or n % cfg["block_n"]:
                    continue
                if n // cfg["block_n"] * cfg["split_k"] < 64:  # too few programs for 132 SMs
                    continue
                try:
                    got = gemv(xs[0], weights[0], **cfg)
                    err = (got.float() - ref.float()).abs().max().item()
                    t = time_graph([lambda x=x, w=w, c=cfg: gemv(x, w, **c) for x, w in zip(xs, weights)])
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped, reported
                    print(json.dumps({"proj": name, "m": m, "cfg": cfg, "error": str(exc)[:200]}), flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            t, cfg, err = best
            print(json.dumps({"proj": name, "m": m, "n": n, "k": k, "cublas_us": round(cublas * 1e6, 2),
                              "triton_us": round(t * 1e6, 2), "speedup": round(cublas / t, 3),
                              "cublas_pct_bw": round(100 * nbytes / cublas / bandwidth, 1),
                              "triton_pct_bw": round(100 * nbytes / t / bandwidth, 1), "cfg": cfg,
                              "max_abs_err": err, "device": device}), flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
