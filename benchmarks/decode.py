"""Decode throughput against the HBM roofline, on the Llama-3.1-8B shape (random bf16 weights).

    python benchmarks/decode.py [--grid default|quick] [--methods vanilla,quest,...] [--no-hf] [--out DIR]
    sparsecompile bench ...                      (same arguments)

For every (method, context, batch) point the KV cache is filled synthetically at the size the method
holds after prefill (dense, Quest, OmniKV: the whole context plus metadata; SnapKV, PyramidKV, H2O,
StreamingLLM: their budget), then 32 warm-up decode steps run and a window of >= 128 steps is timed,
synchronised only at its edges (CUDA-graph replays of the compiled decode step). Reported per point:
aggregate tok/s, achieved GB/s on the bytes a step must read (weights + KV read + method metadata),
% of the roofline against the read bandwidth measured in the same run, and peak memory. The HF
dense baselines (eager DynamicCache, StaticCache + torch.compile) run in the same invocation.
Results: JSON lines and a PNG under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bandwidth import measure_read_bandwidth  # noqa: E402

import sparsecompile  # noqa: E402
from sparsecompile.kernels.argmax import first_argmax  # noqa: E402
from sparsecompile.models.hf_cache import SparseCache  # noqa: E402
from sparsecompile.models.hf_patch import (
    cache_argument_name,  # noqa: E402
    patched_model,
)

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=262144,
                rope_theta=500000.0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Method rows of the benchmark: options as the performance targets state them ("method" names the registered
# method when the row's name is not one: the KIVI rows at 2 and 4 bits).
METHOD_OPTIONS = {
    "vanilla": {},
    "quest": {"budget": 2048},
    "omnikv": {"budget": 2048},
    "quest-select": {"method": "quest", "budget": 2048, "dense_below": 0},  # selecting at every length (reference)
    "omnikv-select": {"method": "omnikv", "budget": 2048, "dense_below": 0},
    "vanilla-mlp32k": {"method": "vanilla", "prefill_mlp_chunk": 32768},  # prefill.py: MLP chunks of the prefill
    "vanilla-mlp64k": {"method": "vanilla", "prefill_mlp_chunk": 65536},
    "vanilla-unfused": {"method": "vanilla", "fuse_pointwise": False},  # prefill.py: HF's own norms and SiLU ops
    "snapkv": {"budget": 2048},
    "pyramidkv": {"budget": 2048},
    "h2o": {"budget": 2048},
    "streamingllm": {"budget": 2048},
    "kivi2": {"method": "kivi", "bits": 2},
    "kivi4": {"method": "kivi", "bits": 4},
    "snapkv+kivi": {"budget": 2048, "bits": 2},
    "h2o+kivi": {"budget": 2048, "bits": 2},
    "snapkv+kivi-r32": {"method": "snapkv+kivi", "budget": 2048, "bits": 2, "residual": 32},
    "quest+kivi": {"budget": 2048, "bits": 2},
    "quest+kivi-select": {"method": "quest+kivi", "budget": 2048, "bits": 2, "dense_below": 0},  # its crossover
}


def row_method(row: str) -> tuple[str, dict]:
    """(registered method, its options) of a benchmark row."""
    options = dict(METHOD_OPTIONS[row])
    return options.pop("method", row), options

PROFILE_STEPS = 4  # decode steps recorded by torch.profiler after a timed window

GRIDS = {
    "default": [(32768, 1), (32768, 16), (131072, 1), (131072, 4)],
    "quick": [(32768, 1), (32768, 16)],
}


@dataclass
class Point:
    system: str
    method: str
    context: int
    batch: int
    resident_tokens: int = 0  # per sequence per layer per KV head
    read_tokens: int = 0
    tok_s: float = 0.0
    step_ms: float = 0.0
    bytes_per_step: float = 0.0
    GBps: float = 0.0
    roofline_tok_s: float = 0.0
    pct_roofline: float = 0.0
    peak_GiB: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)


def build_model(layers: int | None = None):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**LLAMA_8B, **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def weight_bytes(model) -> int:
    # Every weight is read once per decode step (the embedding reads only B rows; count the LM head).
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()


def _fill_synthetic(controller, rows: list[int], context: int) -> list[int]:
    """Place random K/V for ``context`` prompt tokens at the size the method keeps; returns slots per layer."""
    m = controller.manager
    counts = controller.oracle.resident_slots_per_layer(context, 0)
    m.ensure_slots(rows, np.array([counts] * len(rows)))
    m.flush()
    if m.storage is None:
        m.k_pool.normal_()
        m.v_pool.normal_()
    else:  # quantized pages: random codes, scales and residual
        m.storage.fill_synthetic()
    rows_t = torch.tensor(rows, device=m.pos_pool.device)
    heads = m.layout.num_kv_heads
    for layer, count in enumerate(counts):
        slots, _ = m.resident_slot_ids(layer, rows_t, count)
        pos = (context - count + torch.arange(count, device=slots.device)).expand(len(rows), -1)
        m.scatter_slots(m.pos_pool, slots[:, None, :].expand(-1, heads, -1), pos[:, None, :].expand(-1, heads, -1))
    controller.runtime.on_kv_loaded(m, rows, [context] * len(rows))
    return counts


def _selected_kivi_bytes(controller, read: list[int], counts: list[int], batch: int) -> int:
    """Bytes a selection over KIVI pages reads a step (``quest+kivi``): per layer and KV head list, the read slots as
    KIVI stores them (the chosen quantized pages' codes, value metadata and key groups' scales and zeros; the residual
    in full precision: ``KiviSpec.slot_bytes`` of the read count) plus every quantized key group's scales and zeros,
    which the page scores read."""
    lay, spec = controller.layout, controller.manager.storage.spec
    lists = batch * lay.num_kv_heads
    total = 0
    for tokens, count in zip(read, counts):
        total += lists * spec.slot_bytes(lay.head_dim, lay.dtype, tokens // lists)
        total += lists * int(spec.quantized(count)) // spec.group_size * 2 * lay.head_dim * 2  # scale + zero, 16-bit
    return total


def pages_per_sequence(oracle, context: int, generated: int) -> int:
    """Pages one sequence holds after ``generated`` decode tokens plus what one more step writes before it evicts:
    the held pages (decode eviction keeps those of ``budget + interval`` slots; a pool sized by the resident slots
    lacked one page per layer and row for H2O at 32K x 16) and the step's growth beyond them."""
    held = oracle.held_slots_per_layer(context, generated)
    return oracle.pages_for(held) + oracle.step_cost(context, generated, 1)["kv_pages"]


