"""The method registry: the one place that maps a method name to its config and runtime."""

from __future__ import annotations

from typing import Any

from ..config import MethodConfig, MethodConfigError
from ..runtime.contract import PrefillMode, SparseMethod
from ..runtime.model_info import ModelInfo

_METHODS: dict[str, type[SparseMethod]] = {}


def register_method(runtime: type[SparseMethod]) -> type[SparseMethod]:
    """Class decorator: make ``runtime`` available as ``optimize(model, method=runtime.name)``.

    Checks the class's declarations here, once, so a malformed method fails at import, not mid-request.
    """
    if not runtime.name:
        raise ValueError(f"{runtime.__name__} has no method name")
    if not isinstance(runtime.prefill_mode, PrefillMode):
        raise TypeError(f"{runtime.__name__}.prefill_mode must be a PrefillMode, got {runtime.prefill_mode!r}")
    if not issubclass(runtime.config_class, MethodConfig):
        raise TypeError(f"{runtime.__name__}.config_class must subclass MethodConfig")
    _METHODS[runtime.name] = runtime
    return runtime


def available_methods() -> list[str]:
    return sorted(_METHODS)


def method_class(name: str) -> type[SparseMethod]:
    if name not in _METHODS:
        raise MethodConfigError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")
    return _METHODS[name]


def option_owners(option: str) -> list[str]:
    """The methods that declare ``option`` (for messages about an option given to another method)."""
    return [name for name in available_methods() if option in _METHODS[name].config_class.option_names()]


def make_config(name: str, options: dict[str, Any]) -> MethodConfig:
    """Validate ``options`` for method ``name`` into its config dataclass (clear errors on bad input)."""
    cls = method_class(name)
    return cls.config_class.from_options(name, options)


def build_runtime(name: str, options: dict[str, Any], model: ModelInfo) -> SparseMethod:
    cls = method_class(name)
    return cls(make_config(name, options), model)
