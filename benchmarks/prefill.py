"""Prefill (time to first token) through the public API, against the unpatched HF model (issue #13, item 4).

    python benchmarks/prefill.py [--systems hf_sdpa,hf_generate,sparsecompile,sparsecompile_llm]
        [--methods vanilla,...] [--contexts 8192,32768,131072] [--batches 1,4] [--chunk-sizes 2048,8192,16384,0]
    python benchmarks/prefill.py --e2e [--e2e-context 131072] [--new-tokens 256] [--methods ...] [--systems ...]
    python benchmarks/prefill.py --plot                       (PNG from the JSONL, no runs)
    python benchmarks/prefill.py --device cpu --tiny ...      (CPU smoke run)
    python benchmarks/prefill.py --profile ...                (+ a torch.profiler table per point)

Model: the Llama-3.1-8B shape with random bf16 weights built from a LlamaConfig (``decode.build_model``); prompts
are random token ids. Rows (one JSON line each, appended to ``--out/prefill<TAG>.jsonl``):

* ``hf_sdpa``: ``model(ids, logits_to_keep=1)`` of the unpatched model (SDPA attention);
* ``hf_generate``: the unpatched ``model.generate(ids, max_new_tokens=1)``;
* ``sparsecompile``: ``sparsecompile.optimize(model, method, prefill_chunk_size=chunk, budget=2048)`` then
  ``generate(max_new_tokens=1)``, for each ``--chunk-sizes`` (0 = the whole prompt in one forward, ``default`` = the
  method's own default, recorded as chunk -1);
* ``sparsecompile_llm``: ``sparsecompile.LLM`` over the same model, ``batch`` requests, ``max_tokens=1``.

Each point first runs a warm-up prompt of 4,096 tokens (kernels compile there), then ``--repeats`` timed runs (default
1) synchronised at their edges; ``seconds`` is the fastest. Fields: system, method, context, batch, chunk, seconds,
tflops = (2 * non-embedding params * tokens + 2 * context^2 * layers * hidden * batch) / seconds with tokens =
context * batch (non-embedding: without the input embedding and the LM head, which runs on one position), peak_GiB
(max allocated during the timed runs), runs (every run's seconds, with --repeats > 1), error
(e.g. out of memory: recorded, the run goes on). Between methods the same model is ``restore()``d, not rebuilt.

``--profile``: after its timed run each point runs the same call once more under ``torch.profiler`` (CPU, plus CUDA
on a GPU; not timed into the rows) and writes the op table (by self CUDA time, on CPU self CPU time), then the self
time summed per coarse category (attention / GEMM / other), to
``--out/profile_prefill_<system>_<method>_<context>_b<batch>_c<chunk><TAG>.txt``.

``--e2e``: a ``--e2e-context`` prompt plus ``--new-tokens`` greedy tokens through ``generate()`` for every method
(engine defaults: chunk 2048, compiled CUDA-graph decode), HF eager (DynamicCache) and HF static cache with
transformers' automatic ``torch.compile`` of decode (systems ``hf_eager``, ``hf_static_compile``); the warm-up
generates 8 tokens from a 4K prompt (HF static: into the same cache, so its compiled decode is reused).

Runtime on one H200, estimated from HF's 545 TFLOP/s (8K 0.24 s, 32K 1.4 s, 128K 11.9 s per sequence) and
today's engine at ~2.3x HF's prefill time (a faster prefill kernel shortens the sparsecompile rows); model build
and first kernel compiles ~1 min per invocation:
  --systems hf_sdpa,hf_generate                               8K+32K+128K, b1: ~1.5 min; b4: ~3 min (128K may OOM)
  --systems sparsecompile --contexts 8192,32768 --batches 1   7 methods x 4 chunk sizes: ~4 min (b4: ~9 min)
  --systems sparsecompile --contexts 131072 --batches 1       per method and chunk size ~30 s: 3 methods ~7 min
  --systems sparsecompile --contexts 131072 --batches 4       per method and chunk size ~2 min (or OOM)
  --systems sparsecompile_llm --chunk-sizes 2048 --batches 1  7 methods, 8K+32K: ~2 min; 128K: ~5 min
  --e2e --systems hf_eager,hf_static_compile                  ~3 min (static: decode compile + masked prefill)
  --e2e --systems sparsecompile --methods a,b,c               ~1.5 min per method (prefill + decode compile)
Split bigger selections across device calls with --methods / --contexts / --batches / --chunk-sizes.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

if not torch.cuda.is_available():  # CPU smoke runs: Triton kernels must be interpreted (set before they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import row_method  # noqa: E402
from serving import StubTokenizer, make_model  # noqa: E402

import sparsecompile  # noqa: E402
from sparsecompile import LLM, SamplingParams  # noqa: E402

SYSTEMS = ("hf_sdpa", "hf_generate", "sparsecompile", "sparsecompile_llm")
E2E_SYSTEMS = ("hf_eager", "hf_static_compile", "sparsecompile")
# the methods; any row of decode.METHOD_OPTIONS (e.g. kivi2, snapkv+kivi) may be named with --methods
METHODS = ("vanilla", "streamingllm", "snapkv", "pyramidkv", "h2o", "quest", "omnikv")
DEFAULT_CHUNK = -1  # --chunk-sizes default: the method's own prefill_chunk_size (optimize() without the option)
GiB = 2**30
# --profile's coarse categories: the first whose substrings occur in a (lower-cased) kernel / op name, else "other"
PROFILE_CATEGORIES = (
    ("attention", ("attention", "attn", "flash", "cudnn", "fmha", "sdpa", "prefill_kernel")),
    ("gemm", ("nvjet", "gemm", "cublas", "mm")),
)


class Bench:
    """The model, its FLOP count and the device helpers shared by every row."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = args.device
        self.model = make_model(args.layers, args.tiny, args.device)
        cfg = self.model.config
        self.layers, self.hidden = cfg.num_hidden_layers, cfg.hidden_size
        skip = {id(self.model.get_input_embeddings().weight), id(self.model.get_output_embeddings().weight)}
        self.params = sum(p.numel() for p in self.model.parameters() if id(p) not in skip)
        self.vocab = min(cfg.vocab_size, 1000)

    def ids(self, batch: int, tokens: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, self.vocab, (batch, tokens), generator=g).to(self.device)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def free(self) -> None:
        sparsecompile.restore(self.model)
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def timed(self, fn) -> tuple[float, float | None]:
        """Seconds of ``fn()`` (synchronised at both edges) and the peak GiB allocated meanwhile."""
        self.reset_peak()
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        seconds = time.perf_counter() - start
        return seconds, (torch.cuda.max_memory_allocated() / GiB if self.device == "cuda" else None)

    def reset_peak(self) -> None:
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def tflops(self, context: int, batch: int, seconds: float) -> float:
        tokens = context * batch
        flops = 2 * self.params * tokens + 2 * context ** 2 * self.layers * self.hidden * batch
        return flops / seconds / 1e12


