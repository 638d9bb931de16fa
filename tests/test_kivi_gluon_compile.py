"""The Gluon KIVI decode kernel (``kernels/kivi_gluon.py``) compiled for the H200 (sm_90a) on a machine without a
GPU, with the installed Triton: its layouts, inline PTX and async copies are checked by the compiler, not by a run
(Gluon has no interpreter; its numerics are tested in ``tests/gpu/test_kivi_cuda.py``). This catches a Triton
release that renames or changes the experimental Gluon API the kernel uses, a change that makes it spill, and a bf16
constant flushed to zero. The compile runs in a child process: this suite sets ``TRITON_INTERPRET=1``, under which
Triton's own jit helpers are interpreter objects a compile cannot reference."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sparsecompile.kernels import kivi_gluon
from sparsecompile.kernels.tiles import FP_FUSION

if kivi_gluon.gluon is None:
    pytest.skip("a Triton without Gluon", allow_module_level=True)

POINTERS = {"Q": "*bf16", "KC": "*u8", "KS": "*bf16", "KZ": "*bf16", "VC": "*u8", "VS": "*bf16", "VZ": "*bf16",
            "POS": "*i32", "RK": "*bf16", "RV": "*bf16", "RROWS": "*i64", "INDEX": "*i32", "LENGTHS": "*i32",
            "QUANT": "*i64", "QPOS": "*i64", "MID_O": "*fp32", "MID_LSE": "*fp32", "LOGITS": "*fp32"}


def compile_usage(bits: int, with_logits: bool, half: bool = False, all_visible: bool = False) -> dict:
    """Compile at the Llama-3.1-8B shape (8 KV heads, GQA 4, 33 splits) with the launch's constexprs
    (:func:`.kivi_gluon.launch_constants`; every other argument by its kind); the cubin's registers and stack bytes
    (``{}`` without Triton's bundled cuobjdump). ``half``: an fp16 model's queries, scales and residual;
    ``all_visible``: the form that reads no positions (``kivi`` alone)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    params = list(inspect.signature(kivi_gluon._kivi_gluon_kernel.fn).parameters)
    consts = {"KV_HEADS": 8, "GROUP": 4, "NUM_SPLITS": 33, "QSPLITS": 32, "RING": 160,
              **kivi_gluon.launch_constants(bits, with_logits, torch.float16 if half else torch.bfloat16,
                                            all_visible)}
    consts = {k: v for k, v in consts.items() if k in params}
    pointers = {k: v.replace("bf16", "fp16") if half else v for k, v in POINTERS.items()}
    sig = {p: pointers.get(p) or ("constexpr" if p in consts else "fp32" if p == "qk_scale" else "i32")
           for p in params}
    aligned = {(params.index(p),): [["tt.divisibility", 16]] for p in POINTERS if p in params}
    src = GluonASTSource(kivi_gluon._kivi_gluon_kernel, sig, consts, aligned)
    options = {"num_warps": 1, "num_stages": 1, **FP_FUSION}  # as the launch
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.asm["cubin"], "no cubin"
    # a 16-bit float multiply by a register set to 0: a constant the compiler flushed (Triton 3.9 mangles a bf16
    # tensor's float constant below fp16's normal range: in an offline build of a key-zeros lift 2^-40 became 0 and
    # 2^-20 9.98e-7)
    ptx = kernel.asm["ptx"]
    zeros = set(re.findall(r"mov\.b(?:16|32)\s+(%\w+),\s*0;", ptx))
    flushed = sum(a in zeros or b in zeros for a, b in
                  re.findall(r"mul(?:\.rn)?\.(?:bf16|f16)(?:x2)?\s+%\w+,\s*(%\w+),\s*(%\w+);", ptx))
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not cuobjdump.exists():
        return {"flushed": flushed}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cubin").write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(Path(tmp) / "k.cubin")],
                               capture_output=True, text=True).stdout
    return {"flushed": flushed,
            **{k.lower(): int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK")}}


def test_gluon_kivi_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_kivi_gluon_compile import compile_usage; "
            "print(json.dumps([compile_usage(2, False), compile_usage(4, True), compile_usage(2, False, True), "
            "compile_usage(2, False, False, True)]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for usage in json.loads(run.stdout.strip().splitlines()[-1]):
        # 2026-12-05 (ptxas of Triton 3.9): 156 registers at 2 bits (bf16 and fp16), 173 at 4 bits with logits, no
        # stack. A spill, or more than 192 registers (10 one-warp programs an SM instead of 12), is a regression.
        assert usage["flushed"] == 0, usage
        assert "reg" not in usage or (usage["stack"] == 0 and usage["reg"] <= 192), usage
