"""Can this host load AOTInductor packages in a fresh process? A minimal reproduction with many variants.

    python benchmarks/aoti_probe.py [--out probe.jsonl] [--quick] [--timeout 180] [--workdir DIR]

On the H200 image (torch 2.11 + cu130) ``torch._inductor.aoti_load_package`` once segfaulted in a fresh process
for every package, even one without custom kernels, while the same flow worked on CPU. One invocation:

1. **build** (one subprocess): packages of a tiny ``Linear`` model built several ways (default; weights outside
   the .so; no precompiled headers; cubins embedded in the .so; -O0 wrapper), the older ``torch._export.aot_compile``
   .so, a ``torch.export.save`` program, ``torch.compiler`` cache artifacts of a ``torch.compile`` run, packages of
   a module that calls sparsecompile's ops (``kv_write`` + ``paged_attention``: Triton on CUDA, called back through
   AOTI's proxy executor), and a whole ``sparsecompile.export`` artifact of a tiny random Llama; inputs and
   expected outputs are saved next to them.
2. **load** (one fresh subprocess per variant, ``-X faulthandler``, a timeout): the loader entry points one by
   one (``load_metadata_from_package``, the loader class, ``aoti_load_package``), ``device_index=0``,
   ``run_single_threaded=True``, ``CUDA_MODULE_LOADING=EAGER|LAZY``, a fresh ``TORCHINDUCTOR_CACHE_DIR``, loading
   after ``torch.cuda.init()`` or after a cuBLAS call, each build variant, ``torch._export.aot_load``,
   ``torch.export.load``, a warm ``torch.compile`` from cache artifacts, the ops package (also replayed from a
   CUDA graph) and ``sparsecompile.load`` + ``generate`` of the artifact, each checked against the expected
   outputs; where ``cuda-gdb`` exists and the default load crashed, a backtrace of it.

Prints a table (variant, status, seconds, max |error|, last error line) and writes one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# --device cpu runs the same probe on CPU (a self-test of this script; GPU-only steps are skipped there)
DEVICE = os.environ.get("AOTI_PROBE_DEVICE", "cuda")

# name -> (package file or kind, environment, description)
LOAD_VARIANTS = {
    "metadata_only": "load_metadata_from_package of the default package (reads the archive, no dlopen)",
    "loader_class": "torch._C._aoti.AOTIModelPackageLoader (what sparsecompile.load uses), run",
    "aoti_default": "torch._inductor.aoti_load_package(path), run",
    "aoti_device0": "aoti_load_package(path, device_index=0)",
    "aoti_single_threaded": "aoti_load_package(path, run_single_threaded=True)",
    "env_module_loading_eager": "CUDA_MODULE_LOADING=EAGER",
    "env_module_loading_lazy": "CUDA_MODULE_LOADING=LAZY",
    "env_fresh_inductor_cache": "TORCHINDUCTOR_CACHE_DIR=<empty dir>, FX graph / autograd caches off",
    "after_cuda_init": "torch.cuda.init() before loading",
    "after_cublas": "a cuBLAS matmul before loading",
    "build_external_weights": "package without weights (package_constants_in_so=False), user-managed constants",
    "build_no_pch": "package built with aot_inductor.precompile_headers=False",
    "build_embed_cubin": "package built with aot_inductor.embed_kernel_binary=True",
    "build_wrapper_O0": "package built with aot_inductor.compile_wrapper_opt_level=O0",
    "build_shared_libstdcxx": "package linked with -l:libstdc++.so.6 (sparsecompile.serving.aoti_linkage)",
    "so_aot_load": "torch._export.aot_compile .so + torch._export.aot_load",
    "export_load": "torch.export.save / torch.export.load, ExportedProgram.module() (no AOTI)",
    "cache_warm_start": "torch.compiler.load_cache_artifacts, then torch.compile of the same module (warm start)",
    "same_process": "build and load the default package in one process",
    "ops_aoti": "package calling sparsecompile ops (proxy executor), loader class",
    "ops_aoti_cudagraph": "ops package, run_single_threaded, replayed from a manual CUDA graph",
    "ops_export_load": "ops program through torch.export.load",
    "artifact_load": "sparsecompile.load of a tiny exported Llama, greedy generate",
}
QUICK = ("metadata_only", "loader_class", "aoti_default", "build_shared_libstdcxx", "ops_aoti", "artifact_load")
# what each load variant needs built (a package build costs ~70 s on the H200 image: build only what is loaded)
NEEDS = {"build_external_weights": "linear_ext", "build_no_pch": "linear_no_pch", "build_embed_cubin": "linear_embed",
         "build_wrapper_O0": "linear_O0", "build_shared_libstdcxx": "linear_shared_libstdcxx",
         "so_aot_load": "linear_so", "export_load": "linear_ep",
         "cache_warm_start": "linear_cache", "ops_aoti": "ops", "ops_aoti_cudagraph": "ops", "ops_export_load": "ops",
         "artifact_load": "artifact", "same_process": None}


# ------------------------------------------------------------------------------------------------- build role
def _linear_module(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).to(DEVICE).eval()


class _OpsModule:
    """A KV write and a paged attention over a small pool through sparsecompile's ops (built lazily: needs torch)."""

    @staticmethod
    def build(torch):
        import sparsecompile.kernels  # noqa: F401  (registers torch.ops.sparsecompile)

        class Ops(torch.nn.Module):
            def forward(self, q, k, v, k_pool, v_pool, pos_pool, slots, positions, index, lengths):
                torch.ops.sparsecompile.kv_write(k_pool, v_pool, pos_pool, k, v, slots, positions)
                return torch.ops.sparsecompile.paged_attention(q, k_pool, v_pool, pos_pool, index, lengths, positions,
                                                               4, 0.125, 0)

        return Ops()

    @staticmethod
    def inputs(torch):
        g = torch.Generator(device=DEVICE).manual_seed(0)
        batch, q_heads, kv_heads, dim, pages, page = 2, 4, 2, 64, 9, 4
        q = torch.randn(batch, q_heads, 1, dim, device=DEVICE, generator=g)
        k = torch.randn(batch, kv_heads, 1, dim, device=DEVICE, generator=g)
        v = torch.randn(batch, kv_heads, 1, dim, device=DEVICE, generator=g)
        k_pool = torch.randn(pages, kv_heads, page, dim, device=DEVICE, generator=g)
        v_pool = torch.randn(pages, kv_heads, page, dim, device=DEVICE, generator=g)
        pos_pool = torch.arange(page, device=DEVICE, dtype=torch.int32).repeat(pages, kv_heads, 1)
        pos_pool[:, :, 3] = -1
        slots = torch.tensor([[3], [7]], device=DEVICE)  # offset 3 of pages 0 and 1
        positions = torch.tensor([[3], [3]], device=DEVICE)
        index = torch.tensor([[[0], [0]], [[1], [1]]], device=DEVICE, dtype=torch.int32)
        lengths = torch.full((batch, kv_heads), 4, device=DEVICE, dtype=torch.int32)
        return (q, k, v, k_pool, v_pool, pos_pool, slots, positions, index, lengths)


