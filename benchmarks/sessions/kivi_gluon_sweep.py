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
from sparsecompile.kernels.kivi_reference import kivi_decode_attention_reference  # noqa: E402

# fourteenth session, after the zero-share MMA (2 bits: 154 registers, 12 programs an SM by registers, 13 by shared
# memory at 4 stages; 3 stages: 14 by a cap of 144 (no spill offline), 16 by a cap of 128 (72 bytes of spill)):
# results/kivi_gluon_stages_sweep_h200.jsonl. Then the keys' logits as 1, 2 or 4 independent MMA chains summed at the
# end (qk_chains; offline 162 / 170 / 186 registers at 2 bits: 12 / 11 / 10 programs an SM), each variant's output
# against the torch reference ("err").
VARIANTS = {2: [{"stages": 3, "programs_per_sm": n, "qk_chains": c} for c, n in ((1, 12), (2, 12), (2, 11), (4, 12),
                                                                                (4, 10))],
            4: [{"stages": 4, "programs_per_sm": 16, "qk_chains": c} for c in (1, 2, 4)]}


def main() -> None:
    default = {bits: dict(cfg) for bits, cfg in kivi_gluon.KIVI_GLUON_CONFIG.items()}
    for bits in (2, 4):
        for batch, context in ((1, 32768), (16, 32768), (1, 131072), (4, 131072)):
            sets = decode_inputs(batch, context, bits, 3)
            want = kivi_decode_attention_reference(*sets[0]).float()
            for v in VARIANTS[bits]:
                kivi_gluon.KIVI_GLUON_CONFIG[bits] = dict(v)
                err = (kivi_decode_attention_triton(*sets[0]).float() - want).abs().max().item()
                us = time_graph([lambda a=a: kivi_decode_attention_triton(*a) for a in sets], 20) * 1e6
                print(json.dumps({"bits": bits, "batch": batch, "context": context, **v, "us": us,
                                  "GBps": decode_bytes(batch, context, bits) / us / 1e3, "err": err}), flush=True)
            del want
            del sets
            torch.cuda.empty_cache()
    kivi_gluon.KIVI_GLUON_CONFIG.update(default)


if __name__ == "__main__":
    main()