def _generate(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None, **kwargs)


def _forward(model, ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(ids, logits_to_keep=1)


WARM_TOKENS = 4096  # above the 2,048-token budgets: the warm-up evicts / selects, so those kernels compile there


def _warm_tokens(context: int, chunk: int) -> int:
    """A warm-up prompt past the methods' budgets that crosses a chunk boundary (the later-chunk path compiles
    too), at most the context. (With 1,024 warm-up tokens, under snapkv's budget, snapkv's 32K point took 3.39 s
    against vanilla's 1.51 s but 12.14 s against 12.08 s at 128K, the point after it: the eviction path's first
    run, a one-time cost, fell inside the timed run; prefill_h200_b.jsonl.)"""
    return min(context, max(chunk + 64 if chunk > 0 else 0, WARM_TOKENS))


def _chunk_option(chunk: int) -> dict[str, int]:
    """optimize() / LLM keyword for a ``--chunk-sizes`` entry (DEFAULT_CHUNK: none, the method's default)."""
    return {} if chunk == DEFAULT_CHUNK else {"prefill_chunk_size": chunk}


def prefill_row(bench: Bench, system: str, method: str, context: int, batch: int, chunk: int) -> dict[str, Any]:
    row: dict[str, Any] = {"system": system, "method": method, "context": context, "batch": batch, "chunk": chunk}
    model = bench.model
    llm = None
    try:
        warm = bench.ids(1, _warm_tokens(context, chunk), seed=1)
        ids = bench.ids(batch, context)
        if system == "hf_sdpa":
            _forward(model, warm)
            run = lambda: _forward(model, ids)  # noqa: E731
        elif system == "hf_generate":
            _generate(model, warm, 1)
            run = lambda: _generate(model, ids, 1)  # noqa: E731
        elif system == "sparsecompile":
            name, options = row_method(method)
            sparsecompile.optimize(model, name, **_chunk_option(chunk), **_engine_flags(bench), **options)
            _generate(model, warm, 1)
            run = lambda: _generate(model, ids, 1)  # noqa: E731
        else:  # sparsecompile_llm
            name, options = row_method(method)
            llm = LLM(model, name, tokenizer=StubTokenizer(), max_num_seqs=batch,
                      max_num_batched_tokens=chunk if chunk > 0 else context, max_model_len=context + 8,
                      cuda_graph_sizes=[batch], **_chunk_option(chunk), **_engine_flags(bench), **options)
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            llm.generate([warm[0].tolist()], params, use_tqdm=False)
            prompts = [p.tolist() for p in ids]
            run = lambda: llm.generate(prompts, params, use_tqdm=False)  # noqa: E731
        timings = [bench.timed(run) for _ in range(bench.args.repeats)]
        seconds = min(t for t, _ in timings)
        peak = None if timings[0][1] is None else max(p for _, p in timings)
        row.update(seconds=seconds, tflops=bench.tflops(context, batch, seconds), peak_GiB=peak)
        if len(timings) > 1:
            row["runs"] = [round(t, 4) for t, _ in timings]
        if bench.args.profile:
            name = f"profile_prefill_{system}_{method}_{context}_b{batch}_c{chunk}{bench.args.tag}.txt"
            profile_call(bench, run, f"prefill {system} {method} context {context} batch {batch} chunk {chunk}",
                         os.path.join(bench.args.out, name))
    except torch.OutOfMemoryError as err:
        row["error"] = f"out of memory: {str(err).splitlines()[0][:200]}"
    except Exception as err:  # one failing point does not end the run
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    finally:
        llm = run = None  # the engine (its KV pool) goes before the memory is freed
        bench.free()
    return row


def profile_call(bench: Bench, run: Callable[[], Any], what: str, path: str) -> None:
    """One more ``run()`` under ``torch.profiler``: its op table and per-category self times go to ``path``.

    A failure (e.g. out of memory) only warns: the point's timed row stands as it is."""
    from torch.profiler import ProfilerActivity, profile

    cuda = bench.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        bench.sync()
        with profile(activities=activities, record_shapes=False) as prof:
            start = time.perf_counter()
            run()
            bench.sync()
            seconds = time.perf_counter() - start
        averages = prof.key_averages()
        table = averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=40,
                               max_name_column_width=90)
        with open(path, "w") as handle:
            handle.write(f"# {what}: one call after the timed run, {seconds:.4f} s wall under the profiler\n")
            handle.write(f"{table}\n{_category_table(averages, cuda)}\n")
    except Exception as err:
        print(f"# profile of {what} failed: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr, flush=True)


def _category_table(averages: Any, cuda: bool) -> str:
    """Self time summed per ``PROFILE_CATEGORIES`` entry: of the CUDA kernels on a GPU, else of the CPU ops."""
    from torch.autograd import DeviceType

    totals = dict.fromkeys([*(name for name, _ in PROFILE_CATEGORIES), "other"], 0.0)
    for evt in averages:
        if cuda and (evt.device_type != DeviceType.CUDA or getattr(evt, "is_user_annotation", False)):
            continue  # a CPU op's device time is its kernels', which count on their own
        key = (evt.key or "").lower()
        category = next((name for name, words in PROFILE_CATEGORIES if any(w in key for w in words)), "other")
        totals[category] += evt.self_device_time_total if cuda else evt.self_cpu_time_total
    totals["total"] = total = sum(totals.values())
    kind = "self CUDA time of kernels" if cuda else "self CPU time of ops"
    lines = [f"{kind} per category (name contains: {dict(PROFILE_CATEGORIES)})", f"{'category':<12}{'ms':>12}  share"]
    lines += [f"{name:<12}{us / 1e3:>12.3f}  {us / (total or 1):6.1%}" for name, us in totals.items()]
    return "\n".join(lines)


def _engine_flags(bench: Bench) -> dict[str, Any]:
    return {} if bench.device == "cuda" else {"compile": False, "cuda_graphs": False}


def _cache_kwarg(model) -> str:
    """The name under which this transformers version's forward / generate take a cache."""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params else "cache"


def e2e_row(bench: Bench, system: str, method: str, context: int, new_tokens: int) -> dict[str, Any]:
    row: dict[str, Any] = {"system": system, "method": method, "context": context, "batch": 1, "e2e": True,
                           "new_tokens": new_tokens}
    model = bench.model
    try:
        warm = bench.ids(1, min(context, 4096), seed=1)
        ids = bench.ids(1, context)
        kwargs: dict[str, Any] = {}
        if system == "hf_static_compile":
            from transformers import StaticCache

            cache = StaticCache(config=model.config, max_cache_len=context + new_tokens + 8)
            kwargs = {_cache_kwarg(model): cache}
            _generate(model, warm, 8, **kwargs)
            cache.reset()
        elif system == "sparsecompile":
            name, options = row_method(method)
            sparsecompile.optimize(model, name, **_engine_flags(bench), **options)
            _generate(model, warm, 8)
        else:
            _generate(model, warm, 8)
        out: list[torch.Tensor] = []
        seconds, peak = bench.timed(lambda: out.append(_generate(model, ids, new_tokens, **kwargs)))
        generated = out[0].shape[1] - context
        row.update(seconds=seconds, peak_GiB=peak, generated=generated)
    except torch.OutOfMemoryError as err:
        row["error"] = f"out of memory: {str(err).splitlines()[0][:200]}"
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    finally:
        kwargs = {}
        bench.free()
    return row


def _chunk_label(chunk: int) -> str:
    return "default chunk" if chunk == DEFAULT_CHUNK else "whole" if chunk == 0 else f"chunk {chunk}"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """TFLOP/s per (system, method, chunk), one panel per (batch, context)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = {(r["system"], r["method"], r["context"], r["batch"], r["chunk"]): r
              for r in rows if "tflops" in r and not r.get("e2e")}  # appended re-runs: the last one counts
    rows = list(latest.values())
    panels = sorted({(r["batch"], r["context"]) for r in rows})
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.28 * max(
        sum(1 for r in rows if (r["batch"], r["context"]) == p) for p in panels) * len(panels)), squeeze=False)
    for ax, (batch, context) in zip(axes[:, 0], panels):
        mine = sorted((r for r in rows if (r["batch"], r["context"]) == (batch, context)),
                      key=lambda r: (r["system"], r["method"], r["chunk"]))
        labels = [f"{r['system']} {r['method'] if r['system'].startswith('sparse') else ''} "
                  f"{_chunk_label(r['chunk']) if r['system'].startswith('sparse') else ''}".strip() for r in mine]
        colors = [f"C{SYSTEMS.index(r['system']) if r['system'] in SYSTEMS else 9}" for r in mine]
        ax.barh(range(len(mine)), [r["tflops"] for r in mine], color=colors)
        for i, r in enumerate(mine):
            ax.text(r["tflops"], i, f" {r['seconds']:.2f} s", va="center", fontsize=5)
        ax.set_yticks(range(len(mine)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("TFLOP/s (model FLOPs / prefill seconds)")
        ax.set_title(f"prefill, context {context // 1024}K, batch {batch}, Llama-3.1-8B shape", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [DEFAULT_CHUNK if x == "default" else int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--systems", default=None, help=f"comma list of {SYSTEMS} (--e2e: {E2E_SYSTEMS})")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--contexts", type=ints, default=[8192, 32768, 131072])
    parser.add_argument("--batches", type=ints, default=[1, 4])
    parser.add_argument("--chunk-sizes", type=ints, default=[2048, 8192, 16384, 0],
                        help="0 = whole prompt, default = the method's own")
    parser.add_argument("--e2e", action="store_true", help="long prompt + --new-tokens through generate()")
    parser.add_argument("--e2e-context", type=int, default=131072)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--plot", action="store_true", help="draw prefill<TAG>.png from the JSONL and exit")
    parser.add_argument("--profile", action="store_true",
                        help="per point, one more call under torch.profiler -> --out/profile_prefill_*<TAG>.txt")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per point: seconds = the fastest, every run's time in 'runs' (two identical "
                             "HF runs of one invocation differed by 4 %% at 32K on the H200)")
    parser.add_argument("--fresh", action="store_true", help="truncate the JSONL instead of appending to it")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    parser.add_argument("--tiny", action="store_true", help="tiny hidden sizes (CPU smoke runs)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tag", default="", help="suffix of the result files (prefill<TAG>.jsonl / .png)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    default = E2E_SYSTEMS if args.e2e else SYSTEMS
    args.systems = [s for s in (args.systems.split(",") if args.systems else default) if s]
    unknown = set(args.systems) - set(default)
    if unknown:
        parser.error(f"unknown system(s) {sorted(unknown)}; choose from {default}")
    args.methods = [m for m in args.methods.split(",") if m]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"prefill{args.tag}.jsonl")
    if args.plot:
        with open(path) as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        plot(rows, os.path.join(args.out, f"prefill{args.tag}.png"))
        return 0
    started = time.perf_counter()
    bench = Bench(args)
    header = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "layers": bench.layers, "non_embedding_params": bench.params, "argv": sys.argv[1:]}
    with open(path, "w" if args.fresh else "a") as out:
        out.write(json.dumps(header) + "\n")

        def emit(row: dict[str, Any]) -> None:
            row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), f"# {time.perf_counter() - started:.0f}s", flush=True)

        if args.e2e:
            for system in args.systems:
                for method in (args.methods if system == "sparsecompile" else ["vanilla"]):
                    emit(e2e_row(bench, system, method, args.e2e_context, args.new_tokens))
            return 0
        for batch in args.batches:
            for context in args.contexts:
                for system in args.systems:
                    sparse = system.startswith("sparsecompile")
                    for method in (args.methods if sparse else ["vanilla"]):
                        for chunk in (args.chunk_sizes if sparse else [0]):
                            emit(prefill_row(bench, system, method, context, batch, chunk))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
