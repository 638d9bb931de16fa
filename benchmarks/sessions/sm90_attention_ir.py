"""The decode attention kernel compiled for the H200 (sm_90) on a machine without a GPU: registers, shared memory,
layout conversions and global stores, with and without the logits' stores (H2O's decode update reads them).

    python benchmarks/sessions/sm90_attention_ir.py [--dump DIR]

Triton lowers and ``ptxas`` assembles without a device; only timing needs one. First use (2026-12-03, Triton 3.9
here, 3.6 on the H200 image; 32K x 16's launch: BLOCK_N 64, 4 warps, 3 stages, 5 splits): the logits' variant adds a
``#mma -> #blocked`` conversion of the [16, BLOCK_N] fp32 logits tile inside the slot loop (through shared memory,
a barrier a tile) and takes 234 registers a thread against 192; two programs an SM either way. 2026-12-04: the token
max reduced in the kernel (OmniKV's filter layers, ``max``) adds one conversion (4 against 3) and spills 440 bytes a
thread at 128-slot tiles (``DECODE_TOKEN_MAX_CONFIG``'s), none at 64; storing its raw tile instead and taking the max
after (tried, not kept) spilled as much (456) with the logits' 12 conversions: no register relief to gain.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from sparsecompile.kernels.paged_attention import _paged_attention_kernel as KERNEL  # noqa: E402

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "POS": "*i32", "INDEX": "*i32", "LENGTHS": "*i32",
            "QPOS": "*i64", "OUT": "*bf16", "MID_O": "*fp32", "MID_LSE": "*fp32", "LSE": "*fp32",
            "TOKEN_MAX": "*fp32", "LOGITS": "*fp32"}
SCALARS = {"scale": "fp32", "window": "i32", "num_queries": "i32", "span": "i32"}
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(variant: str, block_n: int, warps: int, stages: int, splits: int = 5):
    """The Llama-3.1-8B decode launch (8 KV heads, group 4, head_dim 128, page 16) for sm_90; ``variant``: plain,
    logits (H2O's) or max (OmniKV's filter layers: the token max reduced in the kernel)."""
    logits = variant == "logits"
    constants = dict(KV_HEADS=8, GROUP=4, PAGE=16, BLOCK=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=block_n,
                     NUM_SPLITS=splits, IEEE=False, WRITE_LSE=logits, WRITE_MAX=variant.startswith("max"),
                     WRITE_LOGITS=logits)
    signature = {**POINTERS, **{n: "i32" for n in KERNEL.arg_names if n.startswith("stride_")}, **SCALARS,
                 **{name: "constexpr" for name in constants}}
    source = ASTSource(KERNEL, signature, constexprs={(KERNEL.arg_names.index(n),): v for n, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def registers(cubin: bytes) -> str:
    """``REG/STACK`` of the kernel (registers a thread / bytes of spill stack a thread)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([os.path.join(NVIDIA_BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    line = next((line for line in out.splitlines() if "REG:" in line), "")
    fields = dict(f.split(":", 1) for f in line.split() if ":" in f)
    return f"{fields.get('REG', '?')}/{fields.get('STACK', '?')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", default=None, help="write each variant's TTGIR here")
    args = parser.parse_args()
    print("block_n warps stages variant reg/stack shared  convert_layout  st.global")
    for block_n, warps, stages in ((64, 4, 3), (128, 4, 3), (64, 4, 2), (32, 4, 3), (64, 2, 3)):
        for name in ("plain", "logits", "max"):
            compiled = compile_sm90(name, block_n, warps, stages)
            ttgir = compiled.asm["ttgir"]
            print(f"{block_n:7d} {warps:5d} {stages:6d} {name:7s} {registers(compiled.asm['cubin']):>9s} "
                  f"{compiled.metadata.shared:7d} {ttgir.count('convert_layout'):15d} "
                  f"{compiled.asm['ptx'].count('st.global'):10d}")
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, f"attention_{name}_{block_n}_{warps}_{stages}.ttgir"), "w") as f:
                    f.write(ttgir)


if __name__ == "__main__":
    main()
