"""Dev tool: check on a CPU-only machine that the Triton kernels still compile for the H200 (sm_90).

    python benchmarks/triton_compile_check.py [TEST_FILE ...] [--out compile.jsonl] [--max-per-kernel 6]

Two phases. (1) Record: a child process runs the given pytest files in-process with ``TRITON_INTERPRET=1``
and records every Triton kernel launch of ``--package`` (default ``sparsecompile.kernels``) by wrapping the
interpreter's launch path (``InterpretedFunction.run``: ``kernel[grid](...)`` ends there): the jit function,
each argument's kind (pointer dtype and 16-byte alignment / int / float / bool / constexpr value) and the
launch options (num_warps, num_stages, ...). (2) Compile: this process (interpreter off) dedupes the
recorded launches, keeps at most ``--max-per-kernel`` per kernel (distinct constexpr combinations first),
and AOT-compiles each with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` to a cubin,
specialising arguments the way a real launch does (ints equal to 1 become constexprs; pointers and ints
divisible by 16 get ``tt.divisibility``). The tests run fp32 (the interpreter's bf16 dot is wrong), so each
kept signature with fp32 pointers is compiled again with every fp32 pointer switched to bf16 and to fp16
(variants ``bf16`` / ``fp16``, reported on their own lines, with ``--variant-constexpr`` overrides, default
``IEEE=False`` as the wrappers pass for non-fp32 queries; pointers that stay fp32 on the GPU, e.g. lse or
score buffers, are switched too, so a variant failure may not be a real launch). The signatures are the
tests' toy ones: a toy tile can fail where the GPU config would not (``tl.dot`` needs K >= 16 for bf16/fp16
and K >= 8 for fp32, e.g. the prefill tests' ``block_n`` 8 and 2): those compiles are reported as toy tiles,
not failures (a GPU config never uses such tiles).

One line per (kernel, variant): name, number of signatures, OK / FAIL with the first error, and how many toy
tiles were below ``tl.dot``'s minimum. Exit status 1 on any failure. ``--out`` writes one JSON line per compile.
Uses only ``ASTSource`` / ``GPUTarget`` / ``triton.compile``, which exist in triton 3.6 (the GPU image) and 3.9.
A fresh Triton cache is used per run (``--keep-cache`` uses the default one), so every signature is really
compiled.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

DEFAULT_TESTS = ["tests/test_kernels.py", "tests/test_prefill_attention.py", "tests/test_mass_kernels.py",
                 "tests/test_eviction_kernels.py", "tests/test_kivi_kernels.py", "tests/test_selection_kernels.py"]
OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
TORCH_TO_TRITON = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "int64": "i64",
                   "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "uint16": "u16", "uint32": "u32",
                   "uint64": "u64", "bool": "i1", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


# ---------------------------------------------------------------------------------------------- record phase


# tl.dot's shape check: a test's toy tile below the dot's minimum K, which no GPU config uses
_TOY_TILE = re.compile(r"Input shapes should have M >= \d+, N >= \d+ and K >= \d+")


def _describe(value) -> dict:
    """A launch argument -> a JSON-able kind (the compile phase turns it into a signature entry)."""
    import torch
    import triton.language as tl

    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        name = str(value.dtype).removeprefix("torch.")
        return {"kind": "ptr", "dtype": TORCH_TO_TRITON.get(name, name), "aligned": value.data_ptr() % 16 == 0}
    if value is None:
        return {"kind": "none"}
    if isinstance(value, bool):
        return {"kind": "bool", "value": value}
    if isinstance(value, int):
        return {"kind": "int", "value": value}
    if isinstance(value, float):
        return {"kind": "float", "value": value}
    if isinstance(value, tl.dtype):
        return {"kind": "tl_dtype", "value": value.name}
    if isinstance(value, torch.dtype):
        return {"kind": "torch_dtype", "value": str(value).removeprefix("torch.")}
    if isinstance(value, str):
        return {"kind": "str", "value": value}
    return {"kind": "unsupported", "value": repr(value)[:80]}


def _record(out_path: str, package: str, pytest_args: list[str]) -> int:
    """Runs pytest with the interpreter's launch wrapped; writes one JSON line per distinct launch."""
    import inspect

    import pytest
    from triton.runtime import interpreter

    seen: dict[str, dict] = {}
    original_run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        if not warmup and fn.__module__.startswith(package):
            try:
                params = list(inspect.signature(fn).parameters)
                bound = dict(zip(params, args))
                bound.update({k: v for k, v in kwargs.items() if k in params})
                annotations = inspect.get_annotations(fn)
                entry = {"module": fn.__module__, "qualname": fn.__qualname__, "args": [],
                         "options": {k: kwargs[k] for k in OPTION_KEYS if k in kwargs}}
                for name in params:
                    if name not in bound:  # a default value: the compile phase reads it from the signature
                        continue
                    kind = _describe(bound[name])
                    kind["name"] = name
                    kind["constexpr"] = "constexpr" in str(annotations.get(name, ""))
                    entry["args"].append(kind)
                key = json.dumps(entry, sort_keys=True)
                seen.setdefault(key, {**entry, "launches": 0})["launches"] += 1
            except Exception as exc:  # recording must never break the test run
                print(f"[compile-check] could not record {fn.__name__}: {exc!r}", file=sys.stderr)
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
    with open(out_path, "w") as f:
        for entry in seen.values():
            f.write(json.dumps(entry) + "\n")
    return int(rc)


