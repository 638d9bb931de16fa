"""Where a decode step's host time goes in ``generate()`` (issue #14: generate_tok_s below engine_tok_s).

    python benchmarks/generate_profile.py [--method snapkv] [--context 32768] [--batch 1] [--out DIR]
    python benchmarks/generate_profile.py --tiny --device cpu --context 512 ...          (CPU smoke run)

After two warm calls, one ``generate(N tokens)`` runs under ``torch.profiler`` (CPU and CUDA activities) and one
under ``cProfile``. Written to ``generate_profile_<method>.txt`` under ``--out``: the wall time per decode step,
the profiler's ops by self CPU time (dynamo's guard evaluation shows as "TorchDynamo Cache Lookup", the compiled
step as "Torch-Compiled Region", CUDA-graph replays as ``cudaGraphLaunch``), and the Python functions by own
time. When the host is slower than the GPU (a small KV: eviction methods at budget 2048), the host time per step
is the step time: these tables say which part of the loop to cut.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import METHOD_OPTIONS  # noqa: E402
from serving import make_model  # noqa: E402

import sparsecompile  # noqa: E402


def _generate(model, ids: torch.Tensor, new_tokens: int) -> float:
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=65)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    model = make_model(args.layers, args.tiny, args.device)
    options = dict(METHOD_OPTIONS[args.method])
    if args.tiny:  # budgets of the tiny smoke run stay below its prompt
        options = {k: min(v, args.context // 4) if k == "budget" else v for k, v in options.items()}
    sparsecompile.optimize(model, args.method, **options)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (args.batch, args.context), generator=g).to(args.device)
    n = args.new_tokens
    _generate(model, ids, n)  # compile, capture
    one, full = _generate(model, ids, 1), _generate(model, ids, n)
    step_ms = (full - one) / (n - 1) * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _generate(model, ids, n)
    sort = "self_cpu_time_total"
    ops = prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=70)
    profiler = cProfile.Profile()
    profiler.enable()
    _generate(model, ids, n)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"generate_profile_{args.method}.txt")
    with open(path, "w") as handle:
        handle.write(f"{args.method} {args.context}x{args.batch}, {n} new tokens on {args.device}: "
                     f"generate {full:.3f} s, one token {one:.3f} s, {step_ms:.3f} ms per decode step "
                     f"({args.batch * 1e3 / step_ms:.1f} tok/s)\n\n")
        handle.write(f"torch.profiler, one generate({n}), sorted by {sort} (it includes the prefill):\n{ops}\n\n")
        handle.write(f"cProfile, one generate({n}), by own time:\n{text.getvalue()}")
    print(f"{args.method}: {step_ms:.3f} ms per decode step; tables in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
