"""Offline serving throughput: ``sparsecompile.LLM.generate`` on a mixed workload vs HF ``generate()``.

    python benchmarks/serving.py [--methods vanilla,snapkv,quest] [--num-requests 256] [--no-hf] [--out DIR]
    python benchmarks/serving.py --device cpu --tiny --num-requests 4 ...        (CPU smoke run)

The model is the Llama-3.1-8B shape with random bf16 weights (``decode.build_model``). The workload is
seeded: ``--num-requests`` prompts of random token ids, prompt lengths uniform in
[--min-prompt, --max-prompt], output lengths uniform in [--min-output, --max-output]; every request
arrives at once and decodes greedily with ``ignore_eos`` so it produces exactly its requested tokens.

Per method, an ``LLM`` (continuous batching, chunked prefill, compiled + CUDA-graph decode) first runs a
tiny warm-up so compilation is not timed, then one ``generate`` over the whole workload is timed,
synchronised at its edges. The HF baseline runs the unpatched model's ``generate()`` (DynamicCache) over
left-padded batches of ``--hf-batch`` requests in arrival order; each batch decodes to its longest
request's output, so "useful" tokens (what each request asked for) and "generated" tokens both count.
Results: ``serving<TAG>.jsonl`` (a header row, then one row per system) and ``serving<TAG>.md`` under
``--out`` (default ``benchmarks/results``); every row carries the workload parameters.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

if not torch.cuda.is_available():  # CPU smoke runs: Triton kernels must be interpreted (set before they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import LLAMA_8B, METHOD_OPTIONS, build_model  # noqa: E402

import sparsecompile  # noqa: E402
from sparsecompile import LLM, MethodConfigError, SamplingParams  # noqa: E402

# --tiny: a small model of the same family, so the whole script runs on CPU in seconds.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=4096)

GiB = 2**30


class StubTokenizer:
    """Tokenizer of the random model: decodes every id to "".

    The model's tokens mean nothing, so there is no text to produce; detokenization then costs next to
    nothing and the same for every method, and the engine's time is model time plus scheduling.
    """

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


@dataclass
class Workload:
    """The seeded request set: prompt token ids and requested output lengths, in arrival order."""

    prompts: list[list[int]]
    output_lens: list[int]
    params: dict[str, int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, min_prompt: int, max_prompt: int, min_output: int, max_output: int,
                  seed: int) -> Workload:
    """Uniform prompt and output lengths; prompts are random token ids in [3, 1000)."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(min_prompt, max_prompt + 1, num_requests)
    output_lens = rng.integers(min_output, max_output + 1, num_requests)
    prompts = [rng.integers(3, 1000, int(n)).tolist() for n in prompt_lens]
    params = dict(num_requests=num_requests, min_prompt=min_prompt, max_prompt=max_prompt, min_output=min_output,
                  max_output=max_output, seed=seed)
    return Workload(prompts, [int(n) for n in output_lens], params)