def engine_point(model, method: str, context: int, batch: int, warmup: int, steps: int, wbytes: int,
                 bandwidth: float, profile_path: str | None = None) -> Point:
    name, options = row_method(method)
    point = Point("sparsecompile", method, context, batch)
    sparsecompile.optimize(model, name, compile=True, cuda_graphs=True, **options)
    patched = patched_model(model)
    controller = patched.controller
    # The pool holds what the method keeps after prefill (the prompt itself is never materialised here).
    generated = warmup + steps + PROFILE_STEPS
    controller.configure_pool(batch * pages_per_sequence(controller.oracle, context, generated) + 64)
    cache = SparseCache(controller, expected_new_tokens=generated)
    torch.cuda.reset_peak_memory_stats()
    try:
        rows = cache.allocate(batch, context)
        counts = _fill_synthetic(controller, rows, context)
        cache.processed = context
        ids = torch.randint(3, 1000, (batch, 1), device="cuda")
        pos = torch.full((batch, 1), context, device="cuda", dtype=torch.long)

        def step():
            nonlocal ids
            logits = controller.decode(patched.inner, rows, ids, pos)
            ids = first_argmax(logits[:, -1])[:, None]  # (what generate() samples with)
            pos.add_(1)

        elapsed = _timed_window(step, warmup, steps)
        if profile_path:
            _profile(step, profile_path)
        from torch._dynamo.utils import counters

        point.extra["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
        stats = sparsecompile.kv_stats(cache)
        read = [s.tokens_read for s in stats.layers]
        kv_read_token_heads = sum(read) if all(r is not None for r in read) else stats.resident_tokens
        # K/V bytes read: the storage format's (KIVI: codes, scales, zeros, residual), positions not counted
        if all(r is None for r in read):
            kv_bytes = stats.resident_bytes
        elif controller.manager.storage is not None:
            kv_bytes = _selected_kivi_bytes(controller, read, counts, batch)
        else:
            kv_bytes = kv_read_token_heads * controller.layout.bytes_per_slot_head
        point.extra["kv_GB"] = round(kv_bytes / 1e9, 3)
        point.extra["pool_GB"] = round((controller.manager.num_pages * controller.manager.bytes_per_page
                                        + controller.manager.max_seqs * controller.manager.bytes_per_row) / 1e9, 3)
        point.resident_tokens = int(np.mean(counts))
        point.read_tokens = int(kv_read_token_heads / (batch * controller.layout.num_layers
                                                       * controller.layout.num_kv_heads))
        point.bytes_per_step = wbytes + kv_bytes + stats.metadata_bytes
    finally:
        cache.release()
        sparsecompile.restore(model)
    _finish(point, elapsed / steps, bandwidth)
    return point


def _timed_window(step, warmup: int, steps: int) -> float:
    """Seconds for ``steps`` decode steps after ``warmup`` ones, synchronised only at the window's edges."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _profile(step, path: str, steps: int = PROFILE_STEPS) -> None:
    """Where a decode step's GPU time goes: the top kernels of a few profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with open(path, "w") as handle:
        handle.write(f"{steps} decode steps\n")
        handle.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))


