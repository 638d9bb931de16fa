"""sparsecompile: a sparse-first, torch.compile-centric LLM inference engine.

    import sparsecompile
    model = sparsecompile.optimize(model, method="vanilla")   # any HF causal LM, patched in place
    out = model.generate(**inputs, max_new_tokens=64)          # the normal HF generate()
    print(sparsecompile.kv_stats(model).summary())

The public names load on first use (importing the package does not import torch), so ``sparsecompile --help``
and tools that only read ``sparsecompile.config`` start instantly.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "llm",
    "CaptureError": "passes",
    "CompletionOutput": "serving.outputs",
    "EngineConfig": "config",
    "MethodConfigError": "config",
    "RequestOutput": "serving.outputs",
    "RequestOutputKind": "serving.outputs",
    "RequestRejected": "serving.outputs",
    "SamplingParams": "serving.outputs",
    "ServingConfig": "config",
    "SparseCache": "models.hf_cache",
    "TensorParallelError": "runtime.distributed",
    "UnsupportedModelError": "models.support",
    "available_methods": "methods",
    "compress": "api",
    "export": "export",
    "load": "export",
    "kv_stats": "api",
    "optimize": "optimize",
    "patched": "optimize",
    "restore": "optimize",
    "retained_positions": "api",
    "warmup": "api",
}

__all__ = [
    "LLM", "CaptureError", "CompletionOutput", "EngineConfig", "MethodConfigError", "RequestOutput",
    "RequestOutputKind", "RequestRejected", "SamplingParams", "ServingConfig", "SparseCache", "TensorParallelError",
    "UnsupportedModelError", "available_methods", "compress", "export", "kv_stats", "load", "optimize", "patched",
    "restore", "retained_positions", "warmup",
]


def _load(name: str) -> Any:
    importlib.import_module(f"{__name__}.kernels")  # registers the torch.ops.sparsecompile ops
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sparsecompile' has no attribute {name!r}")
    value = _load(name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """``sparsecompile.optimize`` / ``sparsecompile.export`` stay the functions: importing the submodule of the same
    name makes the import system bind the module to that attribute, which these properties ignore."""

    @property
    def optimize(self) -> Any:
        return _load("optimize")

    @optimize.setter
    def optimize(self, value: Any) -> None:
        pass

    @property
    def export(self) -> Any:
        return _load("export")

    @export.setter
    def export(self, value: Any) -> None:
        pass


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # static analysers see the eager imports
    from .api import compress, kv_stats, retained_positions, warmup
    from .config import EngineConfig, MethodConfigError, ServingConfig
    from .export import export, load
    from .llm import LLM
    from .methods import available_methods
    from .models.hf_cache import SparseCache
    from .models.support import UnsupportedModelError
    from .optimize import optimize, patched, restore
    from .passes import CaptureError
    from .runtime.distributed import TensorParallelError
    from .serving.outputs import CompletionOutput, RequestOutput, RequestOutputKind, RequestRejected, SamplingParams
