"""#14 / #18: launch configurations of Quest's two per-layer selection ops at 128K x 4 on the H200 (Llama-3.1-8B
shape: 8 KV heads of 4 query heads, dim 128, pages of 16), each replayed in a CUDA graph over 3 buffer sets:

* ``quest_page_scores`` (40-46 us a layer, 66 % of bandwidth on the 134 MB of page minima / maxima it reads):
  pages per program x warps x pipeline stages;
* ``topk_select`` (31 us a layer at the engine's 8,208-page table): warps.

Prints one JSON line per configuration; the fastest becomes the default (``QUEST_SCORES_CONFIG`` /
``topk_select``'s warps) when it beats the current one by more than noise.

    python benchmarks/sessions/quest_ops_sweep.py > benchmarks/results/quest_ops_sweep_h200.jsonl
"""

import itertools
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from bandwidth import time_graph  # noqa: E402

from sparsecompile.kernels.quest_scores import QUEST_SCORES_CONFIG, quest_page_scores_triton  # noqa: E402
from sparsecompile.kernels.topk_select import topk_select_triton  # noqa: E402
from sparsecompile.runtime.row_ops import table_width  # noqa: E402

BATCH, CONTEXT, KV_HEADS, GROUP, DIM, PAGE = 4, 131072, 8, 4, 128, 16
USED = CONTEXT // PAGE
WIDTH = table_width(USED + 11)  # the engine's table: the context, the generated tokens, rounded to 16 pages


def scores_sets(copies: int = 3) -> list[tuple]:
    sets = []
    for _ in range(copies):
        kmin = torch.randn(BATCH * WIDTH + 1, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(BATCH * WIDTH, device="cuda").to(torch.int32).view(BATCH, WIDTH)  # scattered pages
        q = torch.randn(BATCH, KV_HEADS * GROUP, DIM, device="cuda", dtype=torch.bfloat16)
        sets.append((q, kmin, torch.randn_like(kmin), table, torch.full((BATCH,), USED, device="cuda")))
    return sets


def main() -> None:
    mb = BATCH * USED * KV_HEADS * DIM * 2 * 2 / 1e6
    sets = scores_sets()
    configs = [None] + [{"block_p": p, "num_warps": w, "num_stages": s}
                        for p, w, s in itertools.product((16, 32, 64, 128), (2, 4, 8), (2, 3, 4))]
    for config in configs:
        row = {"op": "quest_page_scores", "config": config or {"default": QUEST_SCORES_CONFIG}}
        try:
            seconds = time_graph([lambda a=a, c=config: quest_page_scores_triton(*a, config=c) for a in sets])
            row.update(us=round(seconds * 1e6, 2), GBps=round(mb * 1e3 / (seconds * 1e6), 1))
        except Exception as err:  # noqa: BLE001 - a configuration that does not compile (registers) is a row too
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        print(json.dumps(row), flush=True)
    del sets
    tk = [(torch.randn(BATCH, KV_HEADS, WIDTH, device="cuda"),
           torch.full((BATCH, KV_HEADS), 128, device="cuda", dtype=torch.int64)) for _ in range(3)]
    for warps in (None, 4, 8, 16, 32):
        seconds = time_graph([lambda a=a, w=warps: topk_select_triton(*a, 128, num_warps=w) for a in tk])
        print(json.dumps({"op": "topk_select", "width": WIDTH, "num_warps": warps or "default",
                          "us": round(seconds * 1e6, 2)}), flush=True)


if __name__ == "__main__":
    main()
