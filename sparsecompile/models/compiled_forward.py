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
and forwards with input embeddings run eagerly.
"""

from __future__ import annotations

from collections.abc import Iterator
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


class CompiledForward:
    """``inner(input_ids, inputs_embeds, position_ids, logits_to_keep) -> logits`` of a patched model, compiled
    once with a dynamic token count (a drop-in for the patched model's ``inner`` in prefill and mixed steps)."""

    def __init__(self, model: nn.Module) -> None:
        patched = patched_model(model)
        self.model = model
        self.controller = patched.controller
        self.eager = patched.inner
        self.max_tokens = patched.controller.config.prefill_mlp_chunk or None
        self._stand_in = OpaqueAttention()  # one object: dynamo's guards see the same attribute every call
        eager = self.eager

        def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep) -> torch.Tensor:
            return eager(input_ids=input_ids, inputs_embeds=None, position_ids=position_ids,
                         logits_to_keep=logits_to_keep)

        self._compiled = compile_forward(forward)

    def __call__(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, position_ids: torch.Tensor,
                 logits_to_keep=0) -> torch.Tensor:
        if input_ids is None or inputs_embeds is not None or (
                self.max_tokens is not None and input_ids.numel() > self.max_tokens):
            return self.eager(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
                              logits_to_keep=logits_to_keep)
        if not isinstance(logits_to_keep, torch.Tensor):  # one graph for both forms (an int k keeps the last k)
            tokens = input_ids.shape[1]
            logits_to_keep = torch.arange(max(tokens - logits_to_keep, 0) if logits_to_keep else 0, tokens,
                                          device=input_ids.device)
        with opaque_attention(self.model, self._stand_in), serving(self.controller):
            return self._compiled(input_ids, position_ids, logits_to_keep)
