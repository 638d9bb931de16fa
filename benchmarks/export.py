"""Exported artifacts on the Llama-3.1-8B shape (random bf16 weights): export time, load to first token, decode speed.

    python benchmarks/export.py [--methods vanilla,snapkv,quest] [--points 32768x1,131072x4] [--quick]
                                [--out results/export.jsonl] [--workdir DIR] [--form aoti|exported]

Every measurement runs in its own subprocess (a crash or an out-of-memory loses one row, not the run):

* **export** (per method, a fresh ``$SPARSECOMPILE_CACHE`` so no package is reused): build the model, then
  ``sparsecompile.export`` with ``max_num_seqs=4`` and a context covering the largest point; target <= 5 min.
* **first token** (per artifact, a fresh process with an empty Triton cache, as on a machine that did not export
  it): ``import sparsecompile`` (timed apart), ``sparsecompile.load``, then ``generate`` of one token for a
  1K-token prompt; target load + first token <= 10 s.
* **decode** (per method and point): the artifact's decode step (CUDA-graph replays captured at load) and the
  compiled path (``optimize(compile=True)``, the same as ``benchmarks/decode.py``), each from a KV cache filled
  synthetically at the size the method keeps, 32 warm-up then 128 timed steps; target artifact within 3 %.
* **tokens** (per artifact): greedy tokens of the artifact against the compiled engine's on the same random
  weights (bf16, so an early tie may diverge: reported, the exact check is ``tests/gpu/test_export_cuda.py``).

Prints a table last and appends one JSON line per measurement to ``--out``.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
METHOD_OPTIONS = {"vanilla": {}, "snapkv": {"budget": 2048}, "quest": {"budget": 2048}, "omnikv": {"budget": 2048},
                  "h2o": {"budget": 2048}, "streamingllm": {"budget": 2048}, "pyramidkv": {"budget": 2048}}
MAX_NUM_SEQS = 4


def _model(layers: int | None):
    sys.path.insert(0, str(HERE))
    from decode import build_model

    return build_model(layers)


def _tokenizer():
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import word_tokenizer

    return word_tokenizer(128256)


# ------------------------------------------------------------------------------------------------- roles
def role_export(args) -> dict:
    import sparsecompile

    model = _model(args.layers)
    start = time.perf_counter()
    out = sparsecompile.export(model, args.dir, args.method, tokenizer=_tokenizer(), form=args.form,
                               max_num_seqs=MAX_NUM_SEQS, max_model_len=args.max_model_len,
                               **METHOD_OPTIONS[args.method])
    seconds = time.perf_counter() - start
    sizes = {p.name: p.stat().st_size for p in Path(out).iterdir() if p.is_file()}
    phases = json.loads((Path(out) / "manifest.json").read_text()).get("export_seconds")
    return {"export_s": round(seconds, 1), "export_phases_s": phases,
            "sizes_MB": {k: round(v / 2**20, 1) for k, v in sizes.items()}}


def role_first_token(args) -> dict:
    start = time.perf_counter()
    import torch

    import sparsecompile

    imported = time.perf_counter()
    llm = sparsecompile.load(args.dir)
    loaded = time.perf_counter()
    prompt = torch.randint(3, 128000, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([prompt], sparsecompile.SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    torch.cuda.synchronize()
    done = time.perf_counter()
    return {"import_s": round(imported - start, 2), "load_s": round(loaded - imported, 2),
            "first_token_s": round(done - loaded, 3), "load_to_first_token_s": round(done - imported, 2),
            "load_phases_s": llm.llm_engine.load_timings,
            "token": out[0].outputs[0].token_ids, "buckets_captured": sorted(
                llm.llm_engine.controller._compiled_decode.graphs)}


def role_decode_artifact(args) -> dict:
    import torch

    import sparsecompile

    sys.path.insert(0, str(HERE))
    from decode import _fill_synthetic, _profile, _timed_window

    from sparsecompile.kernels.argmax import first_argmax

    engine = sparsecompile.load(args.dir).llm_engine
    controller = engine.controller
    rows = controller.add_sequences(args.batch)
    _fill_synthetic(controller, rows, args.context)
    bucket = next(s for s in engine.graph_sizes if s >= args.batch)
    ids = torch.randint(3, 1000, (args.batch, 1), device="cuda")
    pos = torch.full((args.batch, 1), args.context, device="cuda", dtype=torch.long)

    def step():
        nonlocal ids
        logits = controller.decode(None, rows, ids, pos, pad_to=bucket)
        ids = first_argmax(logits[:, -1])[:, None]  # (what generate() samples with)
        pos.add_(1)

    step_s = _timed_window(step, args.warmup, args.steps) / args.steps
    if args.profile_dir:
        _profile(step, _profile_path(args, "artifact"))
    replayed = bucket in controller._compiled_decode.graphs
    controller.release_rows(rows)
    return {"tok_s": round(args.batch / step_s, 1), "step_ms": round(step_s * 1e3, 3), "graph_replay": replayed,
            "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)}


def role_decode_compiled(args) -> dict:
    sys.path.insert(0, str(HERE))
    from decode import METHOD_OPTIONS as DECODE_OPTIONS
    from decode import engine_point, weight_bytes

    DECODE_OPTIONS[args.method] = METHOD_OPTIONS[args.method]
    model = _model(args.layers)
    point = engine_point(model, args.method, args.context, args.batch, args.warmup, args.steps, weight_bytes(model),
                         1.0, _profile_path(args, "compiled") if args.profile_dir else None)
    return {"tok_s": round(point.tok_s, 1), "step_ms": round(point.step_ms, 3), "peak_GiB": round(point.peak_GiB, 1)}


def _profile_path(args, system: str) -> str:
    """Where a decode role writes its kernel table (``--profile-dir``): both systems side by side per point."""
    os.makedirs(args.profile_dir, exist_ok=True)
    return os.path.join(args.profile_dir, f"profile_{args.method}_{args.context // 1024}k_b{args.batch}_{system}.txt")


def role_tokens(args) -> dict:
    import torch

    import sparsecompile

    prompts = [torch.randint(3, 128000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (300, 1000, 2500)]
    params = sparsecompile.SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    artifact = sparsecompile.load(args.dir)
    got = [o.outputs[0].token_ids for o in artifact.generate(prompts, params, use_tqdm=False)]
    del artifact
    torch.cuda.empty_cache()
    llm = sparsecompile.LLM(_model(args.layers), args.method, tokenizer=_tokenizer(), max_num_seqs=MAX_NUM_SEQS,
                            max_model_len=args.max_model_len, **METHOD_OPTIONS[args.method])
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.token_ids for o in outs]
    same = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    # at each first difference, the compiled engine's gap between its two likeliest tokens (nats): a near tie
    # (random weights give nearly flat logits) flips under a different bf16 summation order
    gaps = []
    for out, index in zip(outs, same):
        ranked = out.logprobs[index].values() if index < len(out.token_ids) else []
        top = sorted((p.logprob for p in ranked), reverse=True)
        gaps.append(round(top[0] - top[1], 5) if len(top) > 1 else None)
    return {"equal": got == want, "first_difference": same, "top2_gap_at_difference": gaps, "tokens": len(want[0])}


ROLES = {"export": role_export, "first-token": role_first_token, "decode-artifact": role_decode_artifact,
         "decode-compiled": role_decode_compiled, "tokens": role_tokens}


# ------------------------------------------------------------------------------------------------- driver
def _subprocess(role: str, args, extra: list[str], env: dict, timeout: float) -> dict:
    cmd = [sys.executable, "-X", "faulthandler", __file__, "--role", role, "--layers", str(args.layers or 0),
           "--max-model-len", str(args.max_model_len), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--form", args.form, *(["--profile-dir", args.profile_dir] if args.profile_dir else []), *extra]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s", "wall_s": round(time.perf_counter() - start, 1)}
    result = next((json.loads(ln[7:]) for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode != 0 or result is None:
        tail = [ln for ln in done.stderr.strip().splitlines() if ln.strip()][-12:]
        return {"error": f"rc={done.returncode}: " + " | ".join(tail)[-1500:],
                "wall_s": round(time.perf_counter() - start, 1)}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="vanilla,snapkv,quest")
    parser.add_argument("--points", default="32768x1,131072x4", help="CONTEXTxBATCH decode points")
    parser.add_argument("--stages", default="export,first-token,decode,tokens")
    parser.add_argument("--quick", action="store_true", help="4 layers, one 32Kx1 point, 32 timed steps")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    parser.add_argument("--form", default="aoti", choices=["aoti", "exported"])
    parser.add_argument("--warm-cache", action="store_true", help="share one package cache between the exports")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=str(HERE / "results" / "export.jsonl"))
    parser.add_argument("--export-timeout", type=float, default=900)
    parser.add_argument("--profile-dir", default=None, help="decode: also write each system's top kernels here")
    parser.add_argument("--timeout", type=float, default=420)
    parser.add_argument("--role", default=None, choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--method", default="vanilla", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.points, args.steps = args.layers or 4, "32768x1", 32
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",") if p]
    args.max_model_len = args.max_model_len or max(c for c, _ in points) + args.warmup + args.steps + 64
    args.layers = args.layers or None
    if args.role:
        print("RESULT " + json.dumps(ROLES[args.role](args)), flush=True)
        return 0

    import torch

    if not torch.cuda.is_available():
        parser.exit(2, "benchmarks/export.py measures artifacts on a GPU; this machine has none\n")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sc-export-"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    stages = set(args.stages.split(","))
    shared_cache = str(workdir / "cache")

    def emit(row: dict) -> None:
        row = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "form": args.form,
               "layers": args.layers or 32, **row}
        rows.append(row)
        with open(args.out, "a") as sink:
            sink.write(json.dumps(row) + "\n")
        print(json.dumps(row)[:600], flush=True)

    for method in args.methods.split(","):
        artifact = workdir / method
        if "export" in stages:
            cache = shared_cache if args.warm_cache else str(workdir / f"cache-{method}")
            emit({"stage": "export", "method": method, **_subprocess(
                "export", args, ["--method", method, "--dir", str(artifact)],
                {**env, "SPARSECOMPILE_CACHE": cache}, args.export_timeout)})
        if not (artifact / "manifest.json").exists():
            continue
        if "first-token" in stages:
            cold = {**env, "TRITON_CACHE_DIR": str(workdir / f"triton-cold-{method}")}  # as on another machine
            emit({"stage": "first-token", "method": method,
                  **_subprocess("first-token", args, ["--dir", str(artifact)], cold, args.timeout)})
        if "decode" in stages:
            for context, batch in points:
                extra = ["--method", method, "--dir", str(artifact), "--context", str(context), "--batch", str(batch)]
                for system in ("artifact", "compiled"):
                    emit({"stage": "decode", "system": system, "method": method, "context": context, "batch": batch,
                          **_subprocess(f"decode-{system}", args, extra, env, args.timeout)})
        if "tokens" in stages:
            emit({"stage": "tokens", "method": method,
                  **_subprocess("tokens", args, ["--method", method, "--dir", str(artifact)], env, args.timeout)})
    _table(rows, points)
    return 0


def _table(rows: list[dict], points: list[tuple[int, int]]) -> None:
    def find(stage, method, **keys):
        return next((r for r in rows if r["stage"] == stage and r["method"] == method
                     and all(r.get(k) == v for k, v in keys.items())), {})

    heads = ["method", "export s", "load s", "1st tok s", "load->tok s"]
    heads += [f"{c // 1024}Kx{b} art/comp tok/s" for c, b in points] + ["tokens equal"]
    print("\n" + " | ".join(heads))
    for method in dict.fromkeys(r["method"] for r in rows):
        e, f, t = find("export", method), find("first-token", method), find("tokens", method)
        cells = [method, e.get("export_s", e.get("error", "-")), f.get("load_s", f.get("error", "-")),
                 f.get("first_token_s", "-"), f.get("load_to_first_token_s", "-")]
        for context, batch in points:
            a = find("decode", method, system="artifact", context=context, batch=batch)
            c = find("decode", method, system="compiled", context=context, batch=batch)
            if "tok_s" in a and "tok_s" in c:
                cells.append(f"{a['tok_s']} / {c['tok_s']} ({100 * a['tok_s'] / c['tok_s']:.1f} %)")
            else:
                cells.append(str(a.get("error") or c.get("error") or "-")[:60])
        cells.append(t.get("equal", t.get("error", "-")) if t else "-")
        print(" | ".join(str(c)[:80] for c in cells))


if __name__ == "__main__":
    sys.exit(main())
