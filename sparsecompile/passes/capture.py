"""Capture check: every attention site of a compiled graph must be a sparsecompile op.

:func:`capture_backend` is the dynamo backend our compiled decode step uses: it runs the check on
the FX graph dynamo produced (before decomposition, where SDPA is still one node) and then hands
the graph to inductor, with CUDA graphs when asked (what ``mode="reduce-overhead"`` does).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx

from ..kernels import (
    kivi_decode_attention,
    kivi_decode_attention_logits,
    paged_attention,
    paged_attention_logits,
    paged_attention_lse,
    paged_attention_token_max,
)
from ..runtime.compilation import inductor_patches
from .fuse_linear import fuse_sibling_linears


class CaptureError(RuntimeError):
    """An attention site escaped sparsecompile (it would run dense, silently)."""


_ATTENTION_OPS = {op for attention in (paged_attention, paged_attention_lse, paged_attention_token_max,
                                      paged_attention_logits, kivi_decode_attention, kivi_decode_attention_logits)
                  for op in (attention, attention.overloadpacket)}
_SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SDPA_OVERLOADS = ("aten.scaled_dot_product_attention", "aten._scaled_dot_product")


def _is_sdpa(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return node.target in _SDPA_TARGETS or str(node.target).startswith(_SDPA_OVERLOADS)


def count_attention_sites(gm: fx.GraphModule) -> Counter:
    """Count sparsecompile attention ops and raw SDPA calls in a graph."""
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _ATTENTION_OPS:
            counts["sparsecompile"] += 1
        elif _is_sdpa(node):
            counts["sdpa"] += 1
    return counts


def check_capture(gm: fx.GraphModule, expected_sites: int) -> Counter:
    counts = count_attention_sites(gm)
    if counts["sdpa"] or counts["sparsecompile"] != expected_sites:
        raise CaptureError(f"expected {expected_sites} sparsecompile attention ops and no raw SDPA in the compiled "
                           f"graph; found {counts['sparsecompile']} sparsecompile ops and {counts['sdpa']} SDPA calls")
    return counts


def capture_backend(expected_sites: int, cuda_graphs: bool, inner: str = "inductor",
                    keep_order: bool = False, fuse_linears: bool = True) -> Callable:
    """A dynamo backend: :func:`check_capture`, then inductor (``inner="inductor"``) or eager (``"eager"``).

    ``keep_order``: turn off inductor's locality reordering, for methods whose graph reads pool state in one
    layer that a later layer's op mutates (see ``runtime.compilation.inductor_patches``). ``fuse_linears``: one
    GEMM per group of sibling projections whose weights share a buffer (:mod:`.fuse_linear`).
    """

    def backend(gm: fx.GraphModule, example_inputs):
        check_capture(gm, expected_sites)
        backend.graphs_checked += 1
        if fuse_linears:
            backend.fused_groups += fuse_sibling_linears(gm, example_inputs)
        if inner == "eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=inductor_patches(cuda_graphs=cuda_graphs,
                                                                              keep_order=keep_order))

    backend.graphs_checked = 0
    backend.fused_groups = 0
    return backend
