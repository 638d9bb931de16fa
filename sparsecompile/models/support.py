"""Model introspection and the support registry: what we can serve correctly, and why not otherwise.

We never run a model silently dense or silently wrong: a feature our attention op does not
implement yet (logit softcapping, attention sinks, MLA, ALiBi, bidirectional attention, linear
attention layers, K/V shared across layers, per-layer head shapes) is refused at ``optimize()`` with the reason.
"""

from __future__ import annotations

import torch
from torch import nn

from ..runtime.model_info import ModelInfo


class UnsupportedModelError(ValueError):
    """The model cannot be served correctly by sparsecompile; the message names the reason."""


# model_type -> reason we refuse it (features not implemented yet, or no hook point).
_REFUSED_MODEL_TYPES = {
    "bloom": "ALiBi attention without an AttentionInterface hook point",
    "mpt": "ALiBi attention without an AttentionInterface hook point",
    "gpt_oss": "attention sinks (s_aux) are not implemented yet",
    "deepseek_v2": "multi-head latent attention (MLA) is not implemented yet",
    "deepseek_v3": "multi-head latent attention (MLA) is not implemented yet",
}


def text_config(model: nn.Module):
    return decoder_config(model.config)


def decoder_config(config):
    """The language model's part of a (possibly multimodal) config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The per-layer self-attention modules (those carrying ``layer_idx``), in layer order."""
    found = [(name, m) for name, m in model.named_modules()
             if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)]
    return sorted(found, key=lambda item: item[1].layer_idx)


_OFFLOAD_PLACES = ("cpu", "disk", "meta")


def _place(value) -> str:
    """A ``hf_device_map`` value as a device name (accelerate writes GPU indices as ints)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"cuda:{value}"
    text = str(value)
    return "cuda:0" if text == "cuda" else text


def check_placement(model: nn.Module, model_type: str) -> None:
    """Refuse weights we cannot place: offloaded by accelerate (CPU / disk / meta), or spread over several devices.

    The KV pool and the compiled decode step live on one device next to every weight; accelerate's offload hooks
    move weights in and out around each module's forward, which our capture and pool do not follow.
    """
    device_map = getattr(model, "hf_device_map", None) or {}
    by_place: dict[str, list[str]] = {}
    for module, value in device_map.items():
        by_place.setdefault(_place(value), []).append(module or "(whole model)")
    offloaded = {p: m for p, m in by_place.items() if p in _OFFLOAD_PLACES}
    devices = sorted(p for p in by_place if p not in _OFFLOAD_PLACES)
    if offloaded and (devices or "disk" in offloaded or "meta" in offloaded):
        where = "; ".join(f"{', '.join(m[:3])}{' ...' if len(m) > 3 else ''} on {p}" for p, m in offloaded.items())
        raise UnsupportedModelError(
            f"{model_type}: its device_map offloads weights ({where}): sparsecompile needs every weight resident on "
            "the device that runs it; load the model on one device (no device_map, or device_map='cuda:0') with "
            "enough memory, or a smaller / quantized checkpoint")
    if len(devices) > 1:
        raise UnsupportedModelError(
            f"{model_type}: its device_map spreads the layers over {len(devices)} devices ({', '.join(devices)}); "
            "sparsecompile runs a model on one device. Load it on one GPU, or split it with tensor parallelism "
            "(sparsecompile.LLM(..., tensor_parallel_size=N), the tp_size engine option) instead of a device_map")
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    meta = [name for name, t in tensors if t.is_meta]
    if meta:
        raise UnsupportedModelError(
            f"{model_type}: {len(meta)} weights are on the meta device (e.g. {meta[0]}): the model was built without "
            "its weights (init_empty_weights) or accelerate offloads them (cpu_offload / disk_offload, a device_map "
            "with cpu or disk entries). Load the weights onto one device first")
    placed = sorted({str(t.device) for _, t in tensors})
    if len(placed) > 1:
        raise UnsupportedModelError(
            f"{model_type}: its weights are on several devices ({', '.join(placed)}); move the model to one device "
            "(model.to('cuda')) before sparsecompile.optimize(), or use tensor parallelism to split it over GPUs")


def inspect_model(model: nn.Module) -> ModelInfo:
    """Describe ``model`` or raise :class:`UnsupportedModelError` saying why it cannot be served."""
    config = text_config(model)
    model_type = getattr(config, "model_type", type(model).__name__)
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{model_type}: encoder-decoder models are not supported (causal LMs only)")
    if not hasattr(model, "generate"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a generative model")
    check_placement(model, model_type)
    if model_type in _REFUSED_MODEL_TYPES:
        raise UnsupportedModelError(f"{model_type}: {_REFUSED_MODEL_TYPES[model_type]}")
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModelError(f"{model_type}: attention logit softcapping "
                                    f"({config.attn_logit_softcapping}) is not implemented yet")
    if getattr(config, "kv_lora_rank", None):
        raise UnsupportedModelError(f"{model_type}: multi-head latent attention (MLA) is not implemented yet")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        raise UnsupportedModelError(f"{model_type}: bidirectional attention is not supported (causal attention only)")
    layer_types = getattr(config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise UnsupportedModelError(f"{model_type}: layer types {odd} are not supported "
                                    "(only full and sliding-window attention layers)")
    modules = attention_modules(model)
    num_layers = getattr(config, "num_hidden_layers", None)
    if not modules:
        raise UnsupportedModelError(f"{model_type}: no attention module with a layer_idx, so no hook point")
    if num_layers is not None and len(modules) != num_layers:
        raise UnsupportedModelError(f"{model_type}: found {len(modules)} attention modules for {num_layers} layers")
    for _, module in modules:
        if any(isinstance(p, nn.Parameter) and name == "sinks" for name, p in module.named_parameters(recurse=False)):
            raise UnsupportedModelError(f"{model_type}: attention sinks are not implemented yet")
    shared = sum(bool(getattr(module, "is_kv_shared_layer", False)) for _, module in modules)
    if shared or getattr(config, "num_kv_shared_layers", 0):
        raise UnsupportedModelError(f"{model_type}: its last {shared or config.num_kv_shared_layers} layers reuse "
                                    "earlier layers' K/V (KV sharing), which the per-layer KV pool does not model yet")
    q_heads = _shared(config, "num_attention_heads", model_type)
    kv_heads = _shared(config, "num_key_value_heads", model_type) or q_heads
    head_dim = (_shared(config, "head_dim", model_type) or getattr(modules[0][1], "head_dim", None)
                or config.hidden_size // q_heads)
    if q_heads % kv_heads:
        raise UnsupportedModelError(f"{model_type}: {q_heads} query heads are not a multiple of {kv_heads} KV heads")
    return ModelInfo(model_type, len(modules), q_heads, kv_heads, int(head_dim), tuple(n for n, _ in modules),
                     getattr(config, "max_position_embeddings", None))


def _shared(config, name: str, model_type: str):
    """``config.<name>``, which every layer must share: the KV pool holds one shape for all layers. transformers'
    heterogeneous configs (``per_layer_config``, e.g. Gemma 4's wider full-attention heads) may differ per layer."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is not None:
        values = {getattr(layer, name, None) for layer in per_layer}
        if len(values) > 1:
            raise UnsupportedModelError(f"{model_type}: its layers differ in {name} ({sorted(values)}); sparsecompile "
                                        "keeps one KV shape for every layer, so per-layer shapes are not supported yet")
        if values:
            return values.pop()
    return getattr(config, name, None)


def model_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    param = next(model.parameters())
    return param.dtype, param.device
