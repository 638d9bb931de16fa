"""``sparsecompile.optimize``: turn an unmodified HF causal LM into a sparse one, in place."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .config import EngineConfig, MethodConfigError, split_options
from .methods import available_methods, build_runtime, method_class, option_owners
from .methods.eviction import EvictionConfig
from .models.attention import ATTN_IMPLEMENTATION, register_attention
from .models.colocate import colocate_projections, separate_projections
from .models.hf_patch import install, install_sdpa_fallback, patch_of, uninstall
from .models.prefill_modules import unwrap_prefill_modules, wrap_prefill_modules
from .models.support import UnsupportedModelError, attention_modules, inspect_model, model_dtype_device, text_config
from .models.tensor_parallel import plan_tensor_parallel
from .passes import CaptureError, capture_backend
from .runtime import distributed
from .runtime.compilation import decode_compiled, decode_cuda_graphs, enable_compile_caches, wanted
from .runtime.controller import SparseController
from .runtime.distributed import DistributedController


def eviction_methods() -> list[str]:
    """The registered methods that evict KV (their config takes ``budget`` / ``ratio`` of the prompt kept)."""
    return [name for name in available_methods() if issubclass(method_class(name).config_class, EvictionConfig)]


def split_method_options(method: str, options: dict[str, Any],
                         accepted: tuple[str, ...] = ("engine", "method")) -> dict[str, dict[str, Any]]:
    """Route ``options`` into engine / serving / method options for ``method`` (clear errors otherwise).

    Aliases of ``config.OPTION_ALIASES`` are resolved here (``compression_ratio`` for the eviction methods)."""
    cls = method_class(method)
    return split_options(options, method, cls.config_class.option_names(), accepted, owners=option_owners,
                         scopes={"eviction": eviction_methods()})


def check_model_object(model: Any) -> None:
    """Refuse, up front and saying what to pass instead, anything that is not an HF causal LM instance."""
    if isinstance(model, (str, os.PathLike)):
        raise TypeError(f"optimize() takes a loaded model, got the {type(model).__name__} {str(model)!r}: load it "
                        "first (transformers.AutoModelForCausalLM.from_pretrained(...)), or pass the path or model id "
                        "to sparsecompile.LLM(...)")
    if isinstance(model, type):
        raise TypeError(f"optimize() takes a model instance, got the class {model.__name__}: instantiate it "
                        f"({model.__name__}.from_pretrained(...))")
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() takes an HF causal LM (a torch.nn.Module with generate()), got a "
                        f"{type(model).__name__}")
    if getattr(model, "config", None) is None or not callable(getattr(model, "generate", None)):
        raise UnsupportedModelError(f"{type(model).__name__} is not an HF causal LM (a PreTrainedModel with a config "
                                    "and generate(), e.g. from AutoModelForCausalLM); a base model without its "
                                    "language-model head, or a plain nn.Module, cannot generate")


@contextlib.contextmanager
def patched(model: nn.Module, method: str = "vanilla", **options: Any) -> Iterator[nn.Module]:
    """``with sparsecompile.patched(model, method="snapkv", budget=512): model.generate(...)``: the model is
    optimized inside the block and restored on leaving it, also when the block raises.

    Takes what :func:`optimize` takes (``compression_ratio`` as kvpress means it, for the eviction methods).
    A model already optimized is refused: leaving the block would drop that earlier patch.
    """
    if patch_of(model) is not None:
        raise ValueError("the model is already optimized by sparsecompile; restore() it before entering "
                         "sparsecompile.patched(...), or call optimize() to change its method")
    optimize(model, method, **options)
    try:
        yield model
    finally:
        restore(model)


def optimize(model: nn.Module, method: str = "vanilla", **options: Any) -> nn.Module:
    """Patch ``model`` in place so that its attention and KV cache run through sparsecompile; returns it.

    Args:
        model: an HF causal LM (``AutoModelForCausalLM``); the normal ``model.generate()`` keeps working.
        method: a registered method name (``sparsecompile.available_methods()``).
        **options: the method's options (its config dataclass in ``methods/<method>.py``) and the engine options
            of :class:`sparsecompile.config.EngineConfig` (``page_size``, ``prefill_chunk_size``, ``compile``,
            ``cuda_graphs``, ``num_pages``, ``show_progress``, ``prefill_mlp_chunk``, ``fuse_pointwise``,
            ``fuse_projections``, ``compile_cache``, ``tp_size``:
            inside a ``torchrun`` job of N processes, N splits the model's heads, KV heads, MLP and vocabulary over
            the ranks, see ``models/tensor_parallel.py``, ``tp_timeout``; their defaults and help:
            ``sparsecompile generate --help``); aliases: ``block_size`` (vLLM) for ``page_size``,
            ``compression_ratio`` (kvpress: the fraction of the prompt removed) for an eviction method's ``ratio = 1 -
            compression_ratio``).

    Raises:
        TypeError: ``model`` is not a model instance (a path, a model id, a class).
        MethodConfigError: unknown method, unknown or out-of-range option (the message says which kind of option
            it was taken for).
        UnsupportedModelError: the model uses something we cannot serve correctly (the message says what): not a
            causal LM, weights offloaded to CPU / disk or still on the meta device, layers spread over several
            devices, attention features we do not implement.
    """
    check_model_object(model)
    routed = split_method_options(method, options)
    config = EngineConfig(**routed["engine"])
    if patch_of(model) is not None:
        restore(model)
    info = inspect_model(model)
    shard = None
    if config.tp_size > 1:  # join the group and check the split before anything changes (tensor_parallel.py)
        if not _can_set_attention(model):
            raise UnsupportedModelError(f"{info.model_type} ignores set_attn_implementation; tensor parallelism needs "
                                        "sparsecompile's attention")
        shard = plan_tensor_parallel(model, info, config.tp_size, config.tp_timeout)
        info = shard.info  # this rank's heads
    runtime = build_runtime(method, routed["method"], info)
    if shard is not None:
        shard.apply(model)
    dtype, device = model_dtype_device(model)
    controller = SparseController(runtime, info.num_layers, info.num_kv_heads, info.head_dim, dtype, device, config)
    if not _can_set_attention(model):
        if runtime.needs_cache_access:
            raise UnsupportedModelError(
                f"{info.model_type} ignores set_attn_implementation, so sparsecompile cannot reach its KV cache; only "
                f"method='vanilla' runs on it (through the SDPA-rewrite fallback), not {method!r}")
        install_sdpa_fallback(model, wanted(config.compile, device), wanted(config.cuda_graphs, device),
                              info.num_layers)
        return model
    register_attention()
    previous = text_config(model)._attn_implementation
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except (ValueError, NotImplementedError) as err:
        raise UnsupportedModelError(f"{info.model_type}: cannot set a custom attention implementation "
                                    f"({err})") from None
    modules = [m for _, m in attention_modules(model)]
    patched = install(model, controller, modules, info.max_position_embeddings)
    patched.previous_attn = previous
    if shard is not None:  # every controller call guarded: a rank's failure stops all ranks
        patched.controller = DistributedController(controller, distributed.current())
    try:
        _check_capture(model, controller, info.num_layers)
    except BaseException:
        uninstall(model, modules)
        _set_attn(model, previous)
        raise
    wrap_prefill_modules(model, config.prefill_mlp_chunk, config.fuse_pointwise)
    if decode_compiled(config.compile, device):
        if config.compile_cache:
            enable_compile_caches()
        if config.fuse_projections:
            colocate_projections(model)
        controller.enable_compiled_decode(capture_backend(
            info.num_layers, decode_cuda_graphs(config.compile, config.cuda_graphs, device),
            keep_order=runtime.reads_pool_across_layers, fuse_linears=config.fuse_projections))
        if config.compile_cache and shard is None:  # decode programs precompiled by warmup(programs=True) first
            from .serving.decode_programs import PrecompiledDecode

            controller.install_decode_step(PrecompiledDecode(model, controller, controller._compiled_decode))
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`optimize`: release its cache state and give the model back its own attention."""
    patch = patch_of(model)
    if patch is None:
        return model
    previous = getattr(patch, "previous_attn", None)
    uninstall(model, [m for _, m in attention_modules(model)])
    controller = getattr(patch, "controller", None)
    if controller is not None:
        # The pool goes now. Dynamo's trace of a compiled decode step leaves objects behind that refer to the cache
        # manager in reference cycles (variable trackers of the traced frame), freed only by the collector: without
        # it a model optimized again at once allocated its pool beside the old one (on the H200 the next method
        # at 32K x 16 ran out of memory beside a 64 GiB pool).
        controller.close()
        gc.collect()
    unwrap_prefill_modules(model)
    separate_projections(model)
    _set_attn(model, previous or "sdpa")
    return model


def _can_set_attention(model: nn.Module) -> bool:
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    return can_set() if callable(can_set) else True


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


__all__ = ["MethodConfigError", "UnsupportedModelError", "check_model_object", "eviction_methods", "optimize",
           "patched", "restore", "split_method_options"]
