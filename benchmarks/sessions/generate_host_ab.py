"""``LLM.generate`` wall time on a tiny 32-layer Llama (CPU), the host's share made visible (2026-12-05, twentieth
session). Run it in two checkouts (``PYTHONPATH=<checkout>``) to compare commits:

    python benchmarks/sessions/generate_host_ab.py [--method h2o] [--requests 256] [--tokens 64] [--tag TAG]

The model is tiny (hidden 32) but has the 8B's 32 layers, so per-layer host work (the scheduler's reservations,
the controller's per-layer hooks) weighs as on the 8B shape; 256 requests of 100-149 prompt tokens, greedy,
``ignore_eos``, one warm-up call first. One JSON line: wall seconds, steps, ms a step, and the seconds spent in the
scheduler's ``schedule`` and ``decode_done`` (timed by wrapping them): the CPU forward of 256 rows dominates the wall
time and varies by a few seconds from run to run, the scheduler's own time does not.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_llm import DigitTokenizer  # noqa: E402
from tiny_models import tiny_pair  # noqa: E402

from sparsecompile import LLM, SamplingParams  # noqa: E402
from sparsecompile.serving import scheduler  # noqa: E402

SPENT = {"schedule": 0.0, "decode_done": 0.0}


def _timed(name: str):
    inner = getattr(scheduler.Scheduler, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - start
    setattr(scheduler.Scheduler, name, timed)

OPTIONS = {"vanilla": {}, "snapkv": {"budget": 64}, "h2o": {"budget": 64}, "streamingllm": {"budget": 64}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="h2o", choices=sorted(OPTIONS))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    _, model = tiny_pair("llama", max_position_embeddings=4096, num_hidden_layers=32, hidden_size=32,
                         intermediate_size=32, num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(model, args.method, tokenizer=DigitTokenizer(), max_model_len=512, max_num_seqs=args.requests,
              page_size=16, max_num_batched_tokens=16384, num_pages=args.requests * 40 + 64, **OPTIONS[args.method])
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 90) for _ in range(100 + i % 50)]} for i in range(args.requests)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    for name in SPENT:
        _timed(name)
    steps = llm.llm_engine.stats().steps
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0), use_tqdm=False)
    wall = time.perf_counter() - start
    ran = llm.llm_engine.stats().steps - steps
    print(json.dumps({"method": args.method, "requests": args.requests, "tokens": args.tokens, "layers": 32,
                      "wall_s": round(wall, 2), "steps": ran, "ms_per_step": round(wall * 1e3 / ran, 2),
                      "scheduler_s": round(sum(SPENT.values()), 3), "tag": args.tag}), flush=True)


if __name__ == "__main__":
    main()
