"""Session sweep (#20, 2026-12-04): the package's KIVI decode op (Gluon quantized part, residual split, combine) at
the decode points under launch variants of ``KIVI_GLUON_CONFIG``, each variant's output against the torch reference
("err").

Its history: the thirteenth session swept programs an SM x a register cap of 184 (``results/
kivi_gluon_sweep_h200.jsonl``); the fourteenth, after the zero-share MMA, programs an SM x caps of 144 / 128 x 3 or
4 stages (``kivi_gluon_stages_sweep_h200.jsonl``: caps slower, 3 stages at 2 bits), then the keys' logits as 1, 2
or 4 MMA chains (``kivi_gluon_chains_sweep_h200.jsonl``, a kernel switch since removed: two chains kept). Next: fewer
programs an SM or longer splits (``min_groups``) at the single-sequence points, where each split holds only a few
groups (5 at 32K x 1).

    python benchmarks/sessions/kivi_gluon_sweep.py [--bits 2] [--stages 3] [--per-sm 6,8,10,12] [--min-groups 4,8]
        [--maxnreg 0] [--points 32768x1,131072x1]   # JSON lines
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bandwidth import time_graph  # noqa: E402
from kivi_kernels import decode_bytes, decode_inputs  # noqa: E402

from sparsecompile.kernels import kivi_gluon  # noqa: E402
from sparsecompile.kernels.kivi_attention import kivi_decode_attention_triton  # noqa: E402
from sparsecompile.kernels.kivi_reference import kivi_decode_attention_reference  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", default="2,4", help="bit widths, comma-separated")
    parser.add_argument("--stages", default="", help="ring stages (default: the package's per bit width)")
    parser.add_argument("--per-sm", default="", help="programs an SM the splits fill (default: the package's)")
    parser.add_argument("--min-groups", default="", help="the fewest key groups a split holds (default: the package's)")
    parser.add_argument("--maxnreg", default="0", help="register caps, 0 for none")
    parser.add_argument("--points", default="32768x1,32768x16,131072x1,131072x4", help="CONTEXTxBATCH,...")
    args = parser.parse_args()
    default = {bits: dict(cfg) for bits, cfg in kivi_gluon.KIVI_GLUON_CONFIG.items()}
    points = [tuple(int(v) for v in p.lower().split("x")) for p in args.points.split(",")]
    for bits in _ints(args.bits):
        variants = [{"stages": st, "programs_per_sm": n, "min_groups": mg, **({"maxnreg": r} if r else {})}
                    for st in (_ints(args.stages) or [default[bits]["stages"]])
                    for n in (_ints(args.per_sm) or [default[bits]["programs_per_sm"]])
                    for mg in (_ints(args.min_groups) or [default[bits]["min_groups"]])
                    for r in _ints(args.maxnreg)]
        for context, batch in points:
            sets = decode_inputs(batch, context, bits, 3)
            want = kivi_decode_attention_reference(*sets[0]).float()
            for v in variants:
                kivi_gluon.KIVI_GLUON_CONFIG[bits] = dict(v)
                err = (kivi_decode_attention_triton(*sets[0]).float() - want).abs().max().item()
                us = time_graph([lambda a=a: kivi_decode_attention_triton(*a) for a in sets], 20) * 1e6
                print(json.dumps({"bits": bits, "batch": batch, "context": context, **v, "us": us,
                                  "GBps": decode_bytes(batch, context, bits) / us / 1e3, "err": err}), flush=True)
            del want, sets
            torch.cuda.empty_cache()
    kivi_gluon.KIVI_GLUON_CONFIG.update(default)


if __name__ == "__main__":
    main()
