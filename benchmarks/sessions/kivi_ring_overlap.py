"""Session A/B (#20, 2026-12-05 twenty-fourth session): the package's KIVI decode op, captured in a CUDA graph, with
the residual ring's Triton launch on the capture stream after the Gluon kernel (``OVERLAP_RING = False``, the
arrangement before) and on a side stream beside it (``True``); each arrangement's output against the torch
reference ("err") and against the other's ("diff", expected 0: the same kernels write the same splits).
A record: the switch left the package in the twenty-fifth session (the decode step 1.3 % slower with it, interleaved
runs, ``results/kivi_overlap_interleaved_h200.jsonl``); this runs at commit ce0c53f.

    python benchmarks/sessions/kivi_ring_overlap.py [--bits 2,4] [--points 32768x1,131072x4]   # JSON lines
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

from sparsecompile.kernels import kivi_attention  # noqa: E402
from sparsecompile.kernels.kivi_reference import kivi_decode_attention_reference  # noqa: E402


def _graph_out(args) -> torch.Tensor:
    """The op's output from one captured replay (the side stream is taken only under a capture)."""
    kivi_attention.kivi_decode_attention_triton(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kivi_attention.kivi_decode_attention_triton(*args)
    graph.replay()
    torch.cuda.synchronize()
    return out.float().clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", default="2,4")
    parser.add_argument("--points", default="32768x1,32768x16,131072x1,131072x4", help="CONTEXTxBATCH,...")
    args = parser.parse_args()
    points = [tuple(int(v) for v in p.lower().split("x")) for p in args.points.split(",")]
    for bits in (int(b) for b in args.bits.split(",")):
        for context, batch in points:
            sets = decode_inputs(batch, context, bits, 3)
            want = kivi_decode_attention_reference(*sets[0]).float()
            outs = {}
            for overlap in (False, True, False, True):  # twice each, interleaved: drift shows as disagreement
                kivi_attention.OVERLAP_RING = overlap
                outs[overlap] = _graph_out(sets[0])
                us = time_graph([lambda a=a: kivi_attention.kivi_decode_attention_triton(*a) for a in sets], 30) * 1e6
                print(json.dumps({"bits": bits, "batch": batch, "context": context, "overlap": overlap, "us": us,
                                  "GBps": decode_bytes(batch, context, bits) / us / 1e3,
                                  "err": (outs[overlap] - want).abs().max().item()}), flush=True)
            kivi_attention.OVERLAP_RING = True
            print(json.dumps({"bits": bits, "batch": batch, "context": context,
                              "diff": (outs[True] - outs[False]).abs().max().item()}), flush=True)
            del want, sets, outs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
