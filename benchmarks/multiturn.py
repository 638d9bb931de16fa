"""Multi-turn agent serving: chain cache and prefix cache against recomputing every turn.

    python benchmarks/multiturn.py [--methods vanilla,snapkv,h2o,quest] [--quick] [--out results/multiturn.jsonl]
    python benchmarks/multiturn.py --tiny --device cpu --conversations 2 --turns 2 ...      (CPU smoke run)

The trace is synthetic and seeded, shaped like an agent loop: ``--conversations`` sessions run at once; each starts
with a ``--first-prompt``-token task, then for ``--turns`` turns the model answers (``--min-output`` to
``--max-output`` tokens, greedy, ``ignore_eos``), a tool "runs" (a wait uniform in ``--tool-wait``, during which
the session holds no request) and its result (``--min-tool`` to ``--max-tool`` random tokens) is appended: the
next turn's prompt is the whole history, previous output included. Every arm replays the same trace.

Arms, per method (one ``LLM`` per method, its decode compiled once; the arms run one after the other on it):

* ``none``: every turn's prompt is prefilled from scratch (what a server without reuse does);
* ``chain``: each session passes its ``chain_id``: the idle KV (compressed, for eviction methods) is reattached and
  only the new tokens are prefilled;
* ``prefix``: ``enable_prefix_caching`` (methods that keep every token): full pages of the history are shared;
* ``prune`` (eviction methods): ``chain``, and when a tool result arrives, the one from ``--prune-lag`` turns ago
  is pruned to ``--prune-ratio`` of its tokens with KVzip scoring (``LLM.prune``; page-aligned inside the result).

Reported per arm: end-to-end time, prompt tokens computed (prefill work) against the trace's logical prompt
tokens, KV pages in use at the peak (all of them, and without idle reusable state), on average over time and as a
timeline (``pages_timeline``: up to 200 ``[seconds, pages]`` samples, plotted next to ``--out`` as a PNG), turn
latency and TTFT, chain / prefix hits, preemptions, prunes (count, seconds, pages freed). JSON lines go to
``--out`` (a header, then one row per arm); a table is printed last, with each arm's speedup over
``vanilla``/``none`` and ``vanilla``/``prefix``. Each arm runs in try/except (an error is
recorded in its row) and stops at ``--arm-timeout`` seconds (recorded as ``timed_out``).

``--kvzip-cost 8192,32768``: before the arms, the prefill (time to first token, ``model(ids, logits_to_keep=1)``
after ``optimize``) of one prompt of each length for ``vanilla``, ``snapkv`` and ``kvzip`` (ratio 0.3, its
reconstruction passes included): rows ``{"kvzip_cost": ...}`` and a second table.

Model: the Llama-3.1-8B shape with random bf16 weights on CUDA (``decode.build_model``), or ``--tiny`` on CPU.
Sizing on one H200: the default trace (32 x 8 turns of 2K-8K tool tokens) recomputes ~10M prompt tokens without
reuse and does not fit a few minutes; ``--quick`` (16 sessions x 6 turns, 1K-4K tool tokens, outputs up to 128)
runs the eight default arms in about 6-8 minutes.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiturn_plot import plot_pages  # noqa: E402
from serving import StubTokenizer, make_model  # noqa: E402

import sparsecompile  # noqa: E402
from sparsecompile import LLM, SamplingParams  # noqa: E402
from sparsecompile.serving.prune import PruneRejected, PruneSpec  # noqa: E402

GiB = 2**30
DEFAULT_ARMS = {"vanilla": "none,prefix", "quest": "none,prefix", "omnikv": "none,prefix",
                "snapkv": "none,chain,prune",
                "pyramidkv": "none,chain", "h2o": "none,chain", "streamingllm": "none,chain"}
METHOD_OPTIONS = {"vanilla": {}, "quest": {"budget": 2048}, "omnikv": {"budget": 2048}, "snapkv": {"budget": 2048},
                  "pyramidkv": {"budget": 2048}, "h2o": {"budget": 2048}, "streamingllm": {"budget": 2048}}
QUICK = dict(conversations=16, turns=6, min_tool=1024, max_tool=4096, min_output=32, max_output=128,
             first_prompt=512, tool_wait="0.1,0.5")
DEFAULTS = dict(conversations=32, turns=8, min_tool=2048, max_tool=8192, min_output=32, max_output=256,
                first_prompt=1024, tool_wait="0.2,1.0")


@dataclass
class Session:
    """One conversation of the trace: its task, tool results and output lengths (seeded), and its history so far."""

    index: int
    tools: list[list[int]]
    outputs: list[int]
    history: list[int] = field(default_factory=list)
    turn: int = 0
    spans: list[tuple[int, int]] = field(default_factory=list)  # positions of each tool result in the history


def make_trace(args: argparse.Namespace) -> list[Session]:
    rng = np.random.default_rng(args.seed)
    sessions = []
    for i in range(args.conversations):
        first = rng.integers(3, 1000, args.first_prompt).tolist()
        tools = [rng.integers(3, 1000, int(rng.integers(args.min_tool, args.max_tool + 1))).tolist()
                 for _ in range(args.turns)]
        tools[0] = first + tools[0]  # the task, then the first tool result
        outputs = [int(n) for n in rng.integers(args.min_output, args.max_output + 1, args.turns)]
        sessions.append(Session(i, tools, outputs))
    return sessions


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_arm(llm: LLM, method: str, arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """Replay the trace through ``llm``'s engine under ``arm``; returns its row."""
    engine = llm.llm_engine
    engine.release_idle()
    engine.reuse.set_prefix_caching(arm == "prefix")
    sessions = make_trace(args)
    rng = np.random.default_rng(args.seed + 1)
    low, high = (float(x) for x in args.tool_wait.split(","))
    before = engine.stats()
    total = before.total_pages
    ready: list[tuple[float, int]] = [(0.0, s.index) for s in sessions]  # (arrival offset, session)
    heapq.heapify(ready)
    live: dict[str, tuple[Session, float]] = {}
    latencies, ttfts, logical_prompt = [], [], 0
    peak_used = peak_active = 0
    page_seconds, last_sample = 0.0, None  # pages in use integrated over time
    timeline: list[tuple[float, int]] = []  # (seconds since the start, pages in use) after every engine step
    prunes = {"count": 0, "seconds": 0.0, "freed_pages": 0, "rejected": 0}
    page = engine.manager.layout.page_size
    _sync(args.device)
    start = time.monotonic()
    deadline = start + args.arm_timeout if args.arm_timeout else None
    timed_out = False
    while ready or live:
        now = time.monotonic() - start
        while ready and ready[0][0] <= now:
            _, index = heapq.heappop(ready)
            s = sessions[index]
            if arm == "prune" and s.turn >= args.prune_lag:
                _prune(llm, s, s.spans[s.turn - args.prune_lag], page, args.prune_ratio, prunes)
            s.spans.append((len(s.history), len(s.history) + len(s.tools[s.turn])))
            s.history = s.history + s.tools[s.turn]
            logical_prompt += len(s.history)
            request_id = f"{method}-{arm}-{s.index}-{s.turn}"
            params = SamplingParams(temperature=0, max_tokens=s.outputs[s.turn], ignore_eos=True,
                                    output_kind="final_only")
            engine.add_request(request_id, list(s.history), params,
                               **({"chain_id": f"s{s.index}"} if arm in ("chain", "prune") else {}))
            live[request_id] = (s, time.monotonic())
        if not live:
            time.sleep(max(0.0, min(ready[0][0] - now, 0.05)))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            s, arrival = live.pop(out.request_id)
            done = time.monotonic()
            latencies.append(done - arrival)
            if out.metrics.first_token_time is not None:
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
            s.history = s.history + out.outputs[0].token_ids
            s.turn += 1
            if s.turn < len(s.tools):
                heapq.heappush(ready, (done - start + float(rng.uniform(low, high)), s.index))
        stats = engine.stats()
        used = total - stats.free_pages
        now = time.monotonic()
        if last_sample is not None:
            page_seconds += (now - last_sample[0]) * last_sample[1]
        last_sample = (now, used)
        timeline.append((now - start, used))
        peak_used = max(peak_used, used)
        peak_active = max(peak_active, used - stats.reuse.reclaimable_pages)
        if deadline is not None and time.monotonic() > deadline:
            timed_out = True
            for request_id in list(live):
                engine.abort_request(request_id)
            engine.step()
            break
    _sync(args.device)
    wall = time.monotonic() - start
    after = engine.stats()
    page_bytes = engine.manager.bytes_per_page
    r = after.reuse
    row = dict(method=method, arm=arm, options=options_of(method, args), wall_s=wall, timed_out=timed_out,
               turns_done=sum(s.turn for s in sessions), turns=args.conversations * args.turns,
               prompt_tokens_logical=logical_prompt, prefill_tokens=after.prompt_tokens - before.prompt_tokens,
               generated_tokens=after.generation_tokens - before.generation_tokens,
               peak_pages_used=peak_used, peak_pages_active=peak_active, pool_pages=total,
               peak_GiB_used=peak_used * page_bytes / GiB, peak_GiB_active=peak_active * page_bytes / GiB,
               mean_pages_used=page_seconds / wall if wall else 0.0,
               mean_GiB_used=page_seconds / wall * page_bytes / GiB if wall else 0.0,
               prunes=prunes["count"], prune_s=prunes["seconds"], prune_freed_pages=prunes["freed_pages"],
               prunes_rejected=prunes["rejected"],
               preemptions=after.num_preemptions - before.num_preemptions,
               chain_hits=r.chain_hits - before.reuse.chain_hits,
               chain_misses={k: v - before.reuse.chain_misses.get(k, 0) for k, v in r.chain_misses.items()},
               chains_reclaimed=r.chains_reclaimed - before.reuse.chains_reclaimed,
               prefix_hit_tokens=r.prefix.hits if arm == "prefix" else 0,
               pages_timeline=[[round(t, 3), n] for t, n in timeline[::max(1, len(timeline) // 200)]])
    for name, values in (("turn_latency", latencies), ("ttft", ttfts)):
        a = np.asarray(values) if values else np.zeros(1)
        row.update({f"{name}_mean_s": float(a.mean()), f"{name}_p50_s": float(np.percentile(a, 50)),
                    f"{name}_p99_s": float(np.percentile(a, 99))})
    engine.release_idle()
    return row


def options_of(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """The method's benchmark options, with ``--budget`` in place of its budget (methods that take one)."""
    options = dict(METHOD_OPTIONS.get(method, {}))
    if args.budget is not None and "budget" in options:
        options["budget"] = args.budget
    return options


def _prune(llm: LLM, s: Session, span: tuple[int, int], page: int, ratio: float, prunes: dict) -> None:
    """Prune a tool result of session ``s``'s idle chain (its pages inside the result) to ``ratio`` with KVzip."""
    lo, hi = -(-span[0] // page) * page, span[1] // page * page
    if hi <= lo:
        return
    start = time.perf_counter()
    try:
        result = llm.llm_engine.prune(PruneSpec([(lo, hi)], int(ratio * (hi - lo)), "kvzip", chain_id=f"s{s.index}"))
    except PruneRejected:  # e.g. the chain was reclaimed for memory: nothing to prune
        prunes["rejected"] += 1
        return
    prunes["count"] += 1
    prunes["seconds"] += time.perf_counter() - start
    prunes["freed_pages"] += result.freed_pages


def method_rows(model: torch.nn.Module, method: str, arms: list[str], args: argparse.Namespace) -> list[dict]:
    """One LLM for ``method`` (warmed up: compile and prefill kernels), then each arm; errors go into the rows."""
    compiled = args.device == "cuda"
    rows = []
    try:
        start = time.perf_counter()
        longest = min(args.first_prompt + args.turns * (args.max_tool + args.max_output) + 16,
                      model.config.max_position_embeddings)
        llm = LLM(model, method, tokenizer=StubTokenizer(), max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
                  max_model_len=longest, cuda_graph_sizes=[args.max_num_seqs], compile=compiled,
                  cuda_graphs=compiled, prefill_chunk_size=args.chunk, max_idle_chains=args.conversations,
                  **options_of(method, args))
        warm = [[3 + i % 997 for i in range(min(longest - 8, args.chunk + 64))], [5] * 16]
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        _sync(args.device)
        warmup = time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - recorded; the other methods go on
        return [dict(method=method, arm=arm, error=f"setup: {err!r}") for arm in arms]
    for arm in arms:
        try:
            if arm == "prefix" and not llm.llm_engine.controller.runtime.keeps_all_tokens:
                raise ValueError(f"{method} evicts: no prefix cache")
            row = run_arm(llm, method, arm, args)
        except Exception as err:  # noqa: BLE001
            row = dict(method=method, arm=arm, error=repr(err))
            try:
                llm.llm_engine.release_idle()
            except Exception:  # noqa: BLE001
                pass
        row["warmup_s"] = warmup
        rows.append(row)
    del llm
    sparsecompile.restore(model)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def kvzip_cost(model: torch.nn.Module, contexts: list[int], args: argparse.Namespace) -> list[dict]:
    """Prefill seconds of one prompt per context for vanilla, snapkv and kvzip (after a warm-up at that length)."""
    rows = []
    for method, options in (("vanilla", {}), ("snapkv", {"budget": 2048}), ("kvzip", {"ratio": 0.3})):
        for context in contexts:
            row = {"kvzip_cost": True, "method": method, "options": options, "context": context}
            try:
                sparsecompile.optimize(model, method, compile=False, prefill_chunk_size=args.chunk, **options)
                for n in (context, context):  # warm-up at the timed length (eviction kernels JIT-compile), then timed
                    ids = torch.randint(3, 1000, (1, n), device=args.device)
                    _sync(args.device)
                    start = time.perf_counter()
                    out = model(input_ids=ids, logits_to_keep=1)
                    _sync(args.device)
                    seconds = time.perf_counter() - start
                    (out["cache"] if "cache" in out else out["past_key_values"]).release()
                row["seconds"] = seconds
            except Exception as err:  # noqa: BLE001 - recorded (e.g. out of memory); the others go on
                row["error"] = repr(err)
            sparsecompile.restore(model)
            gc.collect()
            rows.append(row)
    base = {r["context"]: r.get("seconds") for r in rows if r["method"] == "vanilla"}
    for r in rows:
        if r.get("seconds") and base.get(r["context"]):
            r["vs_vanilla"] = r["seconds"] / base[r["context"]]
    return rows


def table(rows: list[dict], header: dict) -> str:
    base = {arm: next((r for r in rows if r["method"] == "vanilla" and r.get("arm") == arm and "error" not in r),
                      None) for arm in ("none", "prefix")}
    lines = [f"Multi-turn trace, {header['model']} on {header['gpu']}: {header['trace']}", "",
             "| method | arm | wall s | prefill tok | logical prompt tok | peak GiB (active) | mean GiB | turn p50 s "
             "| TTFT mean s | hits | preempt | vs vanilla none | vs vanilla prefix |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['arm']} | error: {r['error'][:80]} |" + " |" * 10)
            continue
        speed = [f"{b['wall_s'] / r['wall_s']:.2f}x" if b else "-" for b in (base["none"], base["prefix"])]
        hits = r["prefix_hit_tokens"] if r["arm"] == "prefix" else r["chain_hits"]
        wall = f"{r['wall_s']:.1f}" + (" (timed out)" if r["timed_out"] else "")
        lines.append(f"| {r['method']} | {r['arm']} | {wall} | {r['prefill_tokens']:,} | "
                     f"{r['prompt_tokens_logical']:,} | {r['peak_GiB_used']:.2f} ({r['peak_GiB_active']:.2f}) | "
                     f"{r['mean_GiB_used']:.2f} | "
                     f"{r['turn_latency_p50_s']:.2f} | {r['ttft_mean_s']:.2f} | {hits:,} | {r['preemptions']} | "
                     f"{speed[0]} | {speed[1]} |")
    lines += ["", "hits: chain continuations (chain, prune) or prompt tokens found in the prefix cache (prefix); peak "
                  "GiB: KV pages in use at the peak, and in parentheses without idle reusable state; mean GiB: pages "
                  "in use averaged over the run."]
    for r in rows:
        if r.get("arm") == "prune" and "error" not in r:
            lines.append(f"{r['method']} prune: {r['prunes']} prunes in {r['prune_s']:.2f} s, "
                         f"{r['prune_freed_pages']:,} pages freed, {r['prunes_rejected']} refused.")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="vanilla,snapkv,h2o,quest")
    parser.add_argument("--arms", default=None, help="arms for every method, e.g. none,chain (default per method: "
                                                     "none + chain for eviction methods, none + prefix otherwise)")
    for name, default in DEFAULTS.items():
        kind = str if name == "tool_wait" else int
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"default {default}")
    parser.add_argument("--quick", action="store_true", help=f"a smaller trace: {QUICK}")
    parser.add_argument("--prune-lag", type=int, default=4, help="prune arm: the tool result of this many turns ago")
    parser.add_argument("--prune-ratio", type=float, default=0.2, help="prune arm: fraction of its tokens kept")
    parser.add_argument("--budget", type=int, default=None,
                        help="budget of every method that takes one (default 2048); a budget the histories do not "
                             "reach shows what pruning frees (under a binding budget it changes what is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk size")
    parser.add_argument("--kv-cache-memory", type=float, default=None)
    parser.add_argument("--arm-timeout", type=float, default=0, help="stop an arm after this many seconds (0: none)")
    parser.add_argument("--kvzip-cost", default="", help="contexts (comma list) for the KVzip prefill-cost rows")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    parser.add_argument("--tiny", action="store_true", help="tiny hidden sizes (CPU smoke runs)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "multiturn.jsonl"))
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.kv_cache_memory is not None and args.kv_cache_memory > 1:
        args.kv_cache_memory = int(args.kv_cache_memory)
    if not (0 < args.min_tool <= args.max_tool and 0 < args.min_output <= args.max_output):
        parser.error("need 0 < --min-tool <= --max-tool and 0 < --min-output <= --max-output")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    model = make_model(args.layers, args.tiny, args.device)
    methods = [m for m in args.methods.split(",") if m in sparsecompile.available_methods()]
    trace = {k: getattr(args, k) for k in (*DEFAULTS, "seed")}
    header = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "model": f"Llama-3.1-8B shape{' (tiny)' if args.tiny else ''}, {model.config.num_hidden_layers} layers",
              "trace": trace, "max_num_seqs": args.max_num_seqs, "chunk": args.chunk, "methods": methods}
    rows: list[dict] = []
    with open(args.out, "w") as out:
        out.write(json.dumps(header) + "\n")
        print(json.dumps(header), flush=True)
        cost = []
        if args.kvzip_cost:
            cost = kvzip_cost(model, [int(x) for x in args.kvzip_cost.split(",")], args)
            for row in cost:
                out.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
        for method in methods:
            arms = (args.arms or DEFAULT_ARMS.get(method, "none,chain")).split(",")
            for row in method_rows(model, method, arms, args):
                row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)
    print(table(rows, header), flush=True)
    try:
        plot_pages(rows, os.path.splitext(args.out)[0] + ".png", header)
    except ImportError:
        print("(no plot: pip install -e '.[bench]' for matplotlib)", flush=True)
    if cost:
        print("| method | context | prefill s | vs vanilla |\n|---|---|---|---|", flush=True)
        for r in cost:
            print(f"| {r['method']} | {r['context']} | {r.get('seconds', float('nan')):.3f} | "
                  f"{r.get('vs_vanilla', float('nan')):.2f}x |" if "error" not in r else
                  f"| {r['method']} | {r['context']} | error: {r['error'][:60]} | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