def _build(workdir: Path, wanted: set[str] | None = None) -> dict:
    """Build the packages named in ``wanted`` (all when None) into ``workdir``; ``build.json`` reports each."""
    import torch

    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    report: dict = {"torch": torch.__version__, "device": name, "built": {}, "errors": {}}
    x = torch.randn(8, 64, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
    model = _linear_module(torch)
    with torch.no_grad():
        expected = model(x)
    torch.save({"x": x.cpu(), "expected": expected.cpu(), "state": {k: v.cpu() for k, v in model.state_dict().items()}},
               workdir / "linear_io.pt")
    ep = torch.export.export(model, (x,))

    def attempt(name, fn):
        if wanted is not None and name not in wanted:
            return
        start = time.perf_counter()
        try:
            fn()
            report["built"][name] = round(time.perf_counter() - start, 1)
        except Exception as err:  # noqa: BLE001 (report every failure, keep building)
            report["errors"][name] = f"{type(err).__name__}: {err}"[:500]
        (workdir / "build.json").write_text(json.dumps(report, indent=1))

    def package(name, configs=None):
        torch._inductor.aoti_compile_and_package(ep, package_path=str(workdir / f"{name}.pt2"),
                                                 inductor_configs=configs or {})

    attempt("linear", lambda: package("linear"))
    attempt("linear_ext", lambda: package("linear_ext", {"aot_inductor.package_constants_in_so": False}))
    attempt("linear_no_pch", lambda: package("linear_no_pch", {"aot_inductor.precompile_headers": False}))
    attempt("linear_embed", lambda: package("linear_embed", {"aot_inductor.embed_kernel_binary": True}))
    attempt("linear_O0", lambda: package("linear_O0", {"aot_inductor.compile_wrapper_opt_level": "O0"}))

    def shared_libstdcxx():
        sys.path.insert(0, str(ROOT))
        from sparsecompile.serving.aoti_linkage import link_options

        package("linear_shared_libstdcxx", link_options())

    attempt("linear_shared_libstdcxx", shared_libstdcxx)

    def so_route():
        path = torch._export.aot_compile(model, (x,), options={"aot_inductor.output_path": str(workdir / "linear.so")})
        (workdir / "so_path.txt").write_text(path)

    attempt("linear_so", so_route)
    attempt("linear_ep", lambda: torch.export.save(ep, str(workdir / "linear.ep.pt2")))

    def cache_artifacts():
        torch.compiler.reset()
        compiled = torch.compile(_linear_module(torch))
        with torch.no_grad():
            compiled(x)
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise RuntimeError("save_cache_artifacts returned None (no cache entries)")
        (workdir / "linear_cache.bin").write_bytes(saved[0])

    attempt("linear_cache", cache_artifacts)

    def ops():
        sys.path.insert(0, str(ROOT))
        module = _OpsModule.build(torch)
        args = _OpsModule.inputs(torch)
        fresh = [a.clone() for a in args]
        with torch.no_grad():
            out = module(*fresh)
        torch.save({"expected": out.cpu(), "k_pool": fresh[3].cpu()}, workdir / "ops_io.pt")
        ops_ep = torch.export.export(module, tuple(a.clone() for a in args), strict=False)
        torch.export.save(ops_ep, str(workdir / "ops.ep.pt2"))
        from sparsecompile.serving.aoti_linkage import link_options  # as sparsecompile.export builds packages

        torch._inductor.aoti_compile_and_package(ops_ep, package_path=str(workdir / "ops.pt2"),
                                                 inductor_configs=link_options())

    attempt("ops", ops)

    def artifact():
        sys.path.insert(0, str(ROOT))
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import tiny_pair, word_tokenizer

        import sparsecompile

        _, model = tiny_pair("llama")
        model = model.to(DEVICE)
        tokenizer = word_tokenizer(96)
        sparsecompile.export(model, workdir / "artifact", "vanilla", tokenizer=tokenizer, form="aoti", max_num_seqs=2,
                             max_model_len=128, page_size=4, prefill_chunk_size=16)
        llm = sparsecompile.LLM(model, "vanilla", tokenizer=tokenizer, max_num_seqs=2, max_model_len=128, page_size=4,
                                prefill_chunk_size=16)
        outs = llm.generate([[5, 6, 7, 8, 9, 10, 11]], sparsecompile.SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)
        (workdir / "artifact_expected.json").write_text(json.dumps(outs[0].outputs[0].token_ids))

    attempt("artifact", artifact)
    return report


# ------------------------------------------------------------------------------------------------- load role
def _index() -> int:
    return 0 if DEVICE == "cuda" else -1


def _sync(torch) -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _max_err(a, b) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())


