"""Session rows (#20, 2026-12-04 fourteenth session): KIVI decode attention of an fp16 model (fp16 queries, scales and
residual) at the four decode points, through the op's default dispatch, with the error against the torch reference.
Run before and after ``sessions/kivi_gluon_fp16.patch`` (the Gluon kernel in fp16 units, :data:`_UNITS`), the label
says which.

    python benchmarks/sessions/kivi_fp16_rows.py LABEL   # JSON lines
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

from sparsecompile.kernels.kivi_attention import kivi_decode_attention_triton  # noqa: E402
from sparsecompile.kernels.kivi_reference import kivi_decode_attention_reference  # noqa: E402

HALF = (0, 3, 4, 5, 6, 8, 9)  # query, key / value scales and zeros, the residual rings


def main(label: str) -> None:
    for bits in (2, 4):
        for batch, context in ((1, 32768), (16, 32768), (1, 131072), (4, 131072)):
            sets = [tuple(t.half() if i in HALF else t for i, t in enumerate(a))
                    for a in decode_inputs(batch, context, bits, 3)]
            err = (kivi_decode_attention_triton(*sets[0]).float()
                   - kivi_decode_attention_reference(*sets[0]).float()).abs().max().item()
            us = time_graph([lambda a=a: kivi_decode_attention_triton(*a) for a in sets], 20) * 1e6
            print(json.dumps({"label": label, "dtype": "float16", "bits": bits, "batch": batch, "context": context,
                              "us": us, "GBps": decode_bytes(batch, context, bits) / us / 1e3, "err": err}),
                  flush=True)
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "default")
