"""Session experiment (#14, `vanilla` at 80 % of roofline): the decode step's projections as cuBLAS runs them against
what inductor's GEMM autotuning picks (Triton templates or cuBLAS), at the Llama-3.1-8B shapes and decode batch
sizes, each timed in a CUDA graph over enough weight copies to defeat the L2.

The 32K x 1 profile (``results/profile_vanilla_32k_b1.txt``) has the step's GEMMs at 4.0 of its 5.6 ms of GPU time:
the gate/up and down projections near 4 TB/s, the fused q/k/v (16.1 us a layer) and o (10.9 us, plus a split-K
reduce) at about 3.1 TB/s. If autotuning beats cuBLAS there, ``TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1`` for the decode
step is the next A/B (``next.sh gemv``).

    python benchmarks/sessions/gemv_ab.py > benchmarks/results/gemv_ab_h200.jsonl
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bandwidth import time_graph  # noqa: E402

HIDDEN = 4096
SHAPES = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (28672, HIDDEN), "down": (HIDDEN, 14336)}
BATCHES = (1, 4)  # decode rows; each (shape, batch) autotunes its own templates (tens of seconds)
L2_DEFEAT_BYTES = 256 << 20


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def main() -> None:
    import torch._inductor.config as inductor_config

    dtype = torch.bfloat16
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
        for m in BATCHES:
            xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(copies)]
            cublas = time_graph([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)])
            with inductor_config.patch(max_autotune_gemm=True, max_autotune_gemm_backends="TRITON,ATEN"):
                compiled = torch.compile(linear, dynamic=False, mode="max-autotune-no-cudagraphs")
                start = time.perf_counter()
                got = compiled(xs[0], weights[0])
                compile_s = time.perf_counter() - start
                torch.testing.assert_close(got, F.linear(xs[0], weights[0]), atol=2e-2, rtol=2e-2)
                tuned = time_graph([lambda x=x, w=w, f=compiled: f(x, w) for x, w in zip(xs, weights)])
            row = {"proj": name, "m": m, "n": n, "k": k, "cublas_us": cublas * 1e6, "autotuned_us": tuned * 1e6,
                   "cublas_GBps": nbytes / cublas / 1e9, "autotuned_GBps": nbytes / tuned / 1e9,
                   "speedup": cublas / tuned, "compile_s": round(compile_s, 1)}
            print(json.dumps(row), flush=True)
            torch._dynamo.reset()
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
