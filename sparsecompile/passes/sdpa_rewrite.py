"""SDPA-rewrite fallback: replace raw SDPA nodes of a dynamo graph with ``sparsecompile::dense_attention``.

For models whose attention ignores ``set_attn_implementation`` (Falcon before transformers 5.25): there is no
hook where the cache could be handed over, so only dense attention (``vanilla``) can run this way; the KV stays
in transformers' own cache. The pass runs on dynamo's FX graph, before decomposition, where each SDPA
call is still one node.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from ..runtime.compilation import inductor_patches
from .capture import _is_sdpa

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def rewrite_sdpa(gm: fx.GraphModule) -> int:
    """Rewrite every SDPA node of ``gm`` in place; returns how many were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if not _is_sdpa(node):
            continue
        values = dict(_DEFAULTS)
        values.update(zip(_SDPA_PARAMS, node.args))
        values.update(node.kwargs)
        unknown = set(values) - set(_SDPA_PARAMS)
        if unknown:
            raise NotImplementedError(f"SDPA call with unsupported arguments {sorted(unknown)}")
        node.target = torch.ops.sparsecompile.dense_attention.default
        node.args = tuple(values[name] for name in _SDPA_PARAMS)
        node.kwargs = {}
        rewritten += 1
    gm.graph.lint()
    gm.recompile()
    return rewritten


def sdpa_rewrite_backend(use_inductor: bool, cuda_graphs: bool = False) -> Callable:
    """A dynamo backend that rewrites SDPA, then runs the graph eagerly or through inductor."""

    def backend(gm: fx.GraphModule, example_inputs):
        backend.rewritten += rewrite_sdpa(gm)
        if not use_inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        patches = inductor_patches(cuda_graphs=cuda_graphs, keep_order=False)
        return compile_fx(gm, example_inputs, config_patches=patches)

    backend.rewritten = 0
    return backend