def _finish(point: Point, step_s: float, bandwidth: float) -> None:
    point.step_ms = step_s * 1e3
    point.tok_s = point.batch / step_s
    point.GBps = point.bytes_per_step / step_s / 1e9
    point.roofline_tok_s = point.batch / (point.bytes_per_step / (bandwidth * 1e9))
    point.pct_roofline = 100 * point.tok_s / point.roofline_tok_s
    point.peak_GiB = torch.cuda.max_memory_allocated() / 2**30


def hf_point(model, kind: str, context: int, batch: int, warmup: int, steps: int, wbytes: int,
             bandwidth: float) -> Point:
    """HF decode from a synthetically filled DynamicCache (eager) or StaticCache (torch.compile)."""
    from transformers import DynamicCache, StaticCache

    point = Point(f"hf-{kind}", "vanilla", context, batch, resident_tokens=context, read_tokens=context)
    cfg = model.config
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    torch.cuda.reset_peak_memory_stats()
    name = cache_argument_name(model)
    if kind == "dynamic":
        cache = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            cache.update(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
                         torch.randn(shape, device="cuda", dtype=torch.bfloat16), layer)
        forward = model.forward
    else:
        cache = StaticCache(config=cfg, max_cache_len=context + warmup + steps + 8)
        ids = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        with torch.no_grad():  # lazily allocate the static layers
            model(input_ids=ids, position_ids=torch.zeros_like(ids), **{name: cache})
        for layer in cache.layers:
            layer.keys[:, :, :context].normal_()
            layer.values[:, :, :context].normal_()
            layer.cumulative_length.fill_(context)
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(3, 1000, (batch, 1), device="cuda")
    pos = torch.full((batch, 1), context, device="cuda", dtype=torch.long)
    with torch.no_grad():
        def step():
            nonlocal ids
            logits = forward(input_ids=ids, position_ids=pos.clone(), **{name: cache}).logits
            ids = first_argmax(logits[:, -1])[:, None]  # (what generate() samples with)
            pos.add_(1)

        elapsed = _timed_window(step, warmup, steps)
    kv_bytes = batch * cfg.num_hidden_layers * cfg.num_key_value_heads * context * cfg.head_dim * 2 * 2
    point.bytes_per_step = wbytes + kv_bytes
    _finish(point, elapsed / steps, bandwidth)
    return point


def _fits(model, method: str, context: int, batch: int, extra_tokens: int) -> bool:
    """Whether ``batch`` sequences' KV (at the method's resident size) can be allocated and filled."""
    name, options = row_method(method)
    sparsecompile.optimize(model, name, compile=False, **options)
    controller = patched_model(model).controller
    controller.configure_pool(batch * pages_per_sequence(controller.oracle, context, extra_tokens) + 64)
    cache = SparseCache(controller, expected_new_tokens=extra_tokens)
    try:
        rows = cache.allocate(batch, context)
        _fill_synthetic(controller, rows, context)
        # headroom for the decode step's activations and logits ([batch, vocab] fp32) and its graph pool
        torch.empty(batch * model.config.vocab_size * 4 * 4 + 2**31, dtype=torch.uint8, device="cuda")
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        cache.release()
        controller.manager = None
        sparsecompile.restore(model)
        gc.collect()
        torch.cuda.empty_cache()


def max_batch(model, method: str, context: int, wbytes: int, bandwidth: float, warmup: int, steps: int,
              profile_dir: str | None = None) -> dict:
    """Largest batch whose KV fits (doubling, then bisection on allocation), verified by running decode at
    it; the proof that one more fails is the allocation of batch + 1 failing (out of memory)."""
    lo, hi = 0, 1
    while _fits(model, method, context, hi, warmup + steps):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(model, method, context, mid, warmup + steps) else (lo, mid)
    point = None
    while lo > 0 and point is None:
        path = os.path.join(profile_dir, f"profile_{method}_{context // 1024}k_b{lo}.txt") if profile_dir else None
        try:
            point = engine_point(model, method, context, lo, warmup, steps, wbytes, bandwidth, path)
        except torch.OutOfMemoryError:  # decode itself needs more than the allocation check reserved
            lo, hi = lo - 1, lo
        gc.collect()
        torch.cuda.empty_cache()
    return {"method": method, "context": context, "largest_batch": lo, "fails_at": hi, "point": point}


