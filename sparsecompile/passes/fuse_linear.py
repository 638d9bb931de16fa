"""Fuse sibling linears of a dynamo graph into one GEMM when their weights are adjacent rows of one buffer.

``q = linear(x, Wq); k = linear(x, Wk); v = linear(x, Wv)`` becomes ``linear(x, W)`` split three ways, where
``W`` is an ``as_strided`` view spanning ``Wq``'s storage from its offset: no copy and no new graph input,
only possible because :func:`sparsecompile.models.colocate.colocate_projections` placed the weights
back to back (:func:`rows_follow` is the layout they agree on). The pass reads the real example inputs
(dynamo hands them to the backend) to check the adjacency, and fills each new node's ``example_value`` for the
passes that follow.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

_LINEAR = (torch._C._nn.linear, F.linear)


def rows_follow(prev: torch.Tensor, nxt: torch.Tensor) -> bool:
    """``nxt`` starts in ``prev``'s storage right where ``prev`` ends (the layout this module creates)."""
    return (nxt.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
            and nxt.storage_offset() == prev.storage_offset() + prev.numel())


def _linear_args(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    args = list(node.args) + [None] * (3 - len(node.args))
    x, w, b = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node) or not (b is None or isinstance(b, fx.Node)):
        return None
    return x, w, b


def _runs(members: list[tuple[fx.Node, fx.Node, fx.Node | None]], real: dict[fx.Node, torch.Tensor]) -> list[list]:
    """Maximal runs (length >= 2, in storage order) of linears whose weights, and biases, follow each other in one
    buffer."""
    members = sorted(members, key=lambda m: (real[m[1]].untyped_storage().data_ptr(), real[m[1]].storage_offset()))
    runs, run = [], [members[0]]
    for m in members[1:]:
        p = run[-1]
        wp, wm = real[p[1]], real[m[1]]
        ok = (rows_follow(wp, wm) and wm.shape[1] == wp.shape[1] and wm.dtype == wp.dtype
              and (p[2] is None) == (m[2] is None) and (m[2] is None or rows_follow(real[p[2]], real[m[2]])))
        if ok:
            run.append(m)
        else:
            runs.append(run)
            run = [m]
    runs.append(run)
    return [r for r in runs if len(r) >= 2]


def fuse_sibling_linears(gm: fx.GraphModule, example_inputs: list) -> int:
    """Rewrite ``gm`` in place; returns how many groups were fused."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    real = {n: v for n, v in zip(placeholders, example_inputs) if isinstance(v, torch.Tensor)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[fx.Node, list] = defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _LINEAR:
            continue
        args = _linear_args(node)
        if args is None:
            continue
        x, w, b = args
        wt = real.get(w)
        if wt is None or wt.dim() != 2 or not wt.is_contiguous() or (b is not None and b not in real):
            continue
        groups[x].append((node, w, b))
    fused = 0
    for x, members in groups.items():
        for run in _runs(members, real):
            _fuse(graph, x, run, min((m[0] for m in run), key=order.__getitem__), real)
            fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def _fuse(graph: fx.Graph, x: fx.Node, run: list, first: fx.Node, real: dict[fx.Node, torch.Tensor]) -> None:
    """Replace the linears of ``run`` (storage order) by one linear and a split, inserted before ``first``, the
    run's earliest node in the graph."""
    w0, b0 = run[0][1], run[0][2]
    rows = [real[m[1]].shape[0] for m in run]
    cols = real[w0].shape[1]
    total = sum(rows)

    def node(target, *args):
        new = graph.call_function(target, args)
        values = [a.meta.get("example_value") if isinstance(a, fx.Node) else a for a in args]
        fake = [v for v in values if isinstance(v, FakeTensor)]
        fake += [t for v in values if isinstance(v, (tuple, list)) for t in v if isinstance(t, FakeTensor)]
        # every node argument must have its value (an absent bias is a plain None, not a node): a node left without
        # ``example_value`` makes AOTAutograd's cache bypass the whole graph ("Unsupported call_method target")
        if fake and all(v is not None for a, v in zip(args, values) if isinstance(a, fx.Node)):
            with fake[0].fake_mode:
                new.meta["example_value"] = target(*values)
        return new

    with graph.inserting_before(first):
        weight = node(torch.as_strided, w0, (total, cols), (cols, 1), real[w0].storage_offset())
        bias = None if b0 is None else node(torch.as_strided, b0, (total,), (1,), real[b0].storage_offset())
        out = node(torch._C._nn.linear, x, weight, bias)
        parts = node(torch.split, out, rows, -1)
        pieces = [node(operator.getitem, parts, i) for i in range(len(run))]
    for (linear, _, _), piece in zip(run, pieces):  # after all insertions, which were placed before `first`
        linear.replace_all_uses_with(piece)
        graph.erase_node(linear)
