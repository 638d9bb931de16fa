"""The method registry: the one place that maps a method name to its config and runtime.

A name is a registered method (``snapkv``) or a composition ``<policy>+<format>`` (``snapkv+kivi``): a retention
policy (which tokens stay) with a storage format (how the CacheManager stores them, ``methods/kivi.py``). A format
registers a ``compose(policy_class) -> runtime_class`` function, which accepts or refuses the policy with the reason;
compositions are built on first use and cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import MethodConfig, MethodConfigError
from ..runtime.contract import PrefillMode, SparseMethod
from ..runtime.model_info import ModelInfo

_METHODS: dict[str, type[SparseMethod]] = {}
_FORMATS: dict[str, tuple[Callable[[type[SparseMethod]], type[SparseMethod]],
                          Callable[[type[SparseMethod]], str | None]]] = {}
_COMPOSED: dict[str, type[SparseMethod]] = {}


def register_method(runtime: type[SparseMethod]) -> type[SparseMethod]:
    """Class decorator: make ``runtime`` available as ``optimize(model, method=runtime.name)``.

    Checks the class's declarations here, once, so a malformed method fails at import, not mid-request.
    """
    _check(runtime)
    _METHODS[runtime.name] = runtime
    return runtime


def _check(runtime: type[SparseMethod]) -> None:
    if not runtime.name:
        raise ValueError(f"{runtime.__name__} has no method name")
    if not isinstance(runtime.prefill_mode, PrefillMode):
        raise TypeError(f"{runtime.__name__}.prefill_mode must be a PrefillMode, got {runtime.prefill_mode!r}")
    if not issubclass(runtime.config_class, MethodConfig):
        raise TypeError(f"{runtime.__name__}.config_class must subclass MethodConfig")


def register_format(name: str, compose: Callable[[type[SparseMethod]], type[SparseMethod]],
                    refusal: Callable[[type[SparseMethod]], str | None]) -> None:
    """A storage format usable as ``<policy>+<name>``: ``compose`` builds the runtime class (raising
    :class:`MethodConfigError` with the reason for a policy it refuses), ``refusal`` says why without building."""
    _FORMATS[name] = (compose, refusal)


def available_methods() -> list[str]:
    """Registered methods and the compositions their storage formats accept (``vanilla+<format>`` is ``<format>``)."""
    composed = [f"{policy}+{fmt}" for fmt, (_, refusal) in _FORMATS.items() for policy, cls in _METHODS.items()
                if cls.needs_cache_access and refusal(cls) is None]
    return sorted(_METHODS) + sorted(composed)


def method_class(name: str) -> type[SparseMethod]:
    if name in _METHODS:
        return _METHODS[name]
    if "+" in name:
        return _composition(name)
    raise MethodConfigError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")


def _composition(name: str) -> type[SparseMethod]:
    """``<policy>+<format>``, built once (clear errors for anything else)."""
    if name in _COMPOSED:
        return _COMPOSED[name]
    parts = name.split("+")
    formats = ", ".join(sorted(_FORMATS)) or "(none)"
    if len(parts) != 2 or not all(parts):
        raise MethodConfigError(f"method {name!r}: a composition is one retention policy and one storage format, "
                                f"'<policy>+<format>' (e.g. 'snapkv+kivi'); storage formats: {formats}")
    policy, fmt = parts
    if fmt not in _FORMATS:
        if policy in _FORMATS and fmt in _METHODS:
            raise MethodConfigError(f"method {name!r}: write the retention policy first: '{fmt}+{policy}'")
        raise MethodConfigError(f"method {name!r}: {fmt!r} is not a storage format; storage formats: {formats}")
    if policy not in _METHODS:
        raise MethodConfigError(f"method {name!r}: unknown retention policy {policy!r}; methods: "
                                f"{', '.join(sorted(_METHODS))}")
    runtime = _FORMATS[fmt][0](_METHODS[policy])
    _check(runtime)
    _COMPOSED[name] = runtime
    return runtime


def option_owners(option: str) -> list[str]:
    """The methods that declare ``option`` (for messages about an option given to another method)."""
    return [name for name in available_methods() if option in method_class(name).config_class.option_names()]


def fill_text_options(method: str, options: dict[str, Any], tokenizer) -> None:
    """Fill, in ``options``, the method's token-id options that default to a text (KVzip's lead-ins) with
    ``tokenizer``'s ids; options already given stay; no tokenizer (or one that cannot encode text): the method's
    tokenizer-less default applies."""
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        return
    for name, text in method_class(method).config_class.text_options().items():
        if options.get(name) is None:
            try:
                options[name] = list(encode(text, add_special_tokens=False))
            except Exception:  # noqa: BLE001 - a tokenizer that cannot encode text: the method's default applies
                return


def make_config(name: str, options: dict[str, Any]) -> MethodConfig:
    """Validate ``options`` for method ``name`` into its config dataclass (clear errors on bad input)."""
    cls = method_class(name)
    return cls.config_class.from_options(name, options)


def build_runtime(name: str, options: dict[str, Any], model: ModelInfo) -> SparseMethod:
    cls = method_class(name)
    return cls(make_config(name, options), model)
