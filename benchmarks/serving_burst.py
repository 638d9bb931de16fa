"""Inter-token latency of running streams while a burst of new prompts arrives (issue #13, item 6).

    python benchmarks/serving_burst.py [--method vanilla] [--running 8] [--burst 64] [--prompt 1024] [--out DIR]
    python benchmarks/serving_burst.py --device cpu --tiny ...                     (CPU smoke run)

``--running`` requests with ``--prompt``-token prompts decode steadily (greedy, ``ignore_eos``); then ``--burst``
new prompts of the same length arrive at once, with ``max_num_batched_tokens`` (``--budget``, default 8192) per
engine step. Each running stream's inter-token gaps are recorded from the engine's step outputs: p50 over the
steady window, p50 / p99 while the burst is being prefilled (until every burst request has its first token).
Modes in the same invocation, on the same model and engine options:

* ``mixed``: today's engine: a step's decode tokens and all its prompt chunks run in one forward
  (``enable_mixed_chunk``, the default), chunks of similar lengths padded together;
* ``separate``: ``enable_mixed_chunk=False``: one forward for the decodes, then one per group of chunks (the engine
  before the mixed step);
* ``per_chunk``: ``separate`` with one forward per prompt chunk (``serving.engine.pack_chunks`` patched to singleton
  groups), the engine before chunks were batched;
* ``capped`` / ``capped_separate``: ``mixed`` / ``separate`` with ``max_prefill_tokens_while_decoding`` =
  ``--while-decoding`` (default 512): steps that decode carry at most that many prompt tokens (the burst's prefill
  then takes longer: ``burst_s``);
* ``compiled``: ``capped`` with ``compile_prefill`` (the mixed step's forward compiled, attention layers opaque ops:
  ``models/compiled_forward.py``); one warm-up request before the steady window compiles the mixed step's variant.
* ``replayed`` / ``replayed_compiled``: ``capped`` / ``compiled`` with mixed steps recorded as CUDA graphs and
  replayed (``mixed_cuda_graphs``, ``runtime/mixed_graphs.py``); the warm-up request's two chunks run the burst's
  step shape once eagerly and record it (as a server's first steps of that shape would). Every other mode runs with
  ``mixed_cuda_graphs=False`` (the engine before replays).

Target (issue #13): running streams' p99 during a burst of 64 new 1K-token prompts <= 3x their steady p50.
Results: ``serving_burst<TAG>.jsonl`` under ``--out``, a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

if not torch.cuda.is_available():  # CPU smoke runs: Triton kernels must be interpreted (set before they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import METHOD_OPTIONS  # noqa: E402
from serving import StubTokenizer, make_model  # noqa: E402

import sparsecompile  # noqa: E402
import sparsecompile.serving.engine as engine_module  # noqa: E402
from sparsecompile import LLM, SamplingParams  # noqa: E402


def _gaps(times: dict[str, list[float]], start: float, stop: float) -> list[float]:
    """Inter-token gaps of every stream whose later token fell in ``[start, stop)``."""
    out = []
    for stamps in times.values():
        out += [b - a for a, b in zip(stamps, stamps[1:]) if start <= b < stop]
    return out


class TimedReplays:
    """Wraps a recorder: each replay of a recorded mixed step is bracketed by CUDA events, so the row can say how
    much of a burst step is the graph's GPU time and how much the host's work around it."""

    def __init__(self, recorder) -> None:
        self.recorder, self.events = recorder, []

    def record(self, fn):
        replay = self.recorder.record(fn)

        def timed():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = replay()
            stop.record()
            self.events.append((start, stop))
            return out

        return timed

    def gpu_ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [start.elapsed_time(stop) for start, stop in self.events]


def run_mode(model, args: argparse.Namespace, mode: str) -> dict:
    original = engine_module.pack_chunks
    if mode == "per_chunk":
        engine_module.pack_chunks = lambda chunks, _budget: [[c] for c in chunks]
    capped = ({"max_prefill_tokens_while_decoding": args.while_decoding}
              if mode.startswith(("capped", "replayed")) or mode == "compiled" else {})
    mixed = mode in ("mixed", "capped", "compiled", "replayed", "replayed_compiled")
    compiled = mode in ("compiled", "replayed_compiled")
    llm = LLM(model, args.method, tokenizer=StubTokenizer(), max_num_seqs=args.running + args.burst, **capped,
              enable_mixed_chunk=mixed, compile_prefill=compiled, mixed_cuda_graphs=mode.startswith("replayed"),
              max_num_batched_tokens=args.budget, compile=args.device == "cuda", cuda_graphs=args.device == "cuda",
              cuda_graph_sizes=[args.running],  # only the running streams decode (a burst request stops at 1 token)
              **METHOD_OPTIONS[args.method])
    engine = llm.llm_engine
    timed = None
    if engine.controller.mixed_replays is not None and args.device == "cuda":
        timed = engine.controller.mixed_replays.recorder = TimedReplays(engine.controller.mixed_replays.recorder)
    try:
        rng = np.random.default_rng(0)
        prompt = lambda: rng.integers(3, 1000, args.prompt).tolist()  # noqa: E731
        times: dict[str, list[float]] = {}
        # the running streams report their deltas, as the server's streams do (no growing copy every step)
        long = SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0, output_kind="delta")
        for i in range(args.running):
            engine.add_request(f"run-{i}", prompt(), long)
            times[f"run-{i}"] = []

        def step() -> list:
            outs = engine.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            for out in outs:
                if out.request_id in times and out.outputs[0].delta_token_ids:
                    times[out.request_id].append(now)
            return outs

        while any(len(t) < 2 for t in times.values()):  # every running stream is decoding
            step()
        if compiled or mode.startswith("replayed"):  # compile / record the mixed step before anything is timed
            engine.add_request("warm-up", prompt(), SamplingParams(max_tokens=1, temperature=0))
            while "warm-up" not in {o.request_id for o in step()}:
                pass
        steady_start = time.perf_counter()
        for _ in range(args.steady_steps):
            step()
        burst_start = time.perf_counter()
        replays_before = len(timed.events) if timed else 0
        first = set()
        for i in range(args.burst):
            engine.add_request(f"burst-{i}", prompt(), SamplingParams(max_tokens=1, temperature=0))
        while len(first) < args.burst:
            first.update(o.request_id for o in step() if o.request_id.startswith("burst-"))
        burst_stop = time.perf_counter()
        steady = _gaps(times, steady_start, burst_start)
        burst = _gaps(times, burst_start, burst_stop)
        row = {"mode": mode, "method": args.method, "running": args.running, "burst": args.burst,
               "enable_mixed_chunk": mixed, "compile_prefill": compiled,
               "replayed_steps": getattr(engine.controller.mixed_replays, "replayed", 0),
               "max_prefill_tokens_while_decoding": capped.get("max_prefill_tokens_while_decoding"),
               "prompt": args.prompt, "budget": args.budget, "steady_p50_ms": 1e3 * float(np.median(steady)),
               "burst_p50_ms": 1e3 * float(np.median(burst)), "burst_p99_ms": 1e3 * float(np.percentile(burst, 99)),
               "burst_s": burst_stop - burst_start}
        row["p99_over_steady_p50"] = row["burst_p99_ms"] / row["steady_p50_ms"]
        if timed is not None:  # GPU time of the burst's replayed steps (the rest of a step is host work)
            gpu = timed.gpu_ms()[replays_before:]
            row.update(replay_gpu_p50_ms=float(np.median(gpu)) if gpu else None,
                       replay_gpu_p99_ms=float(np.percentile(gpu, 99)) if gpu else None)
        return row
    finally:
        for request_id in list(times):
            engine.abort_request(request_id)
        engine.step()
        engine_module.pack_chunks = original
        sparsecompile.restore(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="vanilla")
    parser.add_argument("--running", type=int, default=8)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--steady-steps", type=int, default=32)
    parser.add_argument("--modes", default="separate,mixed,capped,capped_separate,compiled,replayed,replayed_compiled",
                        help="per_chunk, separate, mixed, capped, capped_separate, compiled, replayed, "
                             "replayed_compiled")
    parser.add_argument("--while-decoding", type=int, default=512, help="the capped mode's prompt tokens per step")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    model = make_model(args.layers, args.tiny, args.device)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with open(os.path.join(args.out, f"serving_burst{args.tag}.jsonl"), "w") as handle:
        for mode in args.modes.split(","):  # a row per mode as it ends: a run cut short keeps the modes it finished
            rows.append(run_mode(model, args, mode))
            handle.write(json.dumps(rows[-1]) + "\n")
            handle.flush()
    print(f"{'mode':>15} {'steady p50 ms':>14} {'burst p50 ms':>13} {'burst p99 ms':>13} {'p99/p50':>8} "
          f"{'burst s':>8}")
    for r in rows:
        print(f"{r['mode']:>15} {r['steady_p50_ms']:14.1f} {r['burst_p50_ms']:13.1f} {r['burst_p99_ms']:13.1f} "
              f"{r['p99_over_steady_p50']:8.2f} {r['burst_s']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
