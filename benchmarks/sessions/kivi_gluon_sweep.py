"""Session sweep (#20, 2026-12-04, thirteenth session): the package's KIVI decode op (Gluon quantized part, residual
split, combine) at the four decode points under launch variants of ``KIVI_GLUON_CONFIG``: programs an SM and a
register cap (thirteenth session: 184, 11 one-warp programs an SM instead of 9, offline 8 bytes of spill;
fourteenth: 144, 14 instead of 12, no spill).

    python benchmarks/sessions/kivi_gluon_sweep.py   # JSON lines
"""

from __future__ import annotations

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

# fourteenth session, after the zero-share MMA (2 bits: 154 registers, 12 programs an SM by registers, 13 by shared
# memory at 4 stages; 3 stages: 14 by a cap of 144 (no spill offline), 16 by a cap of 128 (72 bytes of spill))
VARIANTS = [{"stages": st, "programs_per_sm": n, "maxnreg": r}
            for st, n, r in ((4, 12, None), (3, 12, None), (3, 14, 144), (3, 16, 128), (4, 16, None), (4, 13, 144))]


def main() -> None:
    default = {bits: dict(cfg) for bits, cfg in kivi_gluon.KIVI_GLUON_CONFIG.items()}
    for bits in (2, 4):
        for batch, context in ((1, 32768), (16, 32768), (1, 131072), (4, 131072)):
            sets = decode_inputs(batch, context, bits, 3)
            for v in VARIANTS:
                kivi_gluon.KIVI_GLUON_CONFIG[bits] = dict(v)
                us = time_graph([lambda a=a: kivi_decode_attention_triton(*a) for a in sets], 20) * 1e6
                print(json.dumps({"bits": bits, "batch": batch, "context": context, **v, "us": us,
                                  "GBps": decode_bytes(batch, context, bits) / us / 1e3}), flush=True)
            del sets
            torch.cuda.empty_cache()
    kivi_gluon.KIVI_GLUON_CONFIG.update(default)


if __name__ == "__main__":
    main()