def _load(variant: str, workdir: Path) -> dict:
    import torch

    if variant == "after_cuda_init" and DEVICE == "cuda":
        torch.cuda.init()
    if variant == "after_cublas":
        torch.ones(64, 64, device=DEVICE) @ torch.ones(64, 64, device=DEVICE)
        _sync(torch)
    io = torch.load(workdir / "linear_io.pt")
    x = io["x"].to(DEVICE)
    result: dict = {}
    start = time.perf_counter()
    if variant == "metadata_only":
        meta = torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(str(workdir / "linear.pt2"), "model")
        result["metadata"] = {k: meta[k] for k in list(meta)[:6]}
        out = None
    elif variant in ("loader_class", "build_external_weights"):
        name = "linear_ext" if variant == "build_external_weights" else "linear"
        loader = torch._C._aoti.AOTIModelPackageLoader(str(workdir / f"{name}.pt2"), "model", False, 1, _index())
        if variant == "build_external_weights":
            state = {k: v.to(DEVICE) for k, v in io["state"].items()}
            loader.load_constants({n: state[n] for n in loader.get_constant_fqns()}, False, True, True)
        out = loader.run([x])[0]
    elif variant in ("aoti_default", "env_module_loading_eager", "env_module_loading_lazy",
                     "env_fresh_inductor_cache", "after_cuda_init", "after_cublas"):
        out = torch._inductor.aoti_load_package(str(workdir / "linear.pt2"))(x)
    elif variant == "aoti_device0":
        out = torch._inductor.aoti_load_package(str(workdir / "linear.pt2"), device_index=_index())(x)
    elif variant == "aoti_single_threaded":
        out = torch._inductor.aoti_load_package(str(workdir / "linear.pt2"), run_single_threaded=True)(x)
    elif variant.startswith("build_"):
        name = {"build_no_pch": "linear_no_pch", "build_embed_cubin": "linear_embed", "build_wrapper_O0": "linear_O0",
                "build_shared_libstdcxx": "linear_shared_libstdcxx"}
        out = torch._inductor.aoti_load_package(str(workdir / f"{name[variant]}.pt2"))(x)
    elif variant == "so_aot_load":
        out = torch._export.aot_load((workdir / "so_path.txt").read_text().strip(), device=DEVICE)(x)
    elif variant == "export_load":
        out = torch.export.load(str(workdir / "linear.ep.pt2")).module()(x)
    elif variant == "cache_warm_start":
        info = torch.compiler.load_cache_artifacts((workdir / "linear_cache.bin").read_bytes())
        result["cache_info"] = str(info)[:300]
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).to(DEVICE).eval()
        model.load_state_dict({k: v.to(DEVICE) for k, v in io["state"].items()})
        from torch._dynamo.utils import counters

        with torch.no_grad():
            out = torch.compile(model)(x)
        result["fxgraph_cache"] = {k: v for k, v in counters["inductor"].items() if "fxgraph" in k}
    elif variant == "same_process":
        ep = torch.export.export(_linear_module(torch), (x,))
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(workdir / "same_process.pt2"))
        out = torch._inductor.aoti_load_package(path)(x)
    elif variant.startswith("ops_"):
        return _load_ops(variant, workdir, result, start)
    elif variant == "artifact_load":
        sys.path.insert(0, str(ROOT))
        import sparsecompile

        llm = sparsecompile.load(workdir / "artifact")
        outs = llm.generate([[5, 6, 7, 8, 9, 10, 11]], sparsecompile.SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)
        got = outs[0].outputs[0].token_ids
        want = json.loads((workdir / "artifact_expected.json").read_text())
        result.update(tokens=got, expected=want, max_err=0.0 if got == want else float("nan"))
        result["seconds"] = round(time.perf_counter() - start, 2)
        if got != want:
            raise AssertionError(f"artifact generated {got}, the eager engine {want}")
        return result
    else:
        raise ValueError(f"unknown variant {variant}")
    _sync(torch)
    result["seconds"] = round(time.perf_counter() - start, 2)
    if out is not None:
        out = out[0] if isinstance(out, (list, tuple)) else out
        result["max_err"] = _max_err(out, io["expected"])
    return result


