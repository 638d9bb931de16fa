"""The two programs an artifact exports from a patched HF model, and their ``torch.export`` calls.

* **prefill**: ``(input_ids, position_ids [1, tokens]) -> logits [1, 1, vocab]``, tokens dynamic. Each attention
  layer is one opaque ``sparsecompile::attend`` call (``runtime/attend_op.py``) answered at run time by the
  loading process's SparseController, so prefill chunks keep their host-side method work (SnapKV windows,
  eviction plans, H2O chunk eviction) in Python around a program without HF code.
* **decode**: one decode step with the method traced in, ``(input_ids, positions [batch, 1], rows [batch],
  new_offsets [batch, 1], num_new [batch], *state) -> logits [batch, 1, vocab]``: the model forward with each
  layer's ``CacheManager.write`` -> selection -> view -> ``paged_attention`` -> hooks, then the method's
  ``finish_step`` (decode eviction). ``state`` is :func:`runtime.state_binding.decode_state`: the pool, block
  table, slot counts and method buffers as mutated inputs; the batch is dynamic (one program, a CUDA graph per
  batch bucket at load) and so is the pool's page count (sized by the loading process's memory).

The model's weights are the programs' parameters, under the same names in both (``lm.<HF name>``), so an
artifact stores them once. Both programs run with ``logits_to_keep=1``: the engine samples one token per row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from ..runtime.attend_op import OpaqueAttention
from ..runtime.state_binding import StateSlot, bound
from ..runtime.step import StepState
from .attention import CONTROLLER_ATTR
from .hf_patch import PatchedModel, patched_model
from .support import attention_modules

#: the attribute of the program modules that holds the HF model: weight names start with ``lm.``
WEIGHT_PREFIX = "lm."
DECODE_STEP_INPUTS = ("input_ids", "positions", "rows", "new_offsets", "num_new")


class ExportError(RuntimeError):
    """A program could not be exported faithfully (the message says what was found)."""


class _HostFieldsUnavailable(list):
    """``StepState.row_ids`` / ``num_new_host`` inside a traced decode step: reading them would freeze one batch's
    rows into the program, so any use fails the export."""

    def _refuse(self, *args, **kwargs):
        raise ExportError("a decode-step hook read the step's host fields (row_ids / num_new_host); device hooks must "
                          "use the step's tensors (rows, num_new)")

    __iter__ = __getitem__ = __len__ = __contains__ = _refuse


class PrefillProgram(nn.Module):
    def __init__(self, model: nn.Module, patched: PatchedModel) -> None:
        super().__init__()
        self.lm = model
        self._patched = patched

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self._patched.inner(input_ids=input_ids, inputs_embeds=None, position_ids=position_ids,
                                   logits_to_keep=1)


class DecodeProgram(nn.Module):
    def __init__(self, model: nn.Module, patched: PatchedModel, state: list[StateSlot]) -> None:
        super().__init__()
        self.lm = model
        self._patched = patched
        self._state = state

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, new_offsets: torch.Tensor,
                num_new: torch.Tensor, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        controller = self._patched.controller
        step = StepState(rows, positions, new_offsets, num_new, is_prefill=False, is_last_chunk=False,
                         row_ids=_HostFieldsUnavailable(), num_new_host=_HostFieldsUnavailable())
        with bound(controller, self._state, list(state)):
            return controller._run(self._patched.inner, step, input_ids=input_ids, inputs_embeds=None,
                                   position_ids=positions, logits_to_keep=1)


@contextmanager
def _opaque_attention(model: nn.Module) -> Iterator[None]:
    modules = [m for _, m in attention_modules(model)]
    saved = [m.__dict__[CONTROLLER_ATTR] for m in modules]
    for module in modules:
        module.__dict__[CONTROLLER_ATTR] = OpaqueAttention()
    try:
        yield
    finally:
        for module, controller in zip(modules, saved):
            module.__dict__[CONTROLLER_ATTR] = controller


def export_prefill(model: nn.Module, max_tokens: int) -> ExportedProgram:
    """The prefill program of a patched ``model`` (see module docstring), for chunks of 1..``max_tokens`` tokens."""
    patched = patched_model(model)
    device = patched.controller.layout.device
    example = min(max(3, max_tokens // 2), max_tokens)
    ids = torch.zeros(1, example, dtype=torch.long, device=device)
    positions = torch.arange(example, device=device)[None, :]
    tokens = Dim("tokens", min=1, max=max(2, max_tokens))
    with _opaque_attention(model), torch.no_grad():
        ep = torch.export.export(PrefillProgram(model, patched), (ids, positions),
                                 dynamic_shapes=({1: tokens}, {1: tokens}), strict=False)
    _check_no_state_constants(ep, "prefill")
    return ep


def export_decode(model: nn.Module, state: list[StateSlot], example_batch: int,
                  max_batch: int) -> tuple[ExportedProgram, list[StateSlot]]:
    """The decode-step program of a patched ``model`` over ``state`` (see module docstring), and the state slots it
    takes: those the step reads or writes (a method that only appends in decode leaves its eviction limits out,
    so its program is the same as ``vanilla``'s).

    The controller must hold a pool, and its decode step for ``example_batch`` rows must exist (run one padded
    decode step first: it creates the method's lazy buffers and the persistent StepState used as example).
    """
    patched = patched_model(model)
    step = patched.controller._decode_steps.get(example_batch)
    if step is None:
        raise RuntimeError(f"run one decode step at batch {example_batch} before exporting the decode program")
    ep = _export_decode(patched, model, step, state, max_batch)
    users = {node.name: len(node.users) for node in ep.graph.nodes if node.op == "placeholder"}
    state_inputs = ep.graph_signature.user_inputs[len(DECODE_STEP_INPUTS):]
    used = [slot for slot, name in zip(state, state_inputs) if users.get(name, 0)]
    if len(used) < len(state):
        ep = _export_decode(patched, model, step, used, max_batch)
    _check_no_state_constants(ep, "decode")
    return ep, used


def _export_decode(patched: PatchedModel, model: nn.Module, step: StepState, state: list[StateSlot],
                   max_batch: int) -> ExportedProgram:
    batch_size = step.rows.shape[0]
    ids = torch.zeros(batch_size, 1, dtype=torch.long, device=step.rows.device)
    args = (ids, step.positions, step.rows, step.new_offsets, step.num_new, tuple(slot.get() for slot in state))
    batch = Dim("batch", min=1, max=max_batch) if max_batch > 1 else None
    pages = Dim("pool_pages", min=2)
    shapes = tuple({0: batch} if batch is not None else None for _ in DECODE_STEP_INPUTS)
    shapes += (tuple({0: pages} if slot.per_page else None for slot in state),)
    with torch.no_grad():
        return torch.export.export(DecodeProgram(model, patched, state), args, dynamic_shapes=shapes, strict=False)


def _check_no_state_constants(ep: ExportedProgram, name: str) -> None:
    """Refuse a program that froze a tensor it did not receive as an input or own as a weight: that is KV-core
    state the binding missed (its export-time value would be baked in)."""
    frozen = [spec.target for spec in ep.graph_signature.input_specs
              if spec.kind == torch.export.graph_signature.InputKind.CONSTANT_TENSOR
              and ep.constants[spec.target].numel() > 1 and not str(spec.target).startswith(WEIGHT_PREFIX)]
    if frozen:
        raise ExportError(f"the {name} program captured tensors that are not inputs or weights: {frozen}; they look "
                          "like KV-core state that runtime.state_binding.decode_state does not list")


def program_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under its program name (``lm.<HF name>``), aliases included."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return {WEIGHT_PREFIX + name: tensor.detach() for name, tensor in named.items()}
