"""Sparse methods: one file each (a validated config dataclass plus its :class:`SparseMethod` hooks).

Importing this package registers the built-in methods. The contract they implement lives in
``runtime/contract.py`` (the KV core drives it); ``eviction.py`` and ``read_stats.py`` are shared helpers.
"""

from ..config import MethodConfig, MethodConfigError
from ..runtime.contract import LayerContext, PrefillMode, SparseMethod
from . import (
    h2o,  # noqa: F401  (registers)
    kivi,  # noqa: F401  (registers the kivi method and storage format)
    kvzip,  # noqa: F401  (registers)
    omnikv,  # noqa: F401  (registers)
    pyramidkv,  # noqa: F401  (registers)
    quest,  # noqa: F401  (registers)
    snapkv,  # noqa: F401  (registers)
    streamingllm,  # noqa: F401  (registers)
    vanilla,  # noqa: F401  (registers)
)
from .registry import (
    available_methods,
    build_runtime,
    make_config,
    method_class,
    option_owners,
    register_format,
    register_method,
)

SparseMethodRuntime = SparseMethod  # the contract's name before it moved to runtime/contract.py

__all__ = [
    "LayerContext", "MethodConfig", "MethodConfigError", "PrefillMode", "SparseMethod", "SparseMethodRuntime",
    "available_methods", "build_runtime", "make_config", "method_class", "option_owners", "register_format",
    "register_method",
]
