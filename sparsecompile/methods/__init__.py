"""Sparse methods: one file each (a validated config dataclass plus its SparseMethodRuntime).

Importing this package registers the built-in methods.
"""

from . import (
    h2o,  # noqa: F401  (registers)
    omnikv,  # noqa: F401  (registers)
    pyramidkv,  # noqa: F401  (registers)
    quest,  # noqa: F401  (registers)
    snapkv,  # noqa: F401  (registers)
    streamingllm,  # noqa: F401  (registers)
    vanilla,  # noqa: F401  (registers)
)
from .base import LayerContext, MethodConfig, MethodConfigError, SparseMethodRuntime
from .registry import available_methods, build_runtime, make_config, method_class, register_method

__all__ = [
    "LayerContext", "MethodConfig", "MethodConfigError", "SparseMethodRuntime", "available_methods",
    "build_runtime", "make_config", "method_class", "register_method",
]
