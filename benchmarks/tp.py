"""Tensor parallelism on the Llama-3.1-8B shape (bf16, random weights): one torchrun invocation per TP size.

    torchrun --nproc-per-node 1 benchmarks/tp.py --out DIR     # TP 1: baselines + the greedy reference
    torchrun --nproc-per-node 2 benchmarks/tp.py --out DIR     # TP 2: the same, compared with TP 1's files

Parts (``--parts``, default all, run in this order; each in try/except, the table prints whatever finished):

equality   every method: greedy ``generate()`` of ``--new`` tokens for 2 prompts of ``--prompt`` tokens (above the
           2,048 budgets, so every method selects or evicts); eager decode (``--eq-compile``: compiled decode
           replayed as CUDA graphs, one compile per method; tests/gpu/test_tp_cuda.py covers it). TP 1 saves
           its tokens and each step's top-64 logits and largest |logit| to ``DIR/tp_reference.pt`` (< 1 MB; carry
           it, with ``tp1.jsonl``, to the TP N run). TP N feeds TP 1's tokens back (teacher forcing:
           the same decisions are asked of it) and compares logits: the stated bf16 tolerance is
           ``LOGIT_TOL`` = 2 % of the step's largest |logit| (bf16 keeps 8 mantissa bits, and TP adds one bf16
           rounding of each partial sum per layer); a step is *decided* when TP 1's top-2 gap exceeds it, and TP N
           must pick TP 1's token at every decided step ("pass"). Its own greedy tokens are compared too: the
           first divergence and TP 1's gap there (a divergence at a gap within the tolerance is a near-tie).
           Measured on the H200 (2026-12-01, results/tp/): on this random-weight model the 2 % tolerance is
           below bf16's own noise: HF eager and HF SDPA differ from our TP 1 by 5.8 % and 4.0 % of max|logit|
           (``tp_noise.py``), TP 2 by 4.2-7.5 %. So every dtype of ``--eq-dtypes`` runs (default bf16 and
           fp32; the model is cast for the part): in fp32 TP N must give TP 1's greedy tokens.
decode     tok/s at 128K x 4 for vanilla and quest (``decode.py``'s engine point: synthetic KV, warm-up, then a
           window of CUDA-graph replays timed between two synchronisations).
prefill    one 128K-token chunked prefill (chunks of 2,048), vanilla, batch 1 (second of two runs).
capacity   largest batch at 128K for vanilla and snapkv: doubling then bisection on allocation, the ranks agreeing
           on each answer, then decoding at the batch found (``largest_batch``: the batch that decoded; at TP 1
           a decode that runs out of memory, e.g. in its compile, steps back 2 % and tries again, twice at most).
           Runs last: running out of memory inside a decode step under TP stops the whole group (the ranks'
           state would diverge).

Rows go to ``DIR/tp<N>.jsonl`` (rank 0). A TP N > 1 run reads ``DIR/tp1.jsonl`` and prints the targets: largest
batch vanilla >= 2.2x and snapkv >= 2x TP 1's; decode at 128K x 4 >= 1.6x; prefill <= 0.6x TP 1's time.
Set ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` (done here too: NVLink multicast stays off).
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before NCCL initialises: NVLink multicast stays off on these machines
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402
from bandwidth import measure_read_bandwidth  # noqa: E402

import sparsecompile  # noqa: E402
from sparsecompile.models.hf_cache import SparseCache  # noqa: E402
from sparsecompile.models.hf_patch import cache_argument_name, patched_model  # noqa: E402
from sparsecompile.runtime import distributed  # noqa: E402
from sparsecompile.runtime.compilation import allow_recompiles  # noqa: E402

LOGIT_TOL = 0.02
TOP_K = 64  # TP 1 logits kept per step for the comparison
METHODS = ("vanilla", "quest", "omnikv", "snapkv", "pyramidkv", "h2o", "streamingllm")
TARGETS = (  # (what, key, bound, direction): TP N's value / TP 1's value
    ("vanilla largest batch at 128K", ("capacity", "vanilla"), 2.2, ">="),
    ("snapkv largest batch at 128K", ("capacity", "snapkv"), 2.0, ">="),
    ("vanilla decode tok/s at 128K x 4", ("decode", "vanilla"), 1.6, ">="),
    ("quest decode tok/s at 128K x 4", ("decode", "quest"), 1.6, ">="),
    ("vanilla prefill time at 128K x 1", ("prefill", "vanilla"), 0.6, "<="),
)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        for options in decode.METHOD_OPTIONS.values():  # every optimize() of decode.py's helpers splits the model
            options["tp_size"] = self.world
        self.rows: list[dict] = []
        self.path = os.path.join(args.out, f"tp{self.world}.jsonl")
        self.out = open(self.path, "a" if args.append else "w") if self.rank == 0 else None

    def emit(self, row: dict) -> None:
        row = {"tp": self.world, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}}
        self.rows.append(row)
        if self.out is not None:
            self.out.write(json.dumps(row) + "\n")
            self.out.flush()
            print(json.dumps(row)[:1500], flush=True)

    def smallest(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (so that every rank asks the same question next)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        flag = torch.tensor([int(value)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=distributed.current().control)
        return int(flag.item())

    def group_alive(self) -> bool:
        return self.world == 1 or distributed.current() is not None


# ---------------------------------------------------------------------------------------------------- equality
def greedy(model, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens ``[batch, new]`` and the raw logits of each step ``[batch, new, vocab]`` (bf16, CPU)."""
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    out["cache" if "cache" in out else "past_key_values"].release()
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits, 1).to(torch.bfloat16).cpu()


