"""Session probe (#14, the cold first call): can the decode step compile one decoder layer's graph for all layers
through ``torch.compiler.nested_compile_region``? CPU, tiny Llama, ``vanilla``, q/k/v not colocated
(``fuse_projections=False``: colocated weights are views of one buffer, refused as aliased inputs).

    python benchmarks/sessions/regional_decode_probe.py [LAYERS]

2026-12-04, torch 2.13 (CPU build): dynamo traces the region once with the layer's state as inputs (the per-layer
``layer_keys`` tensor, the pools, lengths, block table; the layer index no longer specializes), but AOTAutograd then
refuses the subgraph: ``sparsecompile::kv_write`` mutates the pools inside it, and ``invoke_subgraph`` does not
functionalize custom ops that mutate their inputs (upstream: pytorch/pytorch#189523, a region that mutates its inputs
plus an alias-annotated custom op; a fix was proposed in #189543; not in torch 2.13 here nor in the GPU image's 2.11).
So the decode step cannot be regionally compiled this way while its layers write the KV cache; the prefill's way
(each layer's ``forward`` compiled on its own, ``runtime.compilation.compile_forward`` with the layer index symbolic)
would work with the attention hooks inside the layer graph and one CUDA graph captured around the whole step
(compile_scaling.py: ~1.15-1.8 s a layer on the CPU).
Prints the outcome as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
CACHE = tempfile.mkdtemp()
os.environ["SPARSECOMPILE_CACHE"] = CACHE
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(CACHE, "inductor")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from decode import row_method  # noqa: E402
from serving import make_model  # noqa: E402

import sparsecompile  # noqa: E402
import sparsecompile.passes.capture as capture  # noqa: E402


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    model = make_model(layers, True, "cpu")
    cls = type(model.model.layers[0])
    cls.forward = torch.compiler.nested_compile_region(cls.forward)
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    capture.check_capture = lambda gm, sites: None  # its attention ops now sit inside the region's subgraph
    name, options = row_method("vanilla")
    sparsecompile.optimize(model, name, compile=True, cuda_graphs=False, fuse_projections=False, **options)
    start = time.perf_counter()
    try:
        model.generate(torch.randint(3, 1000, (1, 200)), max_new_tokens=3, do_sample=False)
        outcome = "compiled"
    except Exception as err:  # noqa: BLE001 - the probe reports why it fails
        lines = str(err).splitlines()
        cause = next((lines[i + 1] for i, line in enumerate(lines[:-1]) if line.endswith("raised:")), lines[0])
        outcome = f"{type(err).__name__}: {cause[:300]}"
    print(json.dumps({"layers": layers, "seconds": round(time.perf_counter() - start, 1), "outcome": outcome}))


if __name__ == "__main__":
    main()
