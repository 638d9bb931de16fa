"""Session experiment (#14, the cold first call): how a decode step's cold compile grows with the layer count, on the
CPU (tiny Llama, ``compile=True``, fresh inductor and sparsecompile caches per run). What a step compiled a layer at a
time (one layer's graph reused by all) would leave is about the fixed part.

    python benchmarks/sessions/compile_scaling.py LAYERS METHOD     # one JSON line: first / second generate() seconds
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # (CPU: sparsecompile's Triton kernels are never launched here)
CACHE = tempfile.mkdtemp()
os.environ["SPARSECOMPILE_CACHE"] = CACHE  # cold: nothing compiled before
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(CACHE, "inductor")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from decode import row_method  # noqa: E402
from serving import make_model  # noqa: E402

import sparsecompile  # noqa: E402


def main() -> None:
    layers, method = int(sys.argv[1]), sys.argv[2]
    model = make_model(layers, True, "cpu")
    name, options = row_method(method)
    sparsecompile.optimize(model, name, compile=True, cuda_graphs=False, **options)
    ids = torch.randint(3, 1000, (1, 200))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=3, do_sample=False)
        times.append(time.perf_counter() - start)
    print(json.dumps({"layers": layers, "method": method, "first_s": round(times[0], 1),
                      "second_s": round(times[1], 2), "extra_s": round(times[0] - times[1], 1)}), flush=True)


if __name__ == "__main__":
    main()
