"""The method registry: the one place that maps a method name to its config and runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import MethodConfig, MethodConfigError, SparseMethodRuntime

if TYPE_CHECKING:
    from ..models.support import ModelInfo

_METHODS: dict[str, type[SparseMethodRuntime]] = {}


def register_method(runtime: type[SparseMethodRuntime]) -> type[SparseMethodRuntime]:
    """Class decorator: make ``runtime`` available as ``optimize(model, method=runtime.name)``."""
    if not runtime.name:
        raise ValueError(f"{runtime.__name__} has no method name")
    _METHODS[runtime.name] = runtime
    return runtime


def available_methods() -> list[str]:
    return sorted(_METHODS)


def method_class(name: str) -> type[SparseMethodRuntime]:
    if name not in _METHODS:
        raise MethodConfigError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")
    return _METHODS[name]


def make_config(name: str, options: dict[str, Any]) -> MethodConfig:
    """Validate ``options`` for method ``name`` into its config dataclass (clear errors on bad input)."""
    cls = method_class(name)
    return cls.config_class.from_options(name, options)


def build_runtime(name: str, options: dict[str, Any], model: ModelInfo) -> SparseMethodRuntime:
    cls = method_class(name)
    return cls(make_config(name, options), model)
