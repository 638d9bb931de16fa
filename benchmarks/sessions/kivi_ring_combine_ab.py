"""Session A/B (#20, 2026-12-05 twenty-sixth session): the KIVI decode op of whichever package is on the path (run
once with ``PYTHONPATH`` at the package before the ring-and-combine kernel, once at this one, interleaved): its time
(CUDA-graph replays over 3 input copies), its error against the torch reference, and each kernel's own time
(the profiler over eager calls). ``--ring-configs`` (JSON list): also time the op under each
``KIVI_RING_COMBINE_CONFIG`` (the package with ``kernels/kivi_residual.py`` only: ``kivi_ring_combine.patch``).
Ran on an H100 (``results/kivi_ring_combine_ab_h100.jsonl``): the one kernel was slower than the two it replaced at
every point (11.6 us against 4.2 + 3.3 at 32K x 1, 10.5-13.0 against 5.6 + 3.8 at 128K x 4, 85-104 against 20.4 +
7.1 at 2,080 x 64), so the patch is not applied.

    PYTHONPATH=.carry/base python benchmarks/sessions/kivi_ring_combine_ab.py --arm base [--bits 2,4]
        [--points 32768x1,131072x4] [--ring-configs '[{"block_r": 32, "num_warps": 4}]']   # JSON lines
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bandwidth import time_graph  # noqa: E402
from kivi_kernels import decode_bytes, decode_inputs  # noqa: E402

from sparsecompile.kernels import kivi_attention  # noqa: E402
from sparsecompile.kernels.kivi_reference import kivi_decode_attention_reference  # noqa: E402


def kernel_times(fn, calls: int = 20) -> dict[str, float]:
    """Mean microseconds a call of each CUDA kernel ``fn`` launches (eager calls under the profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key[:60]: round(e.device_time_total / calls, 2) for e in prof.key_averages() if e.device_time_total > 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", required=True)
    parser.add_argument("--bits", default="2,4")
    parser.add_argument("--points", default="32768x1,131072x4", help="CONTEXTxBATCH,...")
    parser.add_argument("--ring-configs", default="[]", help="JSON list of KIVI_RING_COMBINE_CONFIG updates")
    args = parser.parse_args()
    configs = [None, *json.loads(args.ring_configs)]
    points = [tuple(int(v) for v in p.lower().split("x")) for p in args.points.split(",")]
    for bits in (int(b) for b in args.bits.split(",")):
        for context, batch in points:
            sets = decode_inputs(batch, context, bits, 3)
            want = kivi_decode_attention_reference(*sets[0]).float()
            for config in configs:
                if config is not None:
                    from sparsecompile.kernels import kivi_residual
                    kivi_residual.KIVI_RING_COMBINE_CONFIG.update(config)
                err = (kivi_attention.kivi_decode_attention_triton(*sets[0]).float() - want).abs().max().item()
                us = time_graph([lambda a=a: kivi_attention.kivi_decode_attention_triton(*a) for a in sets], 30) * 1e6
                row = {"arm": args.arm, "bits": bits, "batch": batch, "context": context, "us": us,
                       "GBps": decode_bytes(batch, context, bits) / us / 1e3, "err": err, "ring_config": config}
                if config is None:
                    row["kernels_us"] = kernel_times(lambda a=sets[0]: kivi_attention.kivi_decode_attention_triton(*a))
                print(json.dumps(row), flush=True)
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
