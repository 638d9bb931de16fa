"""Time of ``sample()`` with top-k / top-p filters (2026-12-05, twentieth session; CPU here, CUDA where present).

    python benchmarks/sessions/sampling_filter_cost.py [--rows 256] [--vocab 128256] [--repeats 3]

Rows with a top-k filter now read their ``max(top_k)`` largest logits with ``topk`` instead of sorting the whole
vocabulary (``sampling.TOPK_FIRST_MAX``), and rows with top-p alone their ``NUCLEUS_CANDIDATES`` largest when those
hold the nucleus (else they sort). Each configuration is timed both ways (the sort forced by ``TOPK_FIRST_MAX = 0``
and ``NUCLEUS_CANDIDATES`` past the vocabulary), best of ``repeats``; one JSON line each, plus the bare ``sort`` /
``topk`` ops. Logits are ``randn * scale``: at the default 8 the top 1,024 tokens of a row hold nearly all the mass,
as a language model's usually do; at 1 they hold little and top-p alone sorts either way.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sparsecompile.serving import sampling
from sparsecompile.serving.outputs import SamplingParams


def _best(fn, repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=8.0)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logits = torch.randn(args.rows, args.vocab, device=device) * args.scale
    for name, fn in (("sort", lambda: logits.sort(dim=-1, descending=True)), ("topk50", lambda: logits.topk(50)),
                     ("topk4096", lambda: logits.topk(4096))):
        print(json.dumps({"op": name, "rows": args.rows, "vocab": args.vocab, "ms": round(_best(fn, args.repeats,
                                                                                               device), 2),
                          "device": str(device)}), flush=True)
    for top_k, top_p in ((50, 1.0), (50, 0.9), (1000, 0.95), (0, 0.9)):
        params = [SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)] * args.rows
        ms = {}
        for mode, limits in (("sort", (0, 2**31)), ("topk_first", (sampling.TOPK_FIRST_MAX,
                                                                    sampling.NUCLEUS_CANDIDATES))):
            saved = sampling.TOPK_FIRST_MAX, sampling.NUCLEUS_CANDIDATES
            sampling.TOPK_FIRST_MAX, sampling.NUCLEUS_CANDIDATES = limits
            try:
                ms[mode] = round(_best(lambda ps=params: sampling.sample(logits, ps, [None] * args.rows),
                                       args.repeats, device), 2)
            finally:
                sampling.TOPK_FIRST_MAX, sampling.NUCLEUS_CANDIDATES = saved
        print(json.dumps({"top_k": top_k, "top_p": top_p, "rows": args.rows, "vocab": args.vocab, "scale": args.scale,
                          "sample_ms_sort": ms["sort"], "sample_ms_topk_first": ms["topk_first"],
                          "device": str(device)}), flush=True)


if __name__ == "__main__":
    main()