def _load_ops(variant: str, workdir: Path, result: dict, start: float) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import sparsecompile.kernels  # noqa: F401  (the proxy executor calls the ops back into Python)

    io = torch.load(workdir / "ops_io.pt")
    args = list(_OpsModule.inputs(torch))
    if variant == "ops_export_load":
        out = torch.export.load(str(workdir / "ops.ep.pt2")).module()(*args)
    else:
        single = variant == "ops_aoti_cudagraph"
        if single and DEVICE != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        loader = torch._C._aoti.AOTIModelPackageLoader(str(workdir / "ops.pt2"), "model", single, 1, _index())
        out = loader.run(args)[0]
        if single:
            fresh = list(_OpsModule.inputs(torch))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loader.run(fresh)
            torch.cuda.current_stream().wait_stream(side)
            fresh = list(_OpsModule.inputs(torch))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = loader.run(fresh)[0]
            graph.replay()
            torch.cuda.synchronize()
            result["graph_max_err"] = _max_err(captured, io["expected"])
            result["graph_pool_err"] = _max_err(fresh[3], io["k_pool"])
    _sync(torch)
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["max_err"] = max(_max_err(out, io["expected"]), _max_err(args[3], io["k_pool"]))
    return result


# ------------------------------------------------------------------------------------------------- driver
def _env(variant: str, workdir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "AOTI_PROBE_DEVICE": DEVICE}
    if variant == "env_module_loading_eager":
        env["CUDA_MODULE_LOADING"] = "EAGER"
    if variant == "env_module_loading_lazy":
        env["CUDA_MODULE_LOADING"] = "LAZY"
    if variant == "env_fresh_inductor_cache":
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=workdir)
        env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
        env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    return env


