"""Session script (#20): the KIVI decode kernel under a register cap, more programs per SM (the ncu warp state of
2026-12-04: 3.8 active warps a scheduler at 128 registers, 0.83 eligible; does more latency hiding pay for the
spills?). 2-bit, the four points of ``kivi_kernels.py``; JSON lines on stdout.

    python benchmarks/sessions/kivi_regcap.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bandwidth import time_graph  # noqa: E402
from kivi_kernels import decode_bytes, decode_inputs  # noqa: E402

from sparsecompile.kernels.kivi_attention import kivi_decode_attention_triton  # noqa: E402

CONFIGS = [None, {"maxnreg": 96, "programs_per_sm": 10}, {"maxnreg": 80, "programs_per_sm": 12},
           {"maxnreg": 96, "programs_per_sm": 8}, {"maxnreg": 64, "programs_per_sm": 16}]

for batch, context in ((1, 32768), (16, 32768), (1, 131072), (4, 131072)):
    sets = decode_inputs(batch, context, 2, 2)
    for config in CONFIGS:
        try:
            seconds = time_graph([lambda a=a, c=config: kivi_decode_attention_triton(*a, config=c) for a in sets], 10)
        except Exception as err:  # a configuration the compiler rejects
            print(json.dumps({"config": config, "error": str(err)[:200]}), flush=True)
            continue
        print(json.dumps({"batch": batch, "context": context, "config": config or "default", "us": seconds * 1e6,
                          "GBps": decode_bytes(batch, context, 2) / seconds / 1e9}), flush=True)
    del sets
    torch.cuda.empty_cache()
