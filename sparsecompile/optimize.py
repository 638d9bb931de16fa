"""``sparsecompile.optimize``: turn an unmodified HF causal LM into a sparse one, in place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .methods import MethodConfigError, build_runtime, method_class
from .models.attention import ATTN_IMPLEMENTATION, register_attention
from .models.colocate import colocate_projections, separate_projections
from .models.hf_patch import install, install_sdpa_fallback, uninstall
from .models.support import UnsupportedModelError, attention_modules, inspect_model, model_dtype_device, text_config
from .passes import CaptureError, capture_backend
from .runtime.controller import EngineConfig, SparseController

_ENGINE_OPTIONS = ("page_size", "prefill_chunk_size", "compile", "cuda_graphs", "num_pages", "show_progress",
                   "fuse_projections")


def optimize(model: nn.Module, method: str = "vanilla", **options: Any) -> nn.Module:
    """Patch ``model`` in place so that its attention and KV cache run through sparsecompile; returns it.

    Args:
        model: an HF causal LM (``AutoModelForCausalLM``); the normal ``model.generate()`` keeps working.
        method: a registered method name (``sparsecompile.available_methods()``).
        **options: the method's options (see its config dataclass) and engine options:
            ``page_size`` (16), ``prefill_chunk_size`` (2048; 0 = whole prompt), ``compile`` ("auto": decode
            steps compiled on CUDA), ``cuda_graphs`` ("auto"), ``num_pages`` (None: sized on demand),
            ``show_progress`` (False), ``fuse_projections`` (True: with compiled decode, q/k/v and gate/up
            weights share one buffer per layer, so each group is one GEMM; ``restore()`` separates them).

    Raises:
        MethodConfigError: unknown method, unknown or out-of-range option.
        UnsupportedModelError: the model uses something we cannot serve correctly (the message says what).
    """
    engine_options = {k: options.pop(k) for k in _ENGINE_OPTIONS if k in options}
    cls = method_class(method)
    unknown = set(options) - set(cls.config_class.option_names())
    if unknown:
        valid = ", ".join(cls.config_class.option_names() + list(_ENGINE_OPTIONS))
        raise MethodConfigError(f"unknown option(s) {', '.join(sorted(unknown))} for method {method!r}; "
                                f"valid options: {valid}")
    try:
        config = EngineConfig(**engine_options)
    except ValueError as err:
        raise MethodConfigError(str(err)) from None
    if "_sparsecompile" in model.__dict__:
        restore(model)
    info = inspect_model(model)
    runtime = build_runtime(method, options, info)
    dtype, device = model_dtype_device(model)
    controller = SparseController(runtime, info.num_layers, info.num_kv_heads, info.head_dim, dtype, device, config)
    if not _can_set_attention(model):
        if runtime.needs_cache_access:
            raise UnsupportedModelError(
                f"{info.model_type} ignores set_attn_implementation, so sparsecompile cannot reach its KV cache; only "
                f"method='vanilla' runs on it (through the SDPA-rewrite fallback), not {method!r}")
        install_sdpa_fallback(model, _want(config.compile, device), _want(config.cuda_graphs, device), info.num_layers)
        return model
    register_attention()
    previous = text_config(model)._attn_implementation
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except (ValueError, NotImplementedError) as err:
        raise UnsupportedModelError(f"{info.model_type}: cannot set a custom attention implementation "
                                    f"({err})") from None
    modules = [m for _, m in attention_modules(model)]
    install(model, controller, modules, info.max_position_embeddings)
    try:
        _check_capture(model, controller, info.num_layers)
    except BaseException:
        uninstall(model, modules)
        _set_attn(model, previous)
        raise
    model.__dict__["_sparsecompile_previous_attn"] = previous
    if _want(config.compile, device):
        cuda_graphs = _want(config.cuda_graphs, device) and device.type == "cuda"
        if config.fuse_projections:
            colocate_projections(model)
        controller.enable_compiled_decode(capture_backend(info.num_layers, cuda_graphs,
                                                          keep_order=runtime.reads_pool_across_layers,
                                                          fuse_linears=config.fuse_projections))
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`optimize`: release its cache state and give the model back its own attention."""
    patched = model.__dict__.get("_sparsecompile")
    if patched is None:
        return model
    uninstall(model, [m for _, m in attention_modules(model)])
    separate_projections(model)
    _set_attn(model, model.__dict__.pop("_sparsecompile_previous_attn", None) or "sdpa")
    return model


def _can_set_attention(model: nn.Module) -> bool:
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    return can_set() if callable(can_set) else True


def _want(flag: bool | str, device: torch.device) -> bool:
    return device.type == "cuda" if flag == "auto" else bool(flag)


def _set_attn(model: nn.Module, name: str | None) -> None:
    try:
        model.set_attn_implementation(name or "sdpa")
    except (ValueError, NotImplementedError):
        pass


def _check_capture(model: nn.Module, controller: SparseController, num_layers: int) -> None:
    """Run a 2-token forward and require exactly one sparsecompile attention call per layer."""
    before = controller.attention_calls
    ids = torch.zeros(1, 2, dtype=torch.long, device=model_dtype_device(model)[1])
    model(input_ids=ids, use_cache=False)
    calls = controller.attention_calls - before
    if calls != num_layers:
        raise CaptureError(f"{text_config(model).model_type}: {calls} of {num_layers} attention layers went through "
                           "sparsecompile (the model ignores set_attn_implementation); refusing to run silently dense")
