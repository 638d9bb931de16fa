"""Session probe (#20, 2026-12-04): can a KIVI decode kernel load its codes straight into the MMA's operand registers?

The Triton kernel's loop is latency-bound on shared-memory layout conversions and their barriers (ncu: L1 / shared
memory 74 % busy, 0.83 eligible warps a scheduler; ``results/kivi_kernel_variants_h200.md``): plain Triton picks the
layouts and stages every code tile through shared memory. Gluon (``triton.experimental.gluon``) lets a kernel name
its layouts. This compiles, offline for sm_90a, the key side of one chunk (32 slots x 32 channels, 2-bit codes,
``_code_asm``'s in-register dequantization, one ``mma_v2`` per 16 slots and 16 channels) with the codes loaded in
``DotOperandLayout(0, mma, k_width)`` and prints the loop's SASS instruction mix. Offline result (Triton 3.9): with
``k_width=8`` a warp's loop is 60 instructions, codes in 64-bit global loads, no shared memory and no barrier
(``k_width=4``: 69, ``2``: 82). Not run on the GPU; the GPU image has Triton 3.6, whose Gluon API may differ.

    KW=8 WARPS=2 python benchmarks/sessions/kivi_gluon_probe.py
"""

from __future__ import annotations

import os
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kivi_gluon_decode import loop_mix, shared_ops  # noqa: E402

from sparsecompile.kernels.kivi_triton import _code_asm  # noqa: E402


@gluon.jit
def probe(KC, KS, KZ, Q, OUT, n_groups, ASM: gl.constexpr, KW: gl.constexpr, WARPS: gl.constexpr):
    G: gl.constexpr = 32  # slots of a key group
    C: gl.constexpr = 32  # channels of a chunk
    B: gl.constexpr = 32  # bytes of a slot's codes (2 bits x 128 channels)
    R: gl.constexpr = 8  # query rows (GQA 4, padded to the MMA's 8 columns)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    slots = gl.arange(0, G, layout=gl.SliceLayout(1, a_l))
    chans = gl.arange(0, C, layout=gl.SliceLayout(0, a_l))
    qc = gl.arange(0, C, layout=gl.SliceLayout(1, b_l))
    qr = gl.arange(0, R, layout=gl.SliceLayout(0, b_l))
    q = gl.load(Q + qc[:, None] * R + qr[None, :])  # the query in the B-operand registers for the whole loop
    acc = gl.zeros([G, R], gl.float32, layout=mma)
    zeros = gl.zeros([G, C], gl.bfloat16, layout=a_l)
    for g in range(n_groups):
        kb = gl.load(KC + (g * G + slots)[:, None] * B + chans[None, :])  # bytes [G, C], in the A-operand layout
        ks = gl.load(KS + g * 128 + chans)[None, :] + zeros
        kz = gl.load(KZ + g * 128 + chans)[None, :] + zeros
        k = gl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r,r", [kb, ks, kz], dtype=gl.bfloat16, is_pure=True, pack=4)
        acc = mma_v2(k, q, acc)
    rows = gl.arange(0, G, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, R, layout=gl.SliceLayout(0, mma))
    gl.store(OUT + rows[:, None] * R + cols[None, :], acc)


def main() -> None:
    kw, warps = int(os.environ.get("KW", "8")), int(os.environ.get("WARPS", "2"))
    sig = {"KC": "*u8", "KS": "*bf16", "KZ": "*bf16", "Q": "*bf16", "OUT": "*fp32", "n_groups": "i32",
           "ASM": "constexpr", "KW": "constexpr", "WARPS": "constexpr"}
    src = GluonASTSource(probe, sig, {"ASM": _code_asm(2, 0, torch.bfloat16), "KW": kw, "WARPS": warps},
                         {(i,): [["tt.divisibility", 16]] for i in range(5)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
    mix = loop_mix(k.asm["cubin"])
    print(f"k_width={kw} warps={warps}: loop of {sum(mix.values())} instructions a warp;",
          ", ".join(f"{o}={n}" for o, n in mix.most_common(14)))
    print("shared-memory ops in the loop:", shared_ops(mix))

if __name__ == "__main__":
    main()
