"""Session A/B (#20, 2026-12-05 twenty-fifth session): the package's KIVI decode op (captured in a CUDA graph) with
the package's Gluon kernel ("package") and with a variant module's (``--variant``: a ``kernels/kivi_gluon.py`` with
absolute imports, e.g. the key zeros' blocks of ``kivi_zero_blocks.patch`` as next.sh's zero_blocks builds it);
interleaved package / variant / package / variant, each output against the torch reference ("err") and against the
other arm's ("diff", expected 0 for that variant: the same products in the same order). Ran on an H100 (twenty-fifth
session, no faster) and the H200 (twenty-sixth, ``results/kivi_zero_blocks_ab_h200.jsonl``: bit-equal, 1-2 % slower;
the step too, ``kivi_zero_blocks_step_h200.jsonl``): the patch is not applied.

    python benchmarks/sessions/kivi_zero_blocks_ab.py --variant .carry/kivi_gluon_zero_blocks.py [--bits 2,4]
        [--points 32768x1,32768x16,131072x1,131072x4] [--variant-config '{"4": {"stages": 3}}']   # JSON lines

``--variant-config`` updates the variant's own ``KIVI_GLUON_CONFIG`` (its ring stages; the splits stay the
package's): the zero blocks' 4 KB buffer leaves 7 four-bit programs an SM by shared memory at 4 stages, 9 at 3.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bandwidth import time_graph  # noqa: E402
from kivi_kernels import decode_bytes, decode_inputs  # noqa: E402

from sparsecompile.kernels import kivi_attention, kivi_gluon  # noqa: E402
from sparsecompile.kernels.kivi_reference import kivi_decode_attention_reference  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, help="a kivi_gluon.py variant (absolute imports)")
    parser.add_argument("--bits", default="2,4")
    parser.add_argument("--points", default="32768x1,32768x16,131072x1,131072x4", help="CONTEXTxBATCH,...")
    parser.add_argument("--variant-config", default="{}", help="JSON: bits -> the variant's launch options")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("kivi_gluon_variant", args.variant)
    variant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variant)
    for bits, cfg in json.loads(args.variant_config).items():
        variant.KIVI_GLUON_CONFIG[int(bits)].update(cfg)
    modules = {"package": kivi_gluon, "variant": variant}
    points = [tuple(int(v) for v in p.lower().split("x")) for p in args.points.split(",")]
    for bits in (int(b) for b in args.bits.split(",")):
        for context, batch in points:
            sets = decode_inputs(batch, context, bits, 3)
            want = kivi_decode_attention_reference(*sets[0]).float()
            outs = {}
            for arm in ("package", "variant", "package", "variant"):
                kivi_attention.kivi_gluon_quantized = modules[arm].kivi_gluon_quantized
                outs[arm] = kivi_attention.kivi_decode_attention_triton(*sets[0]).float()
                us = time_graph([lambda a=a: kivi_attention.kivi_decode_attention_triton(*a) for a in sets], 30) * 1e6
                print(json.dumps({"bits": bits, "batch": batch, "context": context, "arm": arm, "us": us,
                                  "stages": modules[arm].KIVI_GLUON_CONFIG[bits]["stages"],
                                  "GBps": decode_bytes(batch, context, bits) / us / 1e3,
                                  "err": (outs[arm] - want).abs().max().item()}), flush=True)
            kivi_attention.kivi_gluon_quantized = kivi_gluon.kivi_gluon_quantized
            print(json.dumps({"bits": bits, "batch": batch, "context": context,
                              "diff": (outs["variant"] - outs["package"]).abs().max().item()}), flush=True)
            del want, sets, outs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