def prefill_point(model, method: str, context: int, chunk: int, profile_path: str | None = None) -> dict:
    """Wall time of one chunked prefill of ``context`` tokens (batch 1) through the patched forward
    (the second of two runs: the first compiles the Triton kernels); with ``profile_path`` a third run
    is recorded by torch.profiler."""
    name, options = row_method(method)
    sparsecompile.optimize(model, name, compile=False, prefill_chunk_size=chunk, **options)
    ids = torch.randint(3, 1000, (1, context), device="cuda")

    def run() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(input_ids=ids, logits_to_keep=1)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        (out["cache"] if "cache" in out else out["past_key_values"]).release()
        return seconds

    try:
        run()
        seconds = run()
        if profile_path:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run()
            with open(profile_path, "w") as handle:
                handle.write(f"one {context}-token prefill in chunks of {chunk}\n")
                handle.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                                       max_name_column_width=90))
    finally:
        sparsecompile.restore(model)
    return {"prefill": method, "context": context, "chunk": chunk, "seconds": seconds,
            "tok_s": context / seconds}


def plot(points: list[Point], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({p.context for p in points})
    labels = sorted({(p.system, p.method) for p in points})
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        mine = [p for p in points if p.context == context]
        for label in sorted({(p.system, p.method) for p in mine}):
            pts = sorted((p for p in mine if (p.system, p.method) == label), key=lambda p: p.batch)
            ax.plot([p.batch for p in pts], [p.tok_s for p in pts], "o-", color=colors[label],
                    label=f"{label[0]} {label[1]}")
        roof = {p.batch: p.roofline_tok_s for p in mine if p.method == "vanilla" and p.system == "sparsecompile"}
        if roof:
            ax.plot(sorted(roof), [roof[b] for b in sorted(roof)], "k--", label="dense roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tok/s (aggregate)")
        ax.set_title(f"context {context // 1024}K, Llama-3.1-8B shape, H200")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    """Kernel choices to A/B without editing the kernel modules: ``--logits-config`` (the decode attention's launch
    when it stores its logits, H2O: JSON ``{"short": {...}, "long": {...}}`` merged into ``DECODE_LOGITS_CONFIGS``)
    and ``--topk-long-search``."""
    parser.add_argument("--logits-config", default="", help='JSON {"short": {...}, "long": {...}}: launch overrides '
                        "of the decode attention that stores its logits (kernel_bench.py --only mass_decode --sweep)")
    parser.add_argument("--topk-long-search", default=None, help="top-k select of rows past one program's tile "
                        "(OmniKV's prompt-long rows): torch or radix")


def apply_topk_long_search(name: str | None) -> str:
    """``--topk-long-search``: which select OmniKV's prompt-long rows use (``topk_select.LONG_SEARCH``)."""
    module = importlib.import_module("sparsecompile.kernels.topk_select")
    if name:
        if name not in module.LONG_SEARCHES:
            raise SystemExit(f"--topk-long-search is one of {module.LONG_SEARCHES}, got {name!r}")
        module.LONG_SEARCH = name
    return module.LONG_SEARCH


def apply_kernel_arguments(args: argparse.Namespace) -> dict:
    """Apply :func:`add_kernel_arguments`' options; returns the choices in force (for the results' header)."""
    return {"logits_configs": apply_logits_config(args.logits_config),
            "topk_long_search": apply_topk_long_search(args.topk_long_search)}


def apply_logits_config(text: str) -> dict:
    """Merge ``--logits-config``'s JSON into the kernel's table; returns the table in force."""
    # the module, not the op of the same name that sparsecompile.kernels exports
    paged_attention = importlib.import_module("sparsecompile.kernels.paged_attention")
    for regime, cfg in (json.loads(text) if text else {}).items():
        if regime not in paged_attention.DECODE_LOGITS_CONFIGS:
            raise SystemExit(f"--logits-config: regimes are {sorted(paged_attention.DECODE_LOGITS_CONFIGS)}, "
                             f"got {regime!r}")
        paged_attention.DECODE_LOGITS_CONFIGS[regime].update(cfg)
    return paged_attention.DECODE_LOGITS_CONFIGS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", default="default", choices=sorted(GRIDS))
    parser.add_argument("--points", default="", help="CONTEXTxBATCH,... instead of the grid's points")
    parser.add_argument("--methods", default="vanilla,quest,omnikv,snapkv")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baselines")
    parser.add_argument("--hf-static", default="32768x1", help="points for the StaticCache+compile baseline")
    parser.add_argument("--max-batch", default="vanilla,snapkv", help="methods whose largest batch at 128K is searched")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    parser.add_argument("--profile", default="32768x1", help="engine points profiled with torch.profiler")
    parser.add_argument("--prefill", default="vanilla,snapkv,h2o", help="methods whose 32K chunked prefill is timed")
    parser.add_argument("--profile-prefill", action="store_true", help="record each timed prefill with torch.profiler")
    parser.add_argument("--profile-max-batch", action="store_true", help="profile the largest-batch points too")
    parser.add_argument("--append", action="store_true",
                        help="add to decode<TAG>.jsonl (one grid split over several invocations); the plot shows all")
    parser.add_argument("--tag", default="", help="suffix of the result files (decode<TAG>.jsonl / .png)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    add_kernel_arguments(parser)
    args = parser.parse_args(argv)
    kernels = apply_kernel_arguments(args)
    if not torch.cuda.is_available():
        parser.exit(2, "decode.py (sparsecompile bench) measures GPU decode against the HBM roofline: it needs a CUDA "
                       "device, and this machine has none\n")
    os.makedirs(args.out, exist_ok=True)
    bw = measure_read_bandwidth()
    bandwidth = bw["best_GBps"]
    print(json.dumps({"bandwidth": bw}), flush=True)
    model = build_model(args.layers)
    wbytes = weight_bytes(model)
    methods = [m for m in args.methods.split(",") if m in METHOD_OPTIONS]
    results_path = os.path.join(args.out, f"decode{args.tag}.jsonl")
    out = open(results_path, "a" if args.append else "w")

    def emit(point: Point) -> None:
        row = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in point.__dict__.items()}
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), flush=True)

    out.write(json.dumps({"bandwidth": bw, "weight_bytes": wbytes, "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name(), **kernels}) + "\n")
    profiled = {tuple(int(x) for x in p.split("x")) for p in args.profile.split(",") if p}
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",") if p] or GRIDS[args.grid]
    for method in methods:
        for context, batch in points:
            path = (os.path.join(args.out, f"profile_{method}_{context // 1024}k_b{batch}.txt")
                    if (context, batch) in profiled else None)
            started = time.perf_counter()
            try:
                point = engine_point(model, method, context, batch, args.warmup, args.steps, wbytes, bandwidth, path)
                point.extra["wall_s"] = round(time.perf_counter() - started, 1)  # compile + capture + timing
                emit(point)
            except Exception as err:  # one failing point (a kernel error, out of memory) does not end the run
                row = {"method": method, "context": context, "batch": batch, "error": f"{type(err).__name__}: {err}"}
                out.write(json.dumps(row) + "\n")
                print(json.dumps(row)[:2000], flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    if not args.no_hf:
        static = {tuple(int(x) for x in s.split("x")) for s in args.hf_static.split(",") if s}
        for context, batch in points:
            emit(hf_point(model, "dynamic", context, batch, args.warmup, args.steps, wbytes, bandwidth))
            gc.collect()
            torch.cuda.empty_cache()
            if (context, batch) in static:
                emit(hf_point(model, "static-compile", context, batch, args.warmup, args.steps, wbytes, bandwidth))
                gc.collect()
                torch.cuda.empty_cache()
    for method in [m for m in args.max_batch.split(",") if m in METHOD_OPTIONS]:
        found = max_batch(model, method, 131072, wbytes, bandwidth, args.warmup, args.steps,
                          args.out if args.profile_max_batch else None)
        if found["point"] is not None:
            found["point"].note = f"largest batch; batch {found['fails_at']} does not fit (out of memory)"
            emit(found["point"])
        row = {k: v for k, v in found.items() if k != "point"}
        out.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    for method in [m for m in args.prefill.split(",") if m in METHOD_OPTIONS]:
        path = os.path.join(args.out, f"profile_prefill_{method}_32k.txt") if args.profile_prefill else None
        row = prefill_point(model, method, 32768, 2048, path)
        out.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    out.close()
    with open(results_path) as handle:  # with --append: every invocation's points
        rows = [json.loads(line) for line in handle]
    points = [Point(**row) for row in rows if "system" in row]
    if points:  # (every point failed: its error rows are the results, and there is nothing to draw)
        plot(points, os.path.join(args.out, f"decode{args.tag}.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