def _run(args: list[str], env: dict, timeout: float) -> tuple[int, str, str, float]:
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-X", "faulthandler", *args], capture_output=True, text=True, env=env,
                              timeout=timeout)
        return done.returncode, done.stdout, done.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        errout = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
        return 124, out, errout, time.perf_counter() - start


def _shell(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return (done.stdout + done.stderr).strip()[-3000:]
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{type(error).__name__}: {error}"


def _environment() -> dict:
    """Versions a native crash may depend on: driver, CUDA runtime, compiler, C library."""
    import platform

    import torch

    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version(),
            "glibc": " ".join(platform.libc_ver()), "cxx": _shell(["c++", "--version"]).splitlines()[:1],
            "driver": _shell(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"]),
            "debuggers": [d for d in ("gdb", "cuda-gdb") if shutil.which(d)]}


def _inspect_so(package: Path, workdir: Path) -> dict:
    """The package's shared library: unresolved symbols (``ldd -r``) and what it links."""
    import zipfile

    target = workdir / "unzipped"
    with zipfile.ZipFile(package) as archive:
        archive.extractall(target)
    libraries = sorted(str(p) for p in target.rglob("*.so"))
    return {"so_files": [p[len(str(target)):] for p in libraries],
            "ldd": {p[len(str(target)):]: _shell(["ldd", "-r", p])[-1500:] for p in libraries[:2]}}


def _native(variant: str, workdir: Path, timeout: float) -> dict:
    """Where a crashing load dies in native code: the libraries the wrapper needs (``readelf``), the shared objects
    the loader maps (``LD_DEBUG=libs``: which CUDA runtime answers), and a debugger's backtrace. The debugger runs
    without init files and with debuginfod off: this host reaches no network, and a symbol download waits forever."""
    load = [sys.executable, "-X", "faulthandler", __file__, "--role", "load", "--variant", variant, "--workdir",
            str(workdir)]
    wrapper = sorted((workdir / "unzipped").rglob("*.so"))
    report: dict = {"crashed": variant}
    if wrapper:
        needed = _shell(["readelf", "-d", str(wrapper[0])])
        report["needed"] = [ln.split("[")[-1].rstrip("]") for ln in needed.splitlines() if "NEEDED" in ln]
    try:
        done = subprocess.run(load, capture_output=True, text=True, timeout=120,
                              env={**_env(variant, workdir), "LD_DEBUG": "libs"})
        lines = done.stderr.splitlines()
        report["cuda_libraries"] = sorted({ln.split("trying file=")[-1] for ln in lines
                                           if "trying file=" in ln and ("cudart" in ln or "libcuda." in ln)})[:20]
        report["last_inits"] = [ln.strip()[:200] for ln in lines if "calling init" in ln][-8:]
    except subprocess.TimeoutExpired:
        report["ld_debug"] = "timeout"
    debugger = shutil.which("gdb") or shutil.which("cuda-gdb")
    if debugger:
        cmd = [debugger, "-nx", "-batch", "-ex", "set debuginfod enabled off", "-ex", "set pagination off",
               "-ex", "set auto-solib-add on", "-ex", "run", "-ex", "bt 40", "-ex", "info registers rip", "--args",
               *load]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env("gdb", workdir))
            keep = [ln for ln in done.stdout.splitlines() if ln.startswith(("#", "Thread", "rip", "Program"))]
            report.update(debugger=debugger, backtrace=keep[-60:] or done.stdout[-3000:].splitlines())
        except subprocess.TimeoutExpired as err:
            out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
            report.update(debugger=debugger, backtrace=["timeout"] + out[-2000:].splitlines())
    return report


