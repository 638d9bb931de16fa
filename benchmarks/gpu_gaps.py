"""Where the GPU idles during one call: the host-side gaps of a ``generate()`` (issue #13: our 32K prefill runs the
same kernel time as HF's forward, 1.36 s, but takes 1.46-1.51 s of wall time).

    python benchmarks/gpu_gaps.py [--method vanilla] [--context 32768] [--chunk N] [--new-tokens 1] [--out DIR]
    python benchmarks/gpu_gaps.py --tiny --layers 2 --device cpu --context 256      (CPU smoke run: no GPU gaps)

After two warm calls at the timed length, one ``optimize(...)`` + ``generate(max_new_tokens=N)`` runs under
``torch.profiler``; from its Chrome trace: the wall span, the time the GPU runs kernels, the idle time before the
first kernel, between kernels and after the last, and each gap over ``--min-gap-ms`` with the host ops (the
outermost ``cpu_op`` / Python events) that overlap it. Written to ``gpu_gaps_<method>_<context>.txt`` under ``--out``;
with ``--hf``, the unpatched ``model(ids, logits_to_keep=1)`` the same way for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import METHOD_OPTIONS  # noqa: E402
from generate_profile import _generate  # noqa: E402
from serving import make_model  # noqa: E402

import sparsecompile  # noqa: E402


def trace_of(fn: Callable[[], Any], cuda: bool) -> tuple[list[dict], float]:
    """Run ``fn`` under the profiler; its Chrome-trace events and its wall seconds."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            events = json.load(g)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e], wall


def gaps_report(events: list[dict], wall: float, min_gap_ms: float) -> str:
    """Idle GPU time of one traced call: totals, and the gaps over ``min_gap_ms`` with the host ops inside them."""
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                           "gpu_memset"))
    host = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    if not host:
        return "no host events traced\n"
    t0, t1 = min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host + [{"ts": k[1], "dur": 0}
                                                                                    for k in kernels])
    lines = [f"wall {wall * 1e3:.1f} ms (traced span {(t1 - t0) / 1e3:.1f} ms), {len(kernels)} GPU activities"]
    if not kernels:
        return "\n".join(lines + ["no GPU activity (CPU run)"]) + "\n"
    busy, gaps, end = 0.0, [], t0
    for start, stop in kernels:
        if start > end:
            gaps.append((end, start))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    gaps.append((end, t1))
    idle = sum(b - a for a, b in gaps)
    lines.append(f"GPU busy {busy / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms: before the first kernel "
                 f"{(kernels[0][0] - t0) / 1e3:.1f} ms, after the last {(t1 - end) / 1e3:.1f} ms")
    lines.append(f"gaps over {min_gap_ms} ms (start offset, length, host events overlapping it by total time):")
    for a, b in gaps:
        if b - a < min_gap_ms * 1e3:
            continue
        inside: Counter[str] = Counter()
        for e in host:
            overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
            if overlap > 0:
                inside[e["name"][:80]] += overlap
        top = "; ".join(f"{name} {us / 1e3:.1f}" for name, us in inside.most_common(8))
        lines.append(f"  +{(a - t0) / 1e3:8.1f} ms  {(b - a) / 1e3:7.1f} ms  {top}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="vanilla")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=1)
    parser.add_argument("--min-gap-ms", type=float, default=1.0)
    parser.add_argument("--hf", action="store_true", help="also trace the unpatched forward")
    parser.add_argument("--chunk", type=int, default=None,
                        help="prefill_chunk_size (0: the whole prompt; default: the method's own, e.g. h2o's 8192)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    model = make_model(args.layers, args.tiny, args.device)
    ids = torch.randint(3, 1000, (1, args.context), device=args.device)
    reports = []
    if args.hf:
        def forward() -> None:
            with torch.no_grad():
                model(ids, logits_to_keep=1)
        forward(), forward()
        reports.append("## HF forward\n" + gaps_report(*trace_of(forward, cuda), args.min_gap_ms))
    chunk = {} if args.chunk is None else {"prefill_chunk_size": args.chunk}
    sparsecompile.optimize(model, args.method, **chunk, **METHOD_OPTIONS[args.method])

    def generate() -> None:
        _generate(model, ids, args.new_tokens)
    generate(), generate()
    reports.append(f"## optimize({args.method}) + generate(max_new_tokens={args.new_tokens})\n"
                   + gaps_report(*trace_of(generate, cuda), args.min_gap_ms))
    text = f"# GPU gaps, context {args.context}, {args.device}\n" + "\n".join(reports)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_gaps_{args.method}_{args.context}.txt"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
