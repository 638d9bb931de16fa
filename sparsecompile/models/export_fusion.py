"""Sibling projections of an exported program as one GEMM each: q/k/v and gate/up read one fused weight.

The compiled decode step fuses them by placing the weights side by side in memory (``colocate.py``) and
rewriting the dynamo graph (``passes/fuse_linear.py``); a decode step at batch 1 is a row of memory-bound GEMVs,
and one over the group's weights reaches more bandwidth than three small ones. An exported program gets the same
by a rewrite of its graph: ``linear(x, Wq); linear(x, Wk); linear(x, Wv)`` becomes ``split(linear(x, W))`` where
``W = cat(Wq, Wk, Wv)`` is a new parameter of the program (``<module>.q_proj+k_proj+v_proj.weight``), and the
separate weights leave it. The artifact then stores the fused weight instead of its parts (no copy is kept).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, TensorArgument

from .colocate import SIBLINGS

_LINEAR = torch.ops.aten.linear.default
_SPLIT = torch.ops.aten.split_with_sizes.default


def fuse_projections(ep: ExportedProgram, shared: dict[str, torch.Tensor] | None = None) -> tuple[ExportedProgram, int]:
    """``ep`` with every complete sibling group fused (see module docstring), and the number of groups fused.

    ``shared`` maps fused weight names to their tensors across programs (pass one dict to every program of an
    artifact: they then hold the same tensor, stored once).
    """
    shared = {} if shared is None else shared
    graph = ep.graph_module.graph
    specs = list(ep.graph_signature.input_specs)
    target_of = {spec.arg.name: spec.target for spec in specs if spec.kind == InputKind.PARAMETER}
    groups: dict[tuple, dict[int, tuple[fx.Node, fx.Node, fx.Node | None]]] = defaultdict(dict)
    for node in graph.nodes:
        if node.op != "call_function" or node.target != _LINEAR:
            continue
        x, w, b = (list(node.args) + [None])[:3]
        target = target_of.get(getattr(w, "name", None))
        bias_target = target_of.get(getattr(b, "name", None)) if b is not None else None
        if target is None or (b is not None and bias_target is None) or not target.endswith(".weight"):
            continue
        module, leaf = target[: -len(".weight")].rsplit(".", 1)
        for names in SIBLINGS:
            if leaf in names:
                groups[(x, module, names)][names.index(leaf)] = (node, w, b)
    state = dict(ep.state_dict)
    fake = next(n.meta["val"] for n in graph.nodes if n.op == "placeholder" and "val" in n.meta).fake_mode
    order = {node: i for i, node in enumerate(graph.nodes)}
    fused = 0
    for (x, module, names), members in groups.items():
        if len(members) != len(names):
            continue
        run = [members[i] for i in range(len(names))]
        weights = [state[target_of[w.name]] for _, w, _ in run]
        biased = {b is not None for _, _, b in run}
        if len(biased) != 1 or len({(t.dtype, t.shape[1]) for t in weights}) != 1:
            continue
        name = f"{module}.{'+'.join(names)}"
        new_w = _parameter(graph, specs, state, shared, fake, f"{name}.weight", weights)
        new_b = None
        if biased == {True}:
            new_b = _parameter(graph, specs, state, shared, fake, f"{name}.bias",
                               [state[target_of[b.name]] for _, _, b in run])
        first = min((node for node, _, _ in run), key=order.__getitem__)
        _rewrite(graph, fake, x, run, new_w, new_b, first, [t.shape[0] for t in weights])
        fused += 1
    if not fused:
        return ep, 0
    for node in [n for n in graph.nodes if n.op == "placeholder" and not n.users and n.name in target_of]:
        state.pop(target_of[node.name], None)
        specs = [s for s in specs if s.arg.name != node.name]
        graph.erase_node(node)
    graph.lint()
    ep.graph_module.recompile()
    signature = ExportGraphSignature(input_specs=specs, output_specs=list(ep.graph_signature.output_specs))
    program = ExportedProgram(root=ep.graph_module, graph=graph, graph_signature=signature, state_dict=state,
                              range_constraints=ep.range_constraints, module_call_graph=ep.module_call_graph,
                              example_inputs=ep.example_inputs, constants=ep.constants, verifiers=ep.verifiers)
    return program, fused


def _parameter(graph: fx.Graph, specs: list[InputSpec], state: dict, shared: dict, fake, target: str,
               parts: list[torch.Tensor]) -> fx.Node:
    """A new parameter placeholder ``target`` holding ``cat(parts)``, placed after the last parameter."""
    tensor = shared.get(target)
    if tensor is None:
        tensor = shared[target] = torch.nn.Parameter(torch.cat([p.detach() for p in parts]), requires_grad=False)
    state[target] = tensor
    index = max(i for i, s in enumerate(specs) if s.kind == InputKind.PARAMETER) + 1
    anchor = next(n for n in graph.nodes if n.op == "placeholder" and n.name == specs[index - 1].arg.name)
    with graph.inserting_after(anchor):
        node = graph.placeholder("p_" + target.replace(".", "_").replace("+", "_"))
    with fake:
        node.meta["val"] = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    specs.insert(index, InputSpec(InputKind.PARAMETER, TensorArgument(node.name), target))
    return node


def _rewrite(graph: fx.Graph, fake, x: fx.Node, run: list, weight: fx.Node, bias: fx.Node | None, first: fx.Node,
             rows: list[int]) -> None:
    """Insert ``split(linear(x, weight, bias))`` before ``first``; each member's uses take its piece."""
    meta = {k: first.meta[k] for k in ("nn_module_stack", "stack_trace") if k in first.meta}

    def call(target, *args):
        node = graph.call_function(target, args)
        values = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        with fake:
            node.meta["val"] = _linear_meta(*values) if target is _LINEAR else target(*values)
        node.meta.update(meta)
        return node

    with graph.inserting_before(first):
        out = call(_LINEAR, x, weight, bias) if bias is not None else call(_LINEAR, x, weight)
        parts = call(_SPLIT, out, rows, -1)
        pieces = [call(operator.getitem, parts, i) for i in range(len(run))]
    for (node, _, _), piece in zip(run, pieces):
        node.replace_all_uses_with(piece)
        graph.erase_node(node)


def _linear_meta(x, weight, bias=None):
    """The fake value of ``linear(x, weight)``: ``[..., out_features]``, contiguous. Built directly rather than by
    running the op: ``aten.linear`` decomposes to ``matmul``, whose C++ kernel asks symbolic batch sizes for a
    concrete ``numel()`` in torch 2.11 (the prefill program's batch and chunk are dynamic)."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))