def make_model(layers: int | None, tiny: bool, device: str) -> torch.nn.Module:
    """The Llama-3.1-8B-shaped random model (``decode.build_model`` on CUDA), or the ``--tiny`` one."""
    if device == "cuda" and not tiny:
        return build_model(layers)
    from transformers import AutoModelForCausalLM, LlamaConfig

    overrides = {**(TINY if tiny else {}), **({"num_hidden_layers": layers} if layers else {})}
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{**LLAMA_8B, **overrides}), dtype=dtype)
    return model.eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``fn()`` and its wall seconds, synchronised at both edges."""
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - start


def _dist(values: list[float], prefix: str) -> dict[str, float | None]:
    """Mean, p50 and p99 of ``values`` as ``{prefix}_mean_s, ...`` (None when there are none)."""
    if not values:
        return {f"{prefix}_{k}_s": None for k in ("mean", "p50", "p99")}
    a = np.asarray(values)
    return {f"{prefix}_mean_s": float(a.mean()), f"{prefix}_p50_s": float(np.percentile(a, 50)),
            f"{prefix}_p99_s": float(np.percentile(a, 99))}


def _throughput(work: Workload, wall: float, output_tokens: int) -> dict[str, float]:
    return {"wall_s": wall, "output_tok_s": output_tokens / wall,
            "total_tok_s": (work.prompt_tokens + output_tokens) / wall, "req_s": len(work.prompts) / wall}


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / GiB if device == "cuda" else None


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _free(model: torch.nn.Module, device: str) -> None:
    """Give the model back unpatched and release what the last system held."""
    sparsecompile.restore(model)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def engine_row(model: torch.nn.Module, method: str, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """One sparsecompile row; running out of memory (or a method refusing the model, e.g. Quest's dense
    layers with ``--layers 2``) is recorded in ``error`` and the run goes on."""
    row: dict[str, Any] = {"system": "sparsecompile", "method": method, "options": METHOD_OPTIONS[method]}
    try:
        _engine_run(model, method, work, args, row)
    except torch.OutOfMemoryError as err:
        row["error"] = f"out of memory: {str(err).splitlines()[0]}"
    except MethodConfigError as err:
        row["error"] = f"method config: {err}"
    _free(model, args.device)  # the LLM (its KV pool, its graphs) went out of scope with _engine_run's frame
    return row


def _engine_run(model: torch.nn.Module, method: str, work: Workload, args: argparse.Namespace,
                row: dict[str, Any]) -> None:
    """Build an LLM for ``method``, warm it up, and time one ``generate`` over the whole workload into ``row``."""
    compiled = args.device == "cuda"
    # One decode graph size (= max_num_seqs; smaller batches pad up to it): every size is a separate compile
    # and CUDA-graph capture, and with the default power-of-two sizes compilation would dominate the run.
    graph_sizes = [args.max_num_seqs]
    row.update(cuda_graph_sizes=graph_sizes, compiled=compiled)
    _reset_peak(args.device)
    start = time.perf_counter()
    llm = LLM(model, method, tokenizer=StubTokenizer(), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.max_prompt + args.max_output + 16, cuda_graph_sizes=graph_sizes,
              compile=compiled, cuda_graphs=compiled, prefill_chunk_size=args.chunk, **METHOD_OPTIONS[method])
    # Warm-up: compiles the decode graph; the second prompt crosses a chunk boundary, so the later-chunk
    # prefill path is exercised (and its kernels compiled) too.
    warm = [work.prompts[0][:args.min_prompt], [3 + i % 997 for i in range(min(args.max_prompt, args.chunk + 64))]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    _sync(args.device)
    row["warmup_s"] = time.perf_counter() - start
    engine = llm.llm_engine
    before = engine.stats()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    _reset_peak(args.device)
    t0 = time.monotonic()  # every request arrives at the start of the timed generate
    outs, wall = _timed(lambda: llm.generate(work.prompts, params, use_tqdm=False), args.device)
    after = engine.stats()
    generated = [len(o.outputs[0].token_ids) for o in outs]
    row.update(_throughput(work, wall, sum(generated)))
    row.update(_dist([o.metrics.first_token_time - t0 for o in outs], "ttft"))
    row.update(_dist([o.metrics.finished_time - t0 for o in outs], "e2e"))
    row.update(preemptions=sum(o.metrics.num_preemptions for o in outs), peak_GiB=_peak_gib(args.device),
               kv_pool_pages=after.total_pages, kv_pool_GiB=after.total_pages * engine.manager.bytes_per_page / GiB,
               engine_steps=after.steps - before.steps,
               prompt_tokens_fed=after.prompt_tokens - before.prompt_tokens,  # recomputation included
               generated_tokens=sum(generated),
               exact_lengths=all(g == n for g, n in zip(generated, work.output_lens)))


def hf_row(model: torch.nn.Module, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """HF ``generate()`` (DynamicCache) over left-padded batches of ``--hf-batch`` requests, in arrival order."""
    sparsecompile.restore(model)
    row: dict[str, Any] = {"system": "hf-dynamic", "method": "vanilla", "hf_batch": args.hf_batch}
    batches = [range(i, min(i + args.hf_batch, len(work.prompts))) for i in range(0, len(work.prompts), args.hf_batch)]
    finished: list[float] = []  # per request: seconds from the run's start until its batch ends
    generated = 0
    exact = True

    def run_batch(batch: range) -> None:
        nonlocal generated, exact
        width = max(len(work.prompts[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row_index, i in enumerate(batch):
            prompt = work.prompts[i]
            ids[row_index, width - len(prompt):] = torch.tensor(prompt)
            mask[row_index, width - len(prompt):] = 1
        new = max(work.output_lens[i] for i in batch)
        with torch.no_grad():
            out = model.generate(ids.to(args.device), attention_mask=mask.to(args.device), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
        generated += len(batch) * new
        exact = exact and out.shape[1] - width == new

    try:
        _reset_peak(args.device)
        _sync(args.device)
        start = time.perf_counter()
        for batch in batches:
            run_batch(batch)
            _sync(args.device)
            finished += [time.perf_counter() - start] * len(batch)
        wall = time.perf_counter() - start
        row.update(_throughput(work, wall, work.output_tokens))
        row.update(generated_tok_s=generated / wall, generated_tokens=generated, useful_tokens=work.output_tokens)
        row.update(_dist([], "ttft"))
        row.update(_dist(finished, "e2e"))
        row.update(preemptions=0, peak_GiB=_peak_gib(args.device), exact_lengths=exact)
    except torch.OutOfMemoryError as err:
        row["error"] = f"out of memory: {str(err).splitlines()[0]}"
    finally:
        _free(model, args.device)
    return row


def _cell(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The results table; speedup is output tok/s over the HF baseline's useful output tok/s."""
    hf = next((r for r in rows if r["system"] == "hf-dynamic" and "error" not in r), None)
    w = header["workload"]
    lines = [f"Offline serving, {header['model']} on {header['gpu']}: {w['num_requests']} requests, prompts "
             f"{w['min_prompt']}-{w['max_prompt']}, outputs {w['min_output']}-{w['max_output']} (seed {w['seed']}).",
             "",
             "| system | method | wall s | output tok/s | total tok/s | req/s | mean TTFT s | preemptions | peak GiB "
             "| speedup vs HF |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['method']} | {r['error']} |  |  |  |  |  |  |  |")
            continue
        speedup = r["output_tok_s"] / hf["output_tok_s"] if hf else None
        cells = [r["system"], r["method"], _cell(r["wall_s"], 2), _cell(r["output_tok_s"], 1),
                 _cell(r["total_tok_s"], 1), _cell(r["req_s"], 3), _cell(r["ttft_mean_s"], 2),
                 _cell(r["preemptions"], 0), _cell(r["peak_GiB"], 1), _cell(speedup, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    if hf:
        lines += ["", f"HF output tok/s counts each request's own tokens (useful); with the padded rows' extra tokens "
                      f"it generated {hf['generated_tok_s']:.1f} tok/s. HF has no per-request TTFT."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="vanilla,snapkv,quest")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=1024)
    parser.add_argument("--max-prompt", type=int, default=32768)
    parser.add_argument("--min-output", type=int, default=128)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk size")
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="KV pool: bytes, or a fraction of free GPU memory (default: the engine's)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate() baseline")
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    parser.add_argument("--tiny", action="store_true", help="tiny hidden sizes (CPU smoke runs)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: no compile / CUDA graphs (smoke runs)")
    parser.add_argument("--tag", default="", help="suffix of the result files (serving<TAG>.jsonl / .md)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    if args.kv_cache_memory is not None and args.kv_cache_memory > 1:
        args.kv_cache_memory = int(args.kv_cache_memory)
    if not (0 < args.min_prompt <= args.max_prompt and 0 < args.min_output <= args.max_output):
        parser.error("need 0 < --min-prompt <= --max-prompt and 0 < --min-output <= --max-output")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model = make_model(args.layers, args.tiny, args.device)
    work = make_workload(args.num_requests, args.min_prompt, args.max_prompt, args.min_output, args.max_output,
                         args.seed)
    methods = [m for m in args.methods.split(",") if m in sparsecompile.available_methods()]
    config = model.config
    header = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "model": f"Llama-3.1-8B shape{' (tiny)' if args.tiny else ''}, {config.num_hidden_layers} layers, "
                       f"random {str(model.dtype).removeprefix('torch.')}",
              "workload": work.params, "prompt_tokens": work.prompt_tokens, "output_tokens": work.output_tokens,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "chunk": args.chunk, "kv_cache_memory": args.kv_cache_memory, "methods": methods}
    rows: list[dict[str, Any]] = []
    with open(os.path.join(args.out, f"serving{args.tag}.jsonl"), "w") as out:
        out.write(json.dumps(header) + "\n")
        print(json.dumps(header), flush=True)

        def emit(row: dict[str, Any]) -> None:
            row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
            row["workload"] = work.params
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)

        for method in methods:
            emit(engine_row(model, method, work, args))
        if not args.no_hf:
            emit(hf_row(model, work, args))
    table = markdown(rows, header)
    with open(os.path.join(args.out, f"serving{args.tag}.md"), "w") as handle:
        handle.write(table)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