def _status(rc: int) -> str:
    return {0: "ok", 124: "timeout", -11: "SEGFAULT", 139: "SEGFAULT", -6: "abort", 134: "abort"}.get(rc, f"rc={rc}")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Fatal" in line or "Segmentation" in line:
            return line[:160]
    return lines[-1][:160] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON lines file (one line per variant)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per load subprocess")
    parser.add_argument("--build-timeout", type=float, default=540.0)
    parser.add_argument("--workdir", default=None, help="where packages go (default: a temporary directory)")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the load variants")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (a self-test of this script)")
    parser.add_argument("--role", default="driver", choices=["driver", "build", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--builds", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gdb-timeout", type=float, default=240.0, help="seconds for the debugger's backtrace")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device or DEVICE
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="aoti-probe-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.role == "build":
        print(json.dumps(_build(workdir, set(args.builds.split(",")) if args.builds else None)))
        return 0
    if args.role == "load":
        print("RESULT " + json.dumps(_load(args.variant, workdir)))
        return 0

    rows = []
    sink = open(args.out, "a") if args.out else None  # noqa: SIM115

    def emit(row: dict) -> None:
        rows.append(row)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    names = args.variants.split(",") if args.variants else list(QUICK if args.quick else LOAD_VARIANTS)
    builds = {NEEDS.get(n, "linear") for n in names} - {None}
    emit({"variant": "environment", "status": "info", **_environment()})
    rc, out, err, seconds = _run([__file__, "--role", "build", "--workdir", str(workdir), "--builds", ",".join(builds)],
                                 _env("build", workdir), args.build_timeout)
    build = json.loads((workdir / "build.json").read_text()) if (workdir / "build.json").exists() else {}
    emit({"variant": "build", "status": _status(rc), "seconds": round(seconds, 1), "built": build.get("built"),
          "errors": build.get("errors"), "torch": build.get("torch"), "device": build.get("device"),
          "last": _last_line(err) if rc else ""})
    if (workdir / "linear.pt2").exists():
        emit({"variant": "package_so", "status": "info", **_inspect_so(workdir / "linear.pt2", workdir)})
    for name in names:
        rc, out, err, seconds = _run([__file__, "--role", "load", "--variant", name, "--workdir", str(workdir)],
                                     _env(name, workdir), args.timeout)
        payload = next((json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")), {})
        emit({"variant": name, "what": LOAD_VARIANTS.get(name, ""), "status": _status(rc), "wall_s": round(seconds, 1),
              **payload, "last": _last_line(err) if rc else "", "stderr_tail": err[-1500:] if rc else ""})
    crashed = next((r for r in rows if r["variant"] in ("loader_class", "aoti_default") and r["status"] != "ok"), None)
    if crashed:
        emit({"variant": "native", "status": "info", **_native(crashed["variant"], workdir, args.gdb_timeout)})
    if sink:
        sink.close()
    print(f"\n{'variant':28} {'status':9} {'s':>6} {'max|err|':>10}  last error")
    for r in rows:
        seconds = r.get("seconds", r.get("wall_s", ""))
        err_value = r.get("max_err", "")
        err_text = f"{err_value:.2e}" if isinstance(err_value, float) else str(err_value)
        print(f"{r['variant']:28} {r['status']:9} {seconds!s:>6} {err_text:>10}  {r.get('last', '')[:70]}")
    if build.get("errors"):
        print("build errors: " + "; ".join(f"{k}: {v[:90]}" for k, v in build["errors"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