# --------------------------------------------------------------------------------------------- compile phase


def _signature(entry: dict, fn, specialize: bool) -> tuple[dict, dict, dict]:
    """A recorded launch -> (signature, constexprs, attrs) for ``ASTSource``, as a real launch specialises."""
    import inspect

    import triton.language as tl

    given = {a["name"]: a for a in entry["args"]}
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(inspect.signature(fn.fn).parameters.items()):
        a = given.get(name)
        if a is None:  # not passed: its default
            a = {**_describe(param.default), "constexpr": "constexpr" in str(param.annotation)}
        kind = a["kind"]
        if kind == "unsupported":
            raise TypeError(f"argument {name}: cannot rebuild {a['value']}")
        if a["constexpr"] or kind in ("none", "tl_dtype", "torch_dtype", "str"):
            value = a.get("value")
            if kind == "tl_dtype":
                value = tl.dtype(value)
            elif kind == "torch_dtype":
                import torch

                value = getattr(torch, value)
            signature[name], constexprs[name] = "constexpr", value
        elif kind == "ptr":
            signature[name] = "*" + a["dtype"]
            if specialize and a["aligned"]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif kind == "int":
            v = a["value"]
            if specialize and v == 1:
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -2**31 <= v < 2**31 else ("u64" if v >= 2**63 else "i64")
            if specialize and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif kind == "float":
            signature[name] = "fp32"
        elif kind == "bool":
            signature[name] = "i1"
    return signature, constexprs, attrs


def _select(entries: list[dict], limit: int) -> list[dict]:
    """At most ``limit`` launches, distinct constexpr combinations first, then the most launched."""
    def combo(e):
        return json.dumps([(a["name"], a.get("value")) for a in e["args"] if a["constexpr"]])

    ordered = sorted(entries, key=lambda e: -e["launches"])
    picked, combos = [], set()
    for e in ordered:
        if combo(e) not in combos and len(picked) < limit:
            picked.append(e)
            combos.add(combo(e))
    for e in ordered:
        if e not in picked and len(picked) < limit:
            picked.append(e)
    return picked


def _first_error(exc: BaseException) -> str:
    """The innermost error's message with the chain of ``at line:col`` of the jit functions it passed through."""
    where, chain = [], [exc]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    message = ""
    for c in chain:
        lines = [ln.strip() for ln in str(c).splitlines() if ln.strip()]
        if lines and lines[0].startswith("at ") and lines[0].endswith(":"):
            name = re.search(r"def (\w+)", str(getattr(c, "src", "") or ""))
            where.append(f"{name.group(1) if name else '?'} {lines[0][3:-1]}")
            tail = [ln for ln in lines[1:] if ln != "^" and not ln.startswith("^")]
            if len(lines) > 1 and not lines[-1].startswith("^"):
                message = f"{type(c).__name__}: {lines[-1]}" if tail else message
        elif lines:
            message = f"{type(c).__name__}: {lines[0]}"
    loc = f"[at {' -> '.join(where)}] " if where else ""
    return f"{loc}{message or type(exc).__name__}"[:400]


