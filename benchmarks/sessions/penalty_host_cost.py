"""Host time a step of the penalties' output tokens (2026-12-05, twentieth session; CPU).

    python benchmarks/sessions/penalty_host_cost.py [--batch 256] [--outputs 512] [--steps 20]

``process_logits`` counts every penalized row's output tokens at every step. Before, each row's Python list became
a tensor (``torch.tensor(list(output_ids))``, O(output) Python per row per step); now ``TokenHistory.output_array``
copies only the step's new token and the rows' arrays are joined. Both measured on ``batch`` rows of ``outputs``
tokens, one token appended per row and step (the best step of ``steps``); the device work after it is the same.
One JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
import torch

from sparsecompile.serving.sampling import TokenHistory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--outputs", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    rng = random.Random(0)
    histories = [TokenHistory([], [rng.randrange(args.vocab) for _ in range(args.outputs)]) for _ in range(args.batch)]
    lists = joined = float("inf")
    for _ in range(args.steps):
        for h in histories:
            h.output_ids.append(rng.randrange(args.vocab))
        start = time.perf_counter()
        torch.cat([torch.tensor(list(h.output_ids), dtype=torch.long) for h in histories])
        lists = min(lists, time.perf_counter() - start)
        start = time.perf_counter()
        outputs = [h.output_array() for h in histories]
        lengths = np.fromiter((len(o) for o in outputs), dtype=np.int64, count=len(outputs))
        torch.from_numpy(np.concatenate(outputs)).clamp_(max=args.vocab)
        torch.from_numpy(np.repeat(np.arange(len(outputs), dtype=np.int64), lengths))
        joined = min(joined, time.perf_counter() - start)
    print(json.dumps({"batch": args.batch, "outputs": args.outputs, "lists_to_tensors_ms": round(lists * 1e3, 3),
                      "incremental_arrays_ms": round(joined * 1e3, 3)}))


if __name__ == "__main__":
    main()
