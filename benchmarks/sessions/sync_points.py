"""Where a prefill synchronises the host with the GPU (issue #13: h2o's 32K prefill spends ~200 ms off the GPU).

    python benchmarks/sessions/sync_points.py [--method h2o] [--context 32768] > sync_points_h2o.txt

One warm call at 4,096 tokens, then one ``generate(max_new_tokens=1)`` at ``--context`` under
``torch.cuda.set_sync_debug_mode("warn")``: every synchronising CUDA call warns; each distinct call site (the
innermost sparsecompile / transformers frames of its stack) is printed with its count, most frequent first.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from prefill import Bench, _generate, parse_args, row_method  # noqa: E402

import sparsecompile  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="h2o")
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    bench = Bench(parse_args(["--contexts", str(args.context), "--batches", "1"]))
    name, options = row_method(args.method)
    sparsecompile.optimize(bench.model, name, **options)
    _generate(bench.model, bench.ids(1, 4096, seed=1), 1)
    ids = bench.ids(1, args.context)
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "sparsecompile" in f.filename
                  or "transformers" in f.filename]
        sites[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-4:][::-1])] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        _generate(bench.model, ids, 1)
        torch.cuda.set_sync_debug_mode(0)
    print(f"{args.method} {args.context}: {sum(sites.values())} synchronising calls at {len(sites)} sites")
    for site, count in sites.most_common():
        print(f"{count:6d}  {site}")


if __name__ == "__main__":
    main()
