"""sparsecompile: a sparse-first, torch.compile-centric LLM inference engine.

    import sparsecompile
    model = sparsecompile.optimize(model, method="vanilla")   # any HF causal LM, patched in place
    out = model.generate(**inputs, max_new_tokens=64)          # the normal HF generate()
    print(sparsecompile.kv_stats(model).summary())
"""

from __future__ import annotations

from . import kernels  # noqa: F401  (registers the torch.ops.sparsecompile ops)
from .api import kv_stats, retained_positions
from .llm import LLM
from .methods import MethodConfigError, available_methods
from .models.hf_cache import SparseCache
from .models.support import UnsupportedModelError
from .optimize import optimize, restore
from .passes import CaptureError
from .runtime.outputs import CompletionOutput, RequestOutput, RequestRejected, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "CaptureError", "CompletionOutput", "MethodConfigError", "RequestOutput", "RequestRejected",
    "SamplingParams",
    "SparseCache", "UnsupportedModelError", "available_methods", "kv_stats", "optimize", "restore",
    "retained_positions",
]
