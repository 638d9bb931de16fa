"""Does the AOTI load crash on the H200 image come from the package's link line? (issue #17's known risk)

    python benchmarks/aoti_stdcxx.py [--workdir DIR] [--out FILE.jsonl]

``aoti_probe.py`` found (2026-12-01, cuda-gdb) that every CUDA package segfaults while its model is constructed:
``AOTInductorModel`` -> ``parse_device_str`` -> ``std::regex`` compilation -> a locale facet call that lands in
``std::codecvt<char16_t>::do_unshift``, a libstdc++ function *inside the wrapper .so*, whose ``NEEDED`` list has no
``libstdc++.so.6`` (the CPU package's has). That is the signature of a shared library carrying its own static
libstdc++ in a process that already has the shared one: some of its locale references bind to the process's copy,
others to its own, and a facet id of one copy indexes the other's facet table.

This script checks that explanation: it prints where torch's ``cpp_builder`` adds static libstdc++ / libgcc flags and
the environment's compiler settings, records the package's real compile and link command lines, builds the same
``Linear`` package twice (as torch builds it; with ``-static-libstdc++`` / ``-static-libgcc`` removed from the
command lines), and loads each in a fresh process. Each build compiles its package again (FX graph cache off).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATIC_FLAGS = ("-static-libstdc++", "-static-libgcc")


def _inspect() -> dict:
    import torch._inductor.cpp_builder as cpp_builder

    source = Path(cpp_builder.__file__).read_text().splitlines()
    hits = [f"{i + 1}: {line.strip()}" for i, line in enumerate(source)
            if any(flag in line for flag in ("static-libstdc", "static-libgcc", "Bstatic", "nostdlib"))]
    env = {k: v for k, v in os.environ.items() if k in ("CXX", "CC", "CXXFLAGS", "LDFLAGS", "CPLUS_INCLUDE_PATH")
           or k.startswith("TORCHINDUCTOR_")}
    return {"cpp_builder_lines": hits, "env": env}


def _build(workdir: Path, dynamic: bool) -> dict:
    import torch
    import torch._inductor.cpp_builder as cpp_builder

    commands: list[str] = []
    original = cpp_builder.run_compile_cmd

    def recording(cmd_line: str, cwd: str) -> None:
        if dynamic:
            cmd_line = " ".join(tok for tok in cmd_line.split(" ") if tok not in STATIC_FLAGS)
        commands.append(cmd_line)
        original(cmd_line, cwd)

    cpp_builder.run_compile_cmd = recording
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a self-test of this script
    model = torch.nn.Linear(64, 32).to(device)
    x = torch.randn(4, 64, device=device)
    start = time.perf_counter()
    program = torch.export.export(model, (x,))
    torch._inductor.aoti_compile_and_package(program, package_path=str(workdir / "linear.pt2"))
    torch.save({"x": x.cpu(), "y": model(x).detach().cpu()}, workdir / "io.pt")
    flags = sorted({tok for cmd in commands for tok in cmd.split(" ") if tok.startswith(("-static", "-Wl,-B", "-l"))})
    return {"build_s": round(time.perf_counter() - start, 1), "commands": len(commands), "link_flags": flags,
            "last_command": commands[-1][-1500:] if commands else ""}


def _load(workdir: Path) -> dict:
    import torch

    start = time.perf_counter()
    runner = torch._inductor.aoti_load_package(str(workdir / "linear.pt2"))
    io = torch.load(workdir / "io.pt")
    y = runner(io["x"].to("cuda" if torch.cuda.is_available() else "cpu"))
    y = y[0] if isinstance(y, (list, tuple)) else y
    return {"load_run_s": round(time.perf_counter() - start, 2), "max_err": float((y.cpu() - io["y"]).abs().max())}


def _needed(workdir: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(workdir / "linear.pt2") as archive:
        name = next(n for n in archive.namelist() if n.endswith(".so"))
        archive.extract(name, workdir / "unzipped")
    out = subprocess.run(["readelf", "-d", str(workdir / "unzipped" / name)], capture_output=True, text=True).stdout
    return [ln.split("[")[-1].rstrip("]") for ln in out.splitlines() if "NEEDED" in ln]


def _child(role: str, workdir: Path, dynamic: bool, timeout: float) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}  # the package is compiled again, headers stay cached
    cmd = [sys.executable, "-X", "faulthandler", __file__, "--role", role, "--workdir", str(workdir)]
    cmd += ["--dynamic"] if dynamic else []
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    result = next((json.loads(ln[7:]) for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), {})
    status = "ok" if done.returncode == 0 else {-11: "SEGFAULT", 139: "SEGFAULT"}.get(done.returncode,
                                                                                      f"rc={done.returncode}")
    return {"status": status, **result, **({"stderr": done.stderr[-800:]} if done.returncode else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--timeout", type=float, default=200.0)
    parser.add_argument("--variants", default="torch,dynamic", help="torch (as torch links), dynamic (no static flags)")
    parser.add_argument("--role", default="driver", choices=["driver", "build", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--dynamic", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="aoti-stdcxx-"))
    if args.role != "driver":
        result = _build(root, args.dynamic) if args.role == "build" else _load(root)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    rows = [{"variant": "inspect", **_inspect()}]
    print(json.dumps(rows[0]), flush=True)
    for dynamic in [v == "dynamic" for v in args.variants.split(",")]:
        workdir = root / ("dynamic_libstdcxx" if dynamic else "as_torch_builds")
        workdir.mkdir(parents=True, exist_ok=True)
        row = {"variant": workdir.name, "build": _child("build", workdir, dynamic, args.timeout)}
        if row["build"]["status"] == "ok":
            row["needed"] = _needed(workdir)
            row["load"] = _child("load", workdir, dynamic, 120)
        rows.append(row)
        print(json.dumps(row)[:2500], flush=True)
    if args.out:
        with open(args.out, "a") as sink:
            sink.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
