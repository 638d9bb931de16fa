"""Host cost of a serving step that carries a prompt chunk: dispatched ops by source, and wall time (issue #13).

    python benchmarks/step_ops.py [--method vanilla] [--layers 32] [--chunk 256] [--running 8] [--compile-prefill]

On the H200 a step with a 256- or 512-token prompt chunk beside 8 decodes took ~72 ms whatever the chunk size: the
host's per-op cost bounds it. This script counts, on any device (a tiny Llama with ``--layers`` layers, so compute
is small and the count is what matters), the aten / custom ops one mixed step dispatches (``TorchDispatchMode``),
grouped by the innermost sparsecompile or transformers function that issued them, then times mixed steps (median of
``--steps``). With ``--compile-prefill`` the step's forward is compiled (``ServingConfig.compile_prefill``) and
only the wall time is taken: under a ``TorchDispatchMode`` dynamo runs compiled functions eagerly, so a count would
be the eager forward's. Prints a table; ``--out`` appends one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
import time
import traceback

import numpy as np
import torch

if not torch.cuda.is_available():  # CPU runs: Triton kernels must be interpreted (set before they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import METHOD_OPTIONS  # noqa: E402
from serving import StubTokenizer, make_model  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from sparsecompile import LLM, SamplingParams  # noqa: E402


class OpsBySource(TorchDispatchMode):
    """Counts dispatched ops by the innermost sparsecompile / transformers frame that issued them."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack(limit=40)
                  if "/sparsecompile/" in f.filename or "/transformers/" in f.filename]
        self.counts[f"{os.path.basename(frames[-1].filename)}:{frames[-1].name}" if frames else "other"] += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="vanilla")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=256, help="prompt tokens a mixed step carries")
    parser.add_argument("--running", type=int, default=8, help="decoding streams")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile-prefill", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--profile", type=int, default=0, help="also cProfile this many steps (top functions)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    model = make_model(args.layers, True, args.device)
    llm = LLM(model, args.method, tokenizer=StubTokenizer(), max_num_seqs=args.running + 64,
              max_num_batched_tokens=8192, max_prefill_tokens_while_decoding=args.chunk,
              compile_prefill=args.compile_prefill, compile=args.device == "cuda",
              cuda_graphs=args.device == "cuda", **METHOD_OPTIONS[args.method])
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(3, 1000, n).tolist()  # noqa: E731
    for i in range(args.running):
        engine.add_request(f"run-{i}", prompt(4 * args.chunk), SamplingParams(max_tokens=100000, ignore_eos=True,
                                                                              temperature=0, output_kind="delta"))
    for _ in range(4 * args.running):  # every stream past its prompt
        engine.step()
    for i in range(64):  # enough prompt chunks for every timed step
        engine.add_request(f"new-{i}", prompt(2 * args.chunk), SamplingParams(max_tokens=1, temperature=0))
    engine.step()  # the first mixed step (compiles with --compile-prefill)
    ops = OpsBySource()
    if not args.compile_prefill:  # (a dispatch mode would run the compiled forward eagerly: module docstring)
        with ops:
            engine.step()

    def timed() -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step_ms = 1e3 * float(np.median([timed() for _ in range(args.steps)]))
    if args.profile:  # where the host time of a step goes, by function (own time, then with callees)
        profile = cProfile.Profile()
        profile.runcall(lambda: [timed() for _ in range(args.profile)])
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
    row = {"method": args.method, "layers": args.layers, "chunk": args.chunk, "running": args.running,
           "compile_prefill": args.compile_prefill, "device": args.device,
           "ops": None if args.compile_prefill else sum(ops.counts.values()),
           "mixed_step_ms": round(step_ms, 2), "by_source": dict(ops.counts.most_common(12))}
    count = "(not counted)" if row["ops"] is None else row["ops"]
    print(f"{count} ops per mixed step, median {step_ms:.1f} ms ({args.device}, {args.layers} layers, "
          f"{args.running} decodes + {args.chunk} prompt tokens, compile_prefill={args.compile_prefill})")
    for source, count in ops.counts.most_common(12):
        print(f"  {count:6d}  {source}")
    if args.out:
        with open(args.out, "a") as sink:
            sink.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
