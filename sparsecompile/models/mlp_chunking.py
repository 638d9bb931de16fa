"""Split the MLP of a long prefill forward into token chunks, so its activations stay small.

A whole-prompt prefill runs each layer's MLP over every token at once: at 128K tokens the Llama-3.1-8B gate and up
projections and their product are three ``[128K, 14336]`` bf16 tensors, about 10.5 GiB of transient activations on
top of the KV pool. The MLP is per token, so running it over chunks of ``tokens`` tokens of the flattened batch
(written into one output buffer) gives the same result with a fraction of the activations, while attention still
sees the whole chunk.

Only Llama-style MLP modules are wrapped (``up_proj`` and ``down_proj`` attributes, one hidden-states argument, a
tensor out): a forward with other arguments, a 2-D input (MoE experts get gathered tokens), a short input, or a
traced call (``torch.compile`` decode steps, ``torch.export``) runs the original forward unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

_ATTR = "_sparsecompile_mlp_chunk"


def _exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())


def _chunked(forward: Callable, tokens: int) -> Callable:
    """``forward`` over runs of at most ``tokens`` rows of the flattened ``[batch * seq, hidden]`` input.

    Chunks are rows of the flattened tokens, not slices of the sequence axis: with a batch above 1, a slice
    ``hidden[:, a:b]`` is strided and was copied to a contiguous buffer before its projections (H200, 32K x 4,
    one profiled call each: a 132 ms elementwise kernel gone, ``aten::copy_`` 292 -> 175 ms against HF's 160), and
    a call held ``batch x tokens`` rows (peak 42.0 -> 39.2 GiB). A contiguous row range is a view and bounds a
    call's activations by ``tokens`` whatever the batch. (The prefill time did not move, 5.587 -> 5.583 s; in those
    profiles the GEMMs took 90 ms more, 2.463 -> 2.553 s; ``results/prefill_h200_rowchunks_b4*.jsonl``.)"""
    def run(hidden: torch.Tensor, *args, **kwargs):
        if (args or kwargs or torch.compiler.is_compiling() or _exporting() or not isinstance(hidden, torch.Tensor)
                or hidden.dim() != 3 or hidden.shape[0] * hidden.shape[1] <= tokens):
            return forward(hidden, *args, **kwargs)
        rows = hidden.reshape(1, -1, hidden.shape[-1])  # a view of a contiguous input
        first = forward(rows[:, :tokens])
        if not isinstance(first, torch.Tensor) or first.shape[:2] != (1, tokens):
            return forward(hidden)  # not a per-token MLP after all: the whole input, as the model asked
        out = first.new_empty((1, rows.shape[1], *first.shape[2:]))
        out[:, :tokens] = first
        del first
        for start in range(tokens, rows.shape[1], tokens):
            out[:, start:start + tokens] = forward(rows[:, start:start + tokens])
        return out.view(*hidden.shape[:2], *out.shape[2:])

    return run


def chunk_mlps(model: nn.Module, tokens: int) -> int:
    """Wrap every Llama-style MLP of ``model`` to run inputs longer than ``tokens`` tokens in chunks; returns how
    many were wrapped (0 when ``tokens`` is 0)."""
    if tokens <= 0:
        return 0
    wrapped = 0
    for module in model.modules():
        if not (hasattr(module, "up_proj") and hasattr(module, "down_proj")) or _ATTR in module.__dict__:
            continue
        if "forward" in module.__dict__:  # someone else's instance-level patch: leave it alone
            continue
        module.__dict__["forward"] = _chunked(module.forward, tokens)
        module.__dict__[_ATTR] = tokens
        wrapped += 1
    return wrapped


def unchunk_mlps(model: nn.Module) -> None:
    """Undo :func:`chunk_mlps`."""
    for module in model.modules():
        if module.__dict__.pop(_ATTR, None) is not None:
            module.__dict__.pop("forward", None)
