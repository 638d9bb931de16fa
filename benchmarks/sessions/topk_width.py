"""#17: does ``topk_select``'s time depend on the row width's alignment? Quest at 128K x 4 on the H200: 45.7 us a
layer in the artifact (block table 8,207 pages wide) against 30.8 us compiled (8,448). Times the Triton select on
``[4, 8, n]`` fp32 scores, 128 kept, for widths around 8K pages; prints one JSON line per width
(``results/topk_width_h200.jsonl``; ``topk_early_stop_h200.jsonl`` is this script over a variant not kept).
``python benchmarks/sessions/topk_width.py 4,8,16,32`` sweeps the program's warps at each width."""

import json
import sys

import torch

sys.path.insert(0, ".")
from sparsecompile.kernels.topk_select import topk_select_triton  # noqa: E402

WARPS = [int(w) for w in sys.argv[1].split(",")] if len(sys.argv) > 1 else [None]  # e.g. "4,8,16,32": a sweep

for n, warps in ((n, w) for n in (8192, 8207, 8208, 8448, 8206, 16384) for w in WARPS):
    scores = torch.randn(4, 8, n, device="cuda")
    counts = torch.full((4, 8), 128, device="cuda", dtype=torch.int64)
    for _ in range(5):
        topk_select_triton(scores, counts, 128, num_warps=warps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(200):
        topk_select_triton(scores, counts, 128, num_warps=warps)
    end.record()
    torch.cuda.synchronize()
    print(json.dumps({"op": "topk_select", "n": n, **({"num_warps": warps} if warps else {}),
                      "us": round(start.elapsed_time(end) / 200 * 1e3, 2)}))
