"""Host time of the serving scheduler a decode step (2026-12-05, twentieth session; CPU, no model).

    python benchmarks/sessions/scheduler_host_cost.py [--batch 64,256] [--out FILE]

A Scheduler over each method's real MemoryOracle on the Llama-3.1-8B layout (32 layers, 8 KV heads of 128, pages of
16) with ``batch`` requests of 1,000 + i prompt tokens admitted and prefilled, then timed over 200 decode steps:
``schedule()`` (every running request's step reservation) plus ``decode_done`` (its reservation shrunk to what stays
resident) for each, what the engine calls around every decode step. Each prompt's end reports the slots its row
holds, as the engine's does (reservations then follow them: the oracle's ``resumed_*`` methods). Prints one JSON
line a (method, batch).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from sparsecompile.methods.registry import build_runtime
from sparsecompile.runtime.layout import KVLayout
from sparsecompile.runtime.model_info import ModelInfo
from sparsecompile.serving.outputs import RequestMetrics, SamplingParams
from sparsecompile.serving.request import Request, RequestStatus
from sparsecompile.serving.scheduler import Scheduler

METHODS = {"vanilla": {}, "snapkv": {"budget": 2048}, "pyramidkv": {"budget": 2048},
           "streamingllm": {"budget": 2048}, "h2o": {"budget": 2048}, "kvzip": {"budget": 2048},
           "quest": {"budget": 2048}, "omnikv": {"budget": 2048}, "kivi": {}, "snapkv+kivi": {"budget": 2048},
           "h2o+kivi": {"budget": 2048}}
LAYERS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def step_ms(method: str, options: dict, batch: int, steps: int = 200) -> float:
    paths = tuple(f"model.layers.{i}.self_attn" for i in range(LAYERS))
    info = ModelInfo("llama", LAYERS, 32, KV_HEADS, HEAD_DIM, paths, 131072)
    runtime = build_runtime(method, options, info)
    oracle = runtime.memory_oracle(KVLayout(LAYERS, KV_HEADS, HEAD_DIM, PAGE, torch.bfloat16, torch.device("cpu")))
    scheduler = Scheduler(oracle, 10**7, max_num_seqs=batch, max_num_batched_tokens=max(8192, batch),
                          prefill_chunk_size=8192, prefill_mode=runtime.prefill_mode, max_model_len=131072)
    requests = [Request(str(i), list(range(1000 + i)), SamplingParams(max_tokens=100000), RequestMetrics(0.0))
                for i in range(batch)]
    for r in requests:
        scheduler.add(r)
    while any(r.status is not RequestStatus.DECODING for r in requests):
        plan = scheduler.schedule()
        for chunk in plan.prefill:  # as the engine: a final chunk's measured slots (here the oracle's own)
            n = len(chunk.request.prefill_ids)
            scheduler.chunk_done(chunk, oracle.resident_slots_per_layer(n, 0) if chunk.stop == n else None)
        for r in plan.decode:
            scheduler.decode_done(r)
    start = time.perf_counter()
    for _ in range(steps):
        plan = scheduler.schedule()
        assert len(plan.decode) == batch and not plan.preempted
        for r in plan.decode:
            scheduler.decode_done(r)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="64,256")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tag", default="", help="a label for the rows (e.g. the commit)")
    args = parser.parse_args()
    for batch in (int(b) for b in args.batch.split(",")):
        for method in args.methods.split(","):
            ms = step_ms(method, METHODS[method], batch)
            print(json.dumps({"method": method, "batch": batch, "layers": LAYERS, "host_ms_per_step": round(ms, 3),
                              "us_per_request": round(ms * 1e3 / batch, 2), "tag": args.tag,
                              "cpu": platform.processor() or platform.machine()}), flush=True)


if __name__ == "__main__":
    main()