def forced(model, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[batch, steps, vocab]`` when ``tokens [batch, steps]`` are fed back one decode step at a time."""
    name = cache_argument_name(model)
    out = model(input_ids=ids, logits_to_keep=1)
    cache = out["cache" if "cache" in out else "past_key_values"]
    logits = [out.logits[:, -1]]
    try:
        for k in range(tokens.shape[1] - 1):
            out = model(input_ids=tokens[:, k:k + 1], **{name: cache})
            logits.append(out.logits[:, -1])
    finally:
        cache.release()
    return torch.stack(logits, 1).to(torch.bfloat16).cpu()


def summary(logits: torch.Tensor, k: int = TOP_K) -> dict:
    """What the reference keeps of TP 1's logits ``[batch, steps, vocab]``: the top ``k`` values and ids, and the
    largest |logit| of each step (the file stays small enough to carry between device calls)."""
    x = logits.float()
    values, ids = x.topk(k, dim=-1)
    return {"values": values, "ids": ids, "absmax": x.abs().amax(-1)}


def compare(tokens: torch.Tensor, logits: torch.Tensor, want_tokens: torch.Tensor, want: dict) -> dict:
    """TP N's greedy ``tokens`` and teacher-forced ``logits`` against TP 1's (see the module docstring)."""
    got = logits.float()
    scale = want["absmax"]  # [batch, steps]
    diff = (got.gather(-1, want["ids"]) - want["values"]).abs().amax(-1)  # over TP 1's top-k tokens
    gap = (want["values"][..., 0] - want["values"][..., 1]) / scale
    decided = gap > LOGIT_TOL
    agree = got.argmax(-1) == want["ids"][..., 0]
    row = {"steps": int(decided.numel()), "decided_steps": int(decided.sum()),
           "forced_argmax_agree": float(agree.float().mean()), "max_abs_logit_diff": float(diff.max()),
           "max_rel_logit_diff": float((diff / scale).max()), "tolerance_rel": LOGIT_TOL,
           "pass": bool((agree | ~decided).all())}
    same = (tokens == want_tokens).all(0)  # [steps]
    row["greedy_equal"] = bool(same.all())
    if not row["greedy_equal"]:
        first = int((~same).nonzero()[0])
        row["greedy_first_divergence"] = first
        row["tp1_gap_at_divergence_rel"] = float(gap[:, first].min())
        row["greedy_divergence_is_near_tie"] = bool(gap[:, first].min() <= LOGIT_TOL)
    return row


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def reference_key(method: str, dtype: torch.dtype) -> str:
    """The entry of ``tp_reference.pt``: the method's name for bf16 (files of earlier runs), ``name@dtype`` else."""
    return method if dtype == torch.bfloat16 else f"{method}@{dtype_name(dtype)}"


def part_equality(bench: Bench, model) -> None:
    """Every method in every ``--eq-dtypes`` dtype (the model is cast for the part and cast back: bf16 -> fp32 ->
    bf16 is exact). In fp32 the reordered sums of TP differ by ~1e-7 relative, so greedy tokens must match except at
    true ties; bf16 is compared with the stated tolerance and read against ``tp_noise.py``'s floor."""
    args = bench.args
    path = os.path.join(args.out, "tp_reference.pt")
    ids = torch.randint(3, 1000, (2, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    reference = None
    if bench.world > 1:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: run the TP 1 invocation (torchrun --nproc-per-node 1) first")
        reference = torch.load(path)
    saved = torch.load(path) if args.append and bench.world == 1 and os.path.exists(path) else {}
    try:
        for dtype in args.eq_dtypes:
            model.to(dtype)
            equality_in(bench, model, ids, dtype, reference, saved, path)
    finally:
        model.to(torch.bfloat16)
        torch.cuda.empty_cache()


def equality_in(bench: Bench, model, ids: torch.Tensor, dtype: torch.dtype, reference: dict | None, saved: dict,
                path: str) -> None:
    args = bench.args
    compiled = dict(compile=True, cuda_graphs=True) if args.eq_compile else dict(compile=False)
    for method in args.methods:
        key = reference_key(method, dtype)
        row = {"part": "equality", "method": method, "dtype": dtype_name(dtype), "prompt": args.prompt,
               "new_tokens": args.new, **compiled}
        start = time.perf_counter()
        try:
            sparsecompile.optimize(model, method, **compiled, **decode.METHOD_OPTIONS[method])
            try:
                tokens, logits = greedy(model, ids, args.new)
                if reference is None:
                    saved[key] = {"tokens": tokens, **summary(logits)}
                    row["tokens"] = tokens[:, :8].tolist()
                    if bench.rank == 0:
                        torch.save(saved, path)  # after every method: a later timeout keeps what finished
                else:
                    want = reference[key]
                    teacher = forced(model, ids, want["tokens"].cuda())
                    row.update(compare(tokens, teacher, want["tokens"], want))
            finally:
                sparsecompile.restore(model)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        row["wall_s"] = round(time.perf_counter() - start, 1)
        bench.emit(row)
        if not bench.group_alive():
            raise RuntimeError("the tensor-parallel group stopped")


# ---------------------------------------------------------------------------------------------------- capacity
def fits(bench: Bench, model, method: str, context: int, batch: int, extra: int) -> bool:
    """Can every rank allocate and fill ``batch`` sequences' KV and a decode step's headroom? (decode.py's check,
    on each rank's own controller so that running out of memory is an answer, not a failure of the group)."""
    sparsecompile.optimize(model, method, compile=False, **decode.METHOD_OPTIONS[method])
    controller = patched_model(model).controller
    local = getattr(controller, "local", controller)  # not the guarded proxy: an OOM here is an answer
    ok = True
    cache = None
    try:
        local.configure_pool(batch * decode.pages_per_sequence(local.oracle, context, extra) + 64)
        cache = SparseCache(local, expected_new_tokens=extra)
        rows = cache.allocate(batch, context)
        decode._fill_synthetic(local, rows, context)
        torch.empty(batch * model.config.vocab_size * 4 * 4 + (bench.args.headroom_mib << 20), dtype=torch.uint8,
                    device="cuda")
    except torch.OutOfMemoryError:
        ok = False
    finally:
        if cache is not None:
            cache.release()
        local.manager = None
        sparsecompile.restore(model)
        gc.collect()
        torch.cuda.empty_cache()
    return bool(bench.smallest(int(ok)))  # True only if every rank could allocate


def guess(bench: Bench, model, method: str, context: int, extra: int) -> int:
    """Sequences the free memory holds at the method's resident size (the search starts there)."""
    sparsecompile.optimize(model, method, compile=False, **decode.METHOD_OPTIONS[method])
    local = getattr(patched_model(model).controller, "local", None) or patched_model(model).controller
    try:
        per_page = local.build_pool(1, 1, 1).bytes_per_page
        pages = decode.pages_per_sequence(local.oracle, context, extra)
    finally:
        local.manager = None
        sparsecompile.restore(model)
        gc.collect()
        torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0] - (bench.args.headroom_mib << 20)
    return bench.smallest(max(1, free // (pages * per_page)))


def largest(fits_at, start: int) -> tuple[int, int]:
    """``(lo, hi)``: ``fits_at(lo)`` (or lo = 0) and not ``fits_at(hi = lo + 1)``, galloping from ``start``."""
    if fits_at(start):
        lo, step = start, 1
        while fits_at(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi, step = start, 1
        while hi - step >= 1 and not fits_at(hi - step):
            hi, step = hi - step, step * 2
        lo = max(0, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo, hi


def part_capacity(bench: Bench, model, wbytes: int, bandwidth: float) -> None:
    args = bench.args
    for method in ("vanilla", "snapkv"):
        extra = args.warmup + args.steps
        probes: list[int] = []

        def fits_at(batch: int, method: str = method, probes: list[int] = probes, extra: int = extra) -> bool:
            probes.append(batch)
            return fits(bench, model, method, args.context, batch, extra)

        start = guess(bench, model, method, args.context, extra)
        lo, hi = largest(fits_at, start)
        row = {"part": "capacity", "method": method, "context": args.context, "largest_batch": None,
               "largest_batch_allocated": lo, "fails_at": hi, "probes": probes, "decode_failures": []}
        batch = lo
        for _ in range(3):  # the largest batch is one that decodes: its compile and step need memory too
            try:
                point = decode.engine_point(model, method, args.context, batch, args.warmup, args.steps, wbytes,
                                            bandwidth)
                row.update(largest_batch=batch, tok_s=point.tok_s, step_ms=point.step_ms,
                           pct_roofline=point.pct_roofline, peak_GiB=point.peak_GiB)
                break
            except Exception as err:
                row["decode_failures"].append(f"batch {batch}: {type(err).__name__}: {str(err)[:300]}")
                traceback.print_exc()
                sparsecompile.restore(model)
                gc.collect()
                torch.cuda.empty_cache()
                if not bench.group_alive():  # under TP a failed step stops the group: no retry
                    break
                batch = max(1, int(batch * 0.98))
        if row["largest_batch"] is None:
            row["error"] = "no batch at or below the allocation answer decoded: " + "; ".join(row["decode_failures"])
        bench.emit(row)
        if not bench.group_alive():
            raise RuntimeError("the tensor-parallel group stopped")


# ---------------------------------------------------------------------------------------------------- decode / prefill
def part_decode(bench: Bench, model, wbytes: int, bandwidth: float) -> None:
    args = bench.args
    for method in ("vanilla", "quest"):
        point = decode.engine_point(model, method, args.context, 4, args.warmup, args.steps, wbytes, bandwidth)
        bench.emit({"part": "decode", **point.__dict__})
        gc.collect()
        torch.cuda.empty_cache()


def part_prefill(bench: Bench, model) -> None:
    row = decode.prefill_point(model, "vanilla", bench.args.context, 2048)
    bench.emit({"part": "prefill", "method": row.pop("prefill"), **row})


# ---------------------------------------------------------------------------------------------------- table
def value(rows: list[dict], part: str, method: str) -> float | None:
    for row in rows:
        if row.get("part") == part and row.get("method") == method and "error" not in row:
            return {"capacity": row.get("largest_batch"), "decode": row.get("tok_s"),
                    "prefill": row.get("seconds")}[part]
    return None


def table(bench: Bench) -> None:
    with open(bench.path) as handle:  # every invocation's rows (parts may be split with --append)
        rows = [json.loads(line) for line in handle if line.strip()]
    print(f"\nTP {bench.world} ({bench.path})")
    for row in (r for r in rows if r.get("part") == "equality"):
        if "error" in row:
            verdict = row["error"]
        elif "pass" not in row:
            verdict = "reference saved"
        else:
            verdict = (f"pass={row['pass']}  decided steps {row['decided_steps']}/{row['steps']}  "
                       f"max|dlogit|/max|logit| {row['max_rel_logit_diff']:.4f}  greedy equal {row['greedy_equal']}")
            if not row["greedy_equal"]:
                verdict += (f" (first divergence at step {row['greedy_first_divergence']}, TP 1 top-2 gap there "
                            f"{row['tp1_gap_at_divergence_rel']:.4f} of max|logit|)")
        print(f"  equality   {row['method']:<13} {row.get('dtype', 'bfloat16'):<9} {verdict}")
    for part, unit in (("capacity", "sequences"), ("decode", "tok/s at 128K x 4"), ("prefill", "s")):
        for row in (r for r in rows if r.get("part") == part):
            print(f"  {part:<10} {row.get('method', '-'):<13} {value(rows, part, row.get('method'))} {unit}  "
                  f"{row.get('error', '')}")
    baseline = os.path.join(bench.args.out, "tp1.jsonl")
    if bench.world == 1 or not os.path.exists(baseline):
        return
    with open(baseline) as handle:
        tp1 = [json.loads(line) for line in handle if line.strip()]
    print(f"\ntargets, TP {bench.world} / TP 1")
    for what, (part, method), bound, direction in TARGETS:
        mine, base = value(rows, part, method), value(tp1, part, method)
        if mine is None or not base:
            print(f"  {what:<36} missing (TP {bench.world}: {mine}, TP 1: {base})")
            continue
        ratio = mine / base
        ok = ratio >= bound if direction == ">=" else ratio <= bound
        print(f"  {what:<36} {mine:.4g} / {base:.4g} = {ratio:.2f}x  target {direction} {bound}  "
              f"{'met' if ok else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--parts", default="equality,decode,prefill,capacity")
    parser.add_argument("--methods", default=",".join(METHODS), help="methods of the equality part")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--prompt", type=int, default=6144, help="prompt tokens of the equality part")
    parser.add_argument("--new", type=int, default=32, help="greedy tokens of the equality part")
    parser.add_argument("--eq-dtypes", default="bfloat16,float32",
                        help="dtypes of the equality part (the model is cast for it; fp32: 32 GB at TP 1)")
    parser.add_argument("--eq-compile", action="store_true",
                        help="equality part with compiled, CUDA-graph decode (one compile per method: minutes; "
                             "tests/gpu/test_tp_cuda.py checks that path on every method at a small size)")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--headroom-mib", type=int, default=1024,
                        help="memory a decode step may need beyond the KV pool, checked in the capacity search")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    parser.add_argument("--quick", action="store_true", help="4 layers, 32K context, 3 methods, short windows")
    parser.add_argument("--append", action="store_true", help="add to tp<N>.jsonl (parts split over invocations)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.context, args.prompt, args.new = args.layers or 4, 32768, 3072, 8
        args.steps, args.warmup = 16, 4
        args.methods = "vanilla,quest,snapkv" if args.methods == ",".join(METHODS) else args.methods
    args.methods = [m for m in args.methods.split(",") if m]
    args.eq_dtypes = [getattr(torch, d) for d in args.eq_dtypes.split(",") if d]
    if not torch.cuda.is_available():
        parser.exit(2, "tp.py measures GPUs: it needs CUDA\n")
    os.makedirs(args.out, exist_ok=True)
    bench = Bench(args)
    allow_recompiles(64)  # one decode graph per method and batch, all in this process
    bw = measure_read_bandwidth()
    bandwidth = bw["best_GBps"]
    model = decode.build_model(args.layers)
    sparsecompile.optimize(model, "vanilla", compile=False, **decode.METHOD_OPTIONS["vanilla"])  # splits the model
    sparsecompile.restore(model)
    wbytes = decode.weight_bytes(model)  # this rank's share
    bench.emit({"part": "setup", "bandwidth_GBps": bandwidth, "weight_bytes_per_rank": wbytes,
                "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "memory_GiB": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)})
    parts = {"equality": lambda: part_equality(bench, model),
             "decode": lambda: part_decode(bench, model, wbytes, bandwidth),
             "prefill": lambda: part_prefill(bench, model),
             "capacity": lambda: part_capacity(bench, model, wbytes, bandwidth)}
    for name in [p for p in args.parts.split(",") if p]:
        if not bench.group_alive():
            bench.emit({"part": name, "error": "skipped: the tensor-parallel group stopped"})
            continue
        try:
            parts[name]()
        except Exception as err:
            bench.emit({"part": name, "method": "-", "error": f"{type(err).__name__}: {err}"})
            traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()
    if bench.rank == 0:
        table(bench)
    if bench.world > 1 and distributed.current() is not None:
        # The 2026-12-01 TP 2 run printed its table, then did not exit until the call's timeout: if leaving the
        # group or the interpreter's exit (atexit handlers run first) hangs again, print every thread's stack
        # after 90 s and exit instead of holding the GPUs.
        faulthandler.dump_traceback_later(90, exit=True)
        distributed.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