def _compile_all(records: list[dict], limit: int, variants: bool, specialize: bool, out_path: str | None,
                 variant_const: dict, asm_dir: str | None = None) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    by_kernel: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        by_kernel[(r["module"], r["qualname"])].append(r)

    rows, failures = [], 0
    out = open(out_path, "w") if out_path else None
    for (module, qualname), entries in sorted(by_kernel.items(), key=lambda kv: kv[0][1]):
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        jobs: dict[str, list] = defaultdict(list)  # variant -> [(signature, constexprs, attrs, options)]
        done = set()
        for e in _select(entries, limit):
            try:
                sig, const, attrs = _signature(e, fn, specialize)
            except Exception as exc:
                jobs["recorded"].append(exc)
                continue
            for variant, dtype in [("recorded", None)] + ([("bf16", "bf16"), ("fp16", "fp16")] if variants else []):
                if dtype is None:
                    sig_v, const_v = sig, const
                elif "*fp32" in sig.values():
                    sig_v = {k: ("*" + dtype if v == "*fp32" else v) for k, v in sig.items()}
                    const_v = {k: variant_const.get(k, v) for k, v in const.items()}
                else:
                    continue
                key = json.dumps([variant, sig_v, {k: str(v) for k, v in const_v.items()},
                                  sorted(map(str, attrs.items())), e["options"]], sort_keys=True)
                if key not in done:
                    done.add(key)
                    jobs[variant].append((sig_v, const_v, attrs, e["options"]))
        for variant, items in jobs.items():
            ok, errors, seconds, toy = 0, [], 0.0, 0
            for item in items:
                t0 = time.perf_counter()
                if isinstance(item, Exception):
                    error, size = _first_error(item), 0
                else:
                    sig, const, attrs, options = item
                    try:
                        src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
                        kernel = triton.compile(src, target=target, options=dict(options))
                        error, size = None, len(kernel.asm["cubin"])
                        if asm_dir is not None:  # for reading the code: instruction counts, loads per iteration
                            name = f"{qualname}.{variant}.{len(os.listdir(asm_dir))}.ptx"
                            (Path(asm_dir) / name).write_text(kernel.asm["ptx"])
                    except Exception as exc:
                        error, size = _first_error(exc), 0
                dt = time.perf_counter() - t0
                seconds += dt
                ok += error is None
                if error is not None and _TOY_TILE.search(error):
                    toy += 1
                elif error is not None:
                    errors.append(error)
                if out is not None and not isinstance(item, Exception):
                    out.write(json.dumps({"kernel": qualname, "module": module, "variant": variant,
                                          "signature": item[0], "constexprs": {k: str(v) for k, v in item[1].items()},
                                          "options": item[3], "ok": error is None, "error": error,
                                          "cubin_bytes": size, "seconds": round(dt, 2)}) + "\n")
            failures += len(errors)
            status = "OK" if not errors else f"FAIL {len(errors)}/{len(items)}: {errors[0]}"
            if toy:
                status += f" ({toy} toy tiles below tl.dot's minimum K)"
            rows.append(f"{qualname:32s} {module.rsplit('.', 1)[-1]:18s} {variant:8s} {len(items):3d} sigs "
                        f"{seconds:6.1f}s  {status}")
            print(rows[-1], flush=True)
    if out is not None:
        out.close()
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", help="pytest files (default: the Triton kernel test files)")
    parser.add_argument("--out", help="JSON lines, one per compile")
    parser.add_argument("--package", default="sparsecompile.kernels", help="record kernels of this module prefix")
    parser.add_argument("--max-per-kernel", type=int, default=6, help="signatures compiled per kernel")
    parser.add_argument("--no-variants", action="store_true", help="skip the bf16 / fp16 re-compiles")
    parser.add_argument("--variant-constexpr", action="append", default=None, metavar="NAME=VALUE",
                        help="constexpr overridden in the bf16/fp16 variants where the kernel has it (default "
                             "IEEE=False: the wrappers pass IEEE=(query is fp32))")
    parser.add_argument("--no-specialize", action="store_true", help="no ==1 / divisibility specialisation")
    parser.add_argument("-k", dest="keyword", help="passed to pytest -k")
    parser.add_argument("--keep-cache", action="store_true", help="use the default Triton cache")
    parser.add_argument("--asm-dir", help="also write each compile's PTX here (static instruction counts)")
    parser.add_argument("--record-to", help=argparse.SUPPRESS)  # internal: the child's record phase
    args = parser.parse_args()
    tests = args.tests or [t for t in DEFAULT_TESTS if glob.glob(t)]
    pytest_args = tests + (["-k", args.keyword] if args.keyword else [])

    if args.record_to:
        return _record(args.record_to, args.package, pytest_args)
    os.environ.pop("TRITON_INTERPRET", None)  # the compile phase needs real JITFunctions (triton not imported yet)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.6 behaviour; silences the 3.9 warning

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        records_path = os.path.join(tmp, "records.jsonl")
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        child = subprocess.run([sys.executable, os.path.abspath(__file__), "--record-to", records_path,
                                "--package", args.package, *pytest_args], env=env)
        if not os.path.exists(records_path):
            print(f"record phase failed (pytest exit {child.returncode})")
            return 1
        with open(records_path) as f:
            records = [json.loads(line) for line in f]
        t_record = time.perf_counter() - t0
        print(f"recorded {len(records)} distinct launches of {len({r['qualname'] for r in records})} kernels "
              f"in {t_record:.0f}s (pytest exit {child.returncode}); compiling for sm_90 ...", flush=True)
        if not args.keep_cache:
            os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton-cache")
        t1 = time.perf_counter()
        variant_const = {}
        for item in args.variant_constexpr if args.variant_constexpr is not None else ["IEEE=False"]:
            name, _, value = item.partition("=")
            variant_const[name] = json.loads(value.lower()) if value.lower() in ("true", "false", "null") or \
                value.lstrip("-").isdigit() else value
        failures = _compile_all(records, args.max_per_kernel, not args.no_variants, not args.no_specialize,
                                args.out, variant_const, args.asm_dir)
        print(f"compile phase {time.perf_counter() - t1:.0f}s, total {time.perf_counter() - t0:.0f}s, "
              f"{failures} failed compile(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
