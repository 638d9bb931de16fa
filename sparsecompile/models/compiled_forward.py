"""The serving engine's prefill and mixed-step forwards, compiled (``ServingConfig.compile_prefill``).

An eager forward of a patched model costs host time per op: on the H200 a serving step that carries a 256- or
512-token prompt chunk beside 8 decodes took ~72 ms whatever the chunk size (``results/serving_burst_h200_mixed*``),
about 5,000 dispatched ops of which ~2,200 are the HF modules' own (embeddings, norms, projections, RoPE, MLP:
counted on CPU with a tiny 32-layer Llama). Compiled with a dynamic token count, those become a few fused kernels
per layer. Attention stays what it is in eager mode: each layer is one opaque ``sparsecompile::attend`` op
(``runtime/attend_op.py``, the exported prefill program's form) that calls the controller back, so writes, method
hooks, eviction and the attention kernels run the same Python as an eager forward, and every method works
unchanged. The decode step keeps its own compiled graph (``runtime/compilation.py``).

Forwards longer than ``prefill_mlp_chunk`` tokens (whose MLP runs chunked in a Python loop over the token count)
run eagerly.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..runtime.attend_op import OpaqueAttention, serving
from ..runtime.compilation import compile_forward
from .attention import CONTROLLER_ATTR
from .hf_patch import patched_model
from .support import attention_modules


@contextmanager
def opaque_attention(model: nn.Module, stand_in: OpaqueAttention | None = None) -> Iterator[None]:
    """Inside the block, every attention layer of the patched ``model`` calls ``sparsecompile::attend`` instead of
    its controller (what a traced or compiled forward records)."""
    modules = [m for _, m in attention_modules(model)]
    saved = [m.__dict__[CONTROLLER_ATTR] for m in modules]
    stand_in = stand_in or OpaqueAttention()
    for module in modules:
        module.__dict__[CONTROLLER_ATTR] = stand_in
    try:
        yield
    finally:
        for module, controller in zip(modules, saved):
            module.__dict__[CONTROLLER_ATTR] = controller


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules holding each attention layer (the decoder layers), in layer order, less those whose ``forward``
    is already an instance attribute (a hook's wrapper, e.g. accelerate's): they run as they are."""
    layers = [model.get_submodule(name.rpartition(".")[0]) for name, _ in attention_modules(model)]
    return [layer for layer in layers if "forward" not in vars(layer)]


@contextmanager
def regional(layers: list[nn.Module], compiled: dict[type, Callable]) -> Iterator[None]:
    """Inside the block, every module of ``layers`` runs ``compiled[type(layer)](layer, ...)`` as its forward."""
    for layer in layers:
        layer.forward = types.MethodType(compiled[type(layer)], layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


class CompiledForward:
    """``inner(input_ids, inputs_embeds, position_ids, logits_to_keep) -> logits`` of a patched model with its
    decoder layers compiled (a drop-in for the patched model's ``inner`` in prefill and mixed steps).

    Regional compilation: each decoder-layer class's ``forward`` is compiled once, with a dynamic token count and
    the layer as an input (its parameters are graph inputs, its ``layer_idx`` a symbolic int), and every layer of
    that class runs the same graph; the rest of the model (embedding, rotary tables, final norm, LM head: a few
    ops) stays eager. Compiling the whole forward instead traced and lowered all layers as one graph: on the H200
    its first compile of a 32-layer 8B shape did not end within 520 s (``results/serving_burst_h200_
    compiled512_timeout.log``); compiled by layer, the whole burst run, compiles included, ends within its 260 s
    limit, and a step makes one compiled call per layer.

    Measured on the H200 (``results/step_ops_h200_regional*.jsonl``, ``serving_burst_h200_regional*``): a tiny
    32-layer model's mixed step (8 decodes + 256 prompt tokens) takes 36.8 ms of host time against 44.0 eager, but
    the 8B shape's burst is not faster (p99 71.5 ms against 72.2 capped eager at 512 prompt tokens a step): the
    attention callbacks, eager by design, are most of what remains (``results/step_profile_h200_regional.log``).
    """

    def __init__(self, model: nn.Module) -> None:
        patched = patched_model(model)
        self.model = model
        self.controller = patched.controller
        self.eager = patched.inner
        self.max_tokens = patched.controller.config.prefill_mlp_chunk or None
        self._stand_in = OpaqueAttention()  # one object: dynamo's guards see the same attribute every call
        self.layers = decoder_layers(model)
        self.compiled = {cls: compile_forward(cls.forward, layer_index_dynamic=True)
                         for cls in dict.fromkeys(type(layer) for layer in self.layers)}

    def __call__(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, position_ids: torch.Tensor,
                 logits_to_keep=0) -> torch.Tensor:
        tokens = (input_ids if input_ids is not None else inputs_embeds).shape[:2].numel()
        if self.max_tokens is not None and tokens > self.max_tokens:  # the chunked MLP's loop: eager
            return self.eager(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
                              logits_to_keep=logits_to_keep)
        with opaque_attention(self.model, self._stand_in), serving(self.controller), \
                regional(self.layers, self.compiled):
            return self.eager(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
                              logits_to_keep=logits_to_keep)
