"""Decode as users run it: ``optimize()`` then ``model.generate()``, beside the engine step, on the Llama-3.1-8B shape.

    python benchmarks/user_path.py [--methods vanilla,snapkv,...] [--points 32768x1,131072x4] [--out DIR]
    sparsecompile bench --user-path ...            (same arguments)

Per (method, context, batch) point, through the public API only (random bf16 weights, random prompt ids):

* ``generate_tok_s = batch x (N - 1) / (t(generate N tokens) - t(generate 1 token))``: timed calls after a
  first (compiling) call, each with its own prefill, so the difference is decode; each time is the median of
  ``--repeats`` calls (alternating) at points of up to 128K tokens in the batch, one call above (there N is 1025 by
  default, so a prefill's spread stays small beside the decode);
* ``engine_tok_s``: the compiled engine step from a synthetically filled cache (``decode.engine_point``), same run;
* ``first_call_extra_s = t(first generate N) - t(generate N)`` (compile and capture on the first call);
* ``warm_process_extra_s`` (``--warm-process``, 32K x 1 points): a new Python process (this script with ``--child``)
  that builds the model, optimizes it and calls ``generate`` N tokens with the on-disk compile cache already warm,
  minus that process's second call: what a restarted server pays. With ``--warm-programs`` the parent first runs
  ``sparsecompile.warmup(programs=True)`` at the point (``programs_build_s``), so the child loads the precompiled
  decode program instead of tracing the step.

``--profile-generate``: one more call per point with a window of its decode steps profiled (:func:`profile_generate`:
the kernels, the GPU's idle share), beside the engine step's profile.

Results: JSON lines ``user_path<TAG>.jsonl`` under ``--out`` (fields method, context, batch, generate_tok_s,
engine_tok_s, first_call_extra_s, warm_process_extra_s, ...) and a table on stdout.
Cost: a point costs three prefills plus a compile (32K x 1: about 40-70 s; 128K x 4: several minutes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import (  # noqa: E402
    METHOD_OPTIONS,
    add_kernel_arguments,
    apply_kernel_arguments,
    build_model,
    engine_point,
    weight_bytes,
)

import sparsecompile  # noqa: E402


def _timed_generate(model, ids: torch.Tensor, new_tokens: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - start


class _ProfiledTokens:
    """A ``generate()`` streamer that steps a torch profiler at every ``put`` (the prompt's, then one a token): with
    a wait / warmup / active schedule, the profile covers a window of decode steps inside a real ``generate()`` call,
    host loop, sampling ops and all, and no prefill."""

    def __init__(self, prof) -> None:
        self.prof = prof

    def put(self, value) -> None:
        self.prof.step()

    def end(self) -> None:
        pass


PROFILE_WINDOW = (8, 4, 32)  # tokens waited, warmed up, profiled


def profile_generate(model, ids: torch.Tensor, path: str) -> dict:
    """Where a ``generate()`` decode step's time goes (``--profile-generate``): the top kernels of
    ``PROFILE_WINDOW[2]`` steps in the middle of one call, written to ``path``, and the GPU's idle share of that
    window (the union of kernel intervals against the span from the first kernel to the last): what the engine
    step's profile (``decode.py --profile``) does not see."""
    from torch.profiler import ProfilerActivity, profile, schedule

    wait, warmup, active = PROFILE_WINDOW
    tables: list = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                 on_trace_ready=tables.append) as prof:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=wait + warmup + active + 8,
                       min_new_tokens=wait + warmup + active + 8, do_sample=False, pad_token_id=0,
                       streamer=_ProfiledTokens(prof))
        if ids.is_cuda:
            torch.cuda.synchronize()
    if not tables:
        return {"profile_error": "the profiler's window did not close (fewer streamed tokens than the schedule)"}
    kernels = sorted((e.time_range.start, e.time_range.end) for e in tables[0].events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, reach = 0.0, float("-inf")
    for start, end in kernels:  # union of the kernels' intervals
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    span = kernels[-1][1] - kernels[0][0] if kernels else 0.0
    with open(path, "w") as handle:
        handle.write(f"{active} decode steps of one generate() call; GPU busy {busy / 1e3:.2f} ms of a "
                     f"{span / 1e3:.2f} ms span ({active} steps: {span / active / 1e3:.3f} ms a step)\n")
        handle.write(tables[0].key_averages().table(sort_by="cuda_time_total" if ids.is_cuda else "cpu_time_total",
                                                   row_limit=60, max_name_column_width=90))
    return {"profile_step_ms": span / active / 1e3, "profile_gpu_busy_ms": busy / active / 1e3,
            "profile_gpu_idle_share": 1 - busy / span if span else None}


def generate_point(model, method: str, context: int, batch: int, new_tokens: int, repeats: int = 1,
                   profile_path: str | None = None) -> dict:
    """``repeats`` pairs of timed calls, alternating one token and ``new_tokens``, medians of each: both times hold
    a prefill whose run-to-run spread (0.5 s at 32K on the H200, 2026-12-01) is several decode steps' worth, so
    a single pair can misstate decode by 10 % at 64 tokens. ``profile_path``: then one profiled call
    (:func:`profile_generate`)."""
    sparsecompile.optimize(model, method, **METHOD_OPTIONS[method])
    ids = torch.randint(3, 1000, (batch, context), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    try:
        before = compile_phases()
        first = _timed_generate(model, ids, new_tokens)
        after = compile_phases()
        first_phases = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v - before.get(k, 0.0) >= 0.05}
        ones, fulls = [], []
        for _ in range(repeats):
            ones.append(_timed_generate(model, ids, 1))
            fulls.append(_timed_generate(model, ids, new_tokens))
        one, full = statistics.median(ones), statistics.median(fulls)
        from torch._dynamo.utils import counters

        skips = int(counters["inductor"]["cudagraph_skips"])
        profiled = profile_generate(model, ids, profile_path) if profile_path else {}
    finally:
        sparsecompile.restore(model)
        torch.cuda.empty_cache()
    return {"method": method, "context": context, "batch": batch, "new_tokens": new_tokens,
            "generate_tok_s": batch * (new_tokens - 1) / (full - one), "t_one_s": one, "t_full_s": full,
            "t_one_runs_s": [round(t, 4) for t in ones], "t_full_runs_s": [round(t, 4) for t in fulls],
            "first_call_extra_s": first - full, "first_call_compile_phases_s": first_phases, "cudagraph_skips": skips,
            **profiled}


def compile_phases() -> dict[str, float]:
    """Where this process's compile time went (dynamo's own phase timers, summed): e.g. ``bytecode_tracing``
    (dynamo), ``AOTAutogradCache.inductor_load`` / ``PyCodeCache.load_by_key_path`` (a cached graph's code loaded),
    ``compile_file`` (C++ / Triton compiles)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {name: round(float(value), 3) for name, value in zip(names, values) if float(value) >= 0.05}


def child(args: argparse.Namespace) -> None:
    """A fresh process: model, optimize, first and second generate; prints one JSON line."""
    import logging

    notes: list[str] = []  # whether the first generate() loaded a precompiled decode program or compiled the step
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logging.getLogger("sparsecompile").addHandler(handler)
    start = time.perf_counter()
    model = build_model(args.layers)
    built = time.perf_counter() - start
    row = generate_point(model, args.methods, *map(int, args.points.split("x")), args.new_tokens or 129, 1)
    row["build_s"] = built
    row["decode_step_notes"] = [n for n in notes if "decode" in n][:4]
    row["compile_phases_s"] = compile_phases()
    print("CHILD " + json.dumps(row), flush=True)


def build_programs(model, method: str, context: int, batch: int, new_tokens: int) -> float:
    """``warmup(programs=True)`` at the point's geometry (the child's ``generate()`` then finds the package)."""
    sparsecompile.optimize(model, method, **METHOD_OPTIONS[method])
    start = time.perf_counter()
    try:
        sparsecompile.warmup(model, (batch,), context, new_tokens, programs=True)
    finally:
        sparsecompile.restore(model)
        torch.cuda.empty_cache()
    return time.perf_counter() - start


def warm_process_extra(args: argparse.Namespace, method: str, context: int, batch: int) -> float | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--methods", method, "--points",
           f"{context}x{batch}", "--new-tokens", str(args.new_tokens or 129)] + (["--layers", str(args.layers)]
                                                                          if args.layers else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
    line = next((x for x in done.stdout.splitlines() if x.startswith("CHILD ")), None)
    if line is None:
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    row = json.loads(line[len("CHILD "):])
    print(f"warm process compile phases ({method}): {row['compile_phases_s']}; decode step: "
          f"{row['decode_step_notes']}; model built in {row['build_s']:.1f} s", flush=True)
    return row["first_call_extra_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="vanilla,streamingllm,snapkv,pyramidkv,h2o,quest,omnikv")
    parser.add_argument("--points", default="32768x1,32768x16,131072x1,131072x4")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="N (default: 129 at points up to 128K tokens timed by medians, else 1025: one pair of "
                             "32K x 16 prefills spreads by ~0.1 s beside 1.7 s of decode at 129)")
    parser.add_argument("--steps", type=int, default=128, help="timed engine steps")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate() pairs per point up to 128K tokens "
                                                             "in the batch (medians)")
    parser.add_argument("--large-repeats", type=int, default=1, help="timed generate() pairs per point past 128K "
                        "tokens in the batch (a 128K x 4 prefill takes ~46 s: one pair unless a cell needs medians)")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine-step rows")
    parser.add_argument("--profile-generate", action="store_true", help="profile a window of decode steps inside one "
                        "more generate() call per point (profile_generate_<method>_<K>k_b<batch>.txt; with the engine "
                        "step's profile beside it, profile_<method>_<K>k_b<batch>.txt)")
    parser.add_argument("--warm-process", action="store_true", help="measure a new process with warm caches "
                                                                    "(32K x 1 points)")
    parser.add_argument("--warm-programs", action="store_true", help="before the warm process, precompile its decode "
                        "program (sparsecompile.warmup(programs=True)), which it then loads instead of tracing")
    parser.add_argument("--child-timeout", type=int, default=300)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tag", default="_h200_run", help="suffix of user_path<TAG>.jsonl (appended to; "
                        "user_path_collect.py merges runs into user_path_h200.jsonl)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_kernel_arguments(parser)
    args = parser.parse_args(argv)
    kernels = apply_kernel_arguments(args)
    if not torch.cuda.is_available():
        parser.exit(2, "user_path.py measures GPU decode through generate(): it needs a CUDA device\n")
    if args.child:
        child(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"user_path{args.tag}.jsonl")
    model = build_model(args.layers)
    wbytes = weight_bytes(model)
    rows = []
    for point in args.points.split(","):
        context, batch = map(int, point.split("x"))
        for method in args.methods.split(","):
            try:
                small = context * batch <= 32768 * 4
                repeats = args.repeats if small else args.large_repeats
                new_tokens = args.new_tokens or (129 if small and repeats > 1 else 1025)
                name = f"{method}_{context // 1024}k_b{batch}"
                profiles = ({"profile_path": os.path.join(args.out, f"profile_generate_{name}.txt")}
                            if args.profile_generate else {})
                row = generate_point(model, method, context, batch, new_tokens, repeats, **profiles)
                if not args.no_engine:
                    engine = engine_point(model, method, context, batch, 16, args.steps, wbytes, 1.0,
                                          os.path.join(args.out, f"profile_{name}.txt") if profiles else None)
                    row["engine_tok_s"] = engine.tok_s
                    row["generate_vs_engine"] = row["generate_tok_s"] / engine.tok_s
                if args.warm_process and (context, batch) == (32768, 1):
                    if args.warm_programs:  # precompile the decode program the child's generate() will load
                        row["programs_build_s"] = build_programs(model, method, context, batch, new_tokens)
                    row["warm_process_extra_s"] = warm_process_extra(args, method, context, batch)
            except torch.OutOfMemoryError as err:
                row = {"method": method, "context": context, "batch": batch, "error": f"out of memory: {err}"[:200],
                       "where": traceback.format_exc(limit=-4)[-1500:],  # which allocation: pool, prefill, graph
                       "allocated_at_error_GiB": round(torch.cuda.memory_allocated() / 2**30, 2)}
                sparsecompile.restore(model)
                torch.cuda.empty_cache()
            except Exception as err:  # noqa: BLE001 - one failing point must not lose the others
                row = {"method": method, "context": context, "batch": batch, "error": repr(err)[:300]}
                sparsecompile.restore(model)
                torch.cuda.empty_cache()
            gc.collect()  # what the point left behind once optimize() is undone: a leak would show here
            torch.cuda.empty_cache()
            row["allocated_after_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            row["reserved_after_GiB"] = round(torch.cuda.memory_reserved() / 2**30, 2)
            row.update(kernels)
            rows.append(row)
            with open(path, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print(f"\n{'method':>12} {'point':>10} {'generate':>9} {'engine':>9} {'ratio':>6} {'first+s':>8} {'warm+s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:>12} {r['context']}x{r['batch']:<4} {r['error'][:60]}")
            continue
        warm = r.get("warm_process_extra_s")
        print(f"{r['method']:>12} {r['context']:>6}x{r['batch']:<3} {r['generate_tok_s']:9.1f} "
              f"{r.get('engine_tok_s', float('nan')):9.1f} {r.get('generate_vs_engine', float('nan')):6.3f} "
              f"{r['first_call_extra_s']:8.1f} {'' if warm is None else f'{warm:7.1f}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
