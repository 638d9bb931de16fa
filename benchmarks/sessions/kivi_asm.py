"""Dev tool: compile a KIVI decode kernel for sm_90 on a CPU machine at its real launch signature and count what the
loop does through shared memory (TTGIR ``local_alloc`` / ``local_store`` / ``local_load``, ``convert_layout``,
``warp_group_dot`` / ``mma``), plus registers and shared memory of the cubin.

    python benchmarks/sessions/kivi_asm.py [--kernel module:function] [--dump DIR] [--const NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# The package kernel's launch at 128K x 4 (Llama-3.1-8B attention, 2-bit, group 32, pages of 32, residual 128).
CONSTS = {"KV_HEADS": 8, "GROUP": 4, "PAGE": 32, "G": 32, "D": 128, "BITS": 2, "RING": 128, "BLOCK_M": 16,
          "BLOCK_F": 32, "NG": 4, "NUM_SPLITS": 33, "IEEE": False}
PTR_DTYPES = {"Q": "bf16", "KC": "i32", "VC": "i32", "KS": "fp16", "KZ": "fp16", "VS": "fp16", "VZ": "fp16",
              "POS": "i32", "RK": "bf16", "RV": "bf16", "RROWS": "i64", "INDEX": "i32", "LENGTHS": "i32",
              "QUANT": "i64", "QPOS": "i64", "OUT": "bf16", "MID_O": "fp32", "MID_LSE": "fp32", "QS": "bf16"}
FLOATS = {"scale"}
OPS = ("ttg.local_alloc", "ttg.local_store", "ttg.local_load", "ttg.convert_layout", "ttng.warp_group_dot",
       "tt.dot", "ttg.memdesc_trans", "tt.reshape", "tt.trans", "tt.load")


def compile_kernel(fn, consts: dict, num_warps: int, num_stages: int):
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in consts:
            signature[name], constexprs[name] = "constexpr", consts[name]
        elif name in PTR_DTYPES:
            signature[name] = "*" + PTR_DTYPES[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                         "num_stages": num_stages})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", default="sparsecompile.kernels.kivi_triton:_kivi_decode_kernel")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--const", action="append", default=[])
    p.add_argument("--dump")
    args = p.parse_args()
    module, name = args.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    consts = {k: v for k, v in CONSTS.items() if k in inspect.signature(fn.fn).parameters}
    for c in args.const:
        k, v = c.split("=")
        consts[k] = {"True": True, "False": False}.get(v, v if not v.lstrip("-").isdigit() else int(v))
    k = compile_kernel(fn, consts, args.warps, args.stages)
    ttgir = k.asm["ttgir"]
    counts = {op: len(re.findall(re.escape(op) + r"\b", ttgir)) for op in OPS}
    meta = k.metadata
    print(f"{name} {consts} warps={args.warps} stages={args.stages}")
    print(f"  registers={getattr(k, 'n_regs', '?')} shared={meta.shared} spills={getattr(k, 'n_spills', '?')}")
    print("  " + " ".join(f"{op.split('.')[-1]}={n}" for op, n in counts.items()))
    ptx = k.asm["ptx"]
    print("  ptx: ld.shared={} st.shared={} ld.global={} wgmma={} mma.sync={} ldmatrix={} stmatrix={} shfl={}".format(
        *(len(re.findall(pat, ptx)) for pat in (r"ld\.shared", r"st\.shared", r"ld\.global", r"wgmma\.mma_async",
                                                r"mma\.sync", r"ldmatrix", r"stmatrix", r"shfl\.sync"))))
    if args.dump:
        out = Path(args.dump)
        out.mkdir(parents=True, exist_ok=True)
        for key in ("ttgir", "ptx"):
            (out / f"{name}.{key}").write_text(k.asm[key])


if __name__ == "__main__":
    main()
