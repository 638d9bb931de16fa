"""The two programs an artifact exports from a patched HF model, and their ``torch.export`` calls.

* **prefill**: ``(input_ids, position_ids [batch, tokens], keep [k]) -> logits [batch, k, vocab]`` (``keep``: the
  positions whose logits are returned, the last one for sampling, all of them for prompt logprobs), batch, tokens
  and k dynamic. Each attention layer is one opaque ``sparsecompile::attend`` call (``runtime/attend_op.py``)
  answered at run time by the loading process's SparseController, so prefill chunks keep their host-side method
  work (SnapKV windows, eviction plans, H2O chunk eviction) in Python around a program without HF code.
* **decode**: one decode step with the method traced in, ``(input_ids, positions [batch, 1], rows [batch],
  new_offsets [batch, 1], num_new [batch], *state) -> logits [batch, 1, vocab]``: the model forward with each
  layer's ``CacheManager.write`` -> selection -> view -> ``paged_attention`` -> hooks, then the method's
  ``finish_step`` (decode eviction). ``state`` is :func:`runtime.state_binding.decode_state`: the pool, block
  table, slot counts and method buffers as mutated inputs; the batch is dynamic (one program, a CUDA graph per
  batch bucket at load) and so is the pool's page count (sized by the loading process's memory).

The model's weights are the programs' parameters, under the same names in both (``lm.<HF name>``), so an
artifact stores them once. The decode program returns the one position's logits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from ..passes.capture import CaptureError, check_capture, count_attention_sites
from ..runtime.attend_op import attend
from ..runtime.state_binding import StateSlot, bound
from ..runtime.step import StepState
from .compiled_forward import opaque_attention
from .hf_patch import PatchedModel, patched_model

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

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # a 1D tensor of positions: HF's logits_to_keep takes it as well as an int, and it stays dynamic
        return self._patched.inner(input_ids=input_ids, inputs_embeds=None, position_ids=position_ids,
                                   logits_to_keep=keep)


class DecodeProgram(nn.Module):
    def __init__(self, model: nn.Module, patched: PatchedModel, state: list[StateSlot], variant: str) -> None:
        super().__init__()
        self.lm = model
        self._patched = patched
        self._state = state
        self._variant = variant

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, new_offsets: torch.Tensor,
                num_new: torch.Tensor, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        controller = self._patched.controller
        # a decode step ends no prompt (an empty list: any() is False, whatever the batch)
        step = StepState(rows, positions, new_offsets, num_new, is_prefill=False, ends_prompt=[],
                         row_ids=_HostFieldsUnavailable(), num_new_host=_HostFieldsUnavailable(),
                         variant=self._variant)
        with bound(self._state, list(state)):
            return controller._run(self._patched.inner, step, input_ids=input_ids, inputs_embeds=None,
                                   position_ids=positions, logits_to_keep=1)


def export_prefill(model: nn.Module, max_tokens: int, max_batch: int) -> ExportedProgram:
    """The prefill program of a patched ``model`` (see module docstring): up to ``max_batch`` rows of 1..``max_tokens``
    tokens (left-padded rows: the padding's positions are ignored by the controller)."""
    patched = patched_model(model)
    device = patched.controller.layout.device
    batch_size, tokens_size, keep_size = min(2, max_batch), min(7, max_tokens), min(3, max_tokens)  # distinct sizes
    ids = torch.zeros(batch_size, tokens_size, dtype=torch.long, device=device)
    positions = torch.arange(tokens_size, device=device)[None, :].expand(batch_size, -1).contiguous()
    keep = torch.arange(tokens_size - keep_size, tokens_size, device=device)
    tokens = Dim("tokens", min=1, max=max(2, max_tokens))
    batch = Dim("batch", min=1, max=max_batch) if max_batch > 1 else None
    kept = Dim("keep", min=1, max=max(2, max_tokens))
    shapes = ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: kept})
    with opaque_attention(model), torch.no_grad():
        ep = torch.export.export(PrefillProgram(model, patched), (ids, positions, keep), dynamic_shapes=shapes,
                                 strict=False)
    _check_no_state_constants(ep, "prefill")
    attends = sum(node.target == attend for node in ep.graph.nodes)
    layers = patched.controller.layout.num_layers
    if attends != layers or count_attention_sites(ep.graph_module)["sdpa"]:
        raise CaptureError(f"the prefill program holds {attends} sparsecompile::attend calls for {layers} layers "
                           f"and {count_attention_sites(ep.graph_module)['sdpa']} raw SDPA calls")
    return ep


def export_decode(model: nn.Module, state: list[StateSlot], example_batch: int, max_batch: int,
                  variant: str | None = None) -> tuple[ExportedProgram, list[StateSlot]]:
    """The decode-step program of a patched ``model`` over ``state`` (see module docstring), and the state slots it
    takes: those the step reads or writes (a method that only appends in decode leaves its eviction limits out,
    so its program is the same as ``vanilla``'s). ``variant``: the method's decode variant the program runs (None:
    its default, the first of ``decode_variants``).

    The controller must hold a pool, and its decode step for ``example_batch`` rows must exist (run one padded
    decode step first: it creates the method's lazy buffers and the persistent StepState used as example).
    """
    patched = patched_model(model)
    step = patched.controller._decode_steps.get(example_batch)
    if step is None:
        raise RuntimeError(f"run one decode step at batch {example_batch} before exporting the decode program")
    variants = patched.controller.runtime.decode_variants
    if variant is None:
        variant = variants[0]
    elif variant not in variants:
        raise ValueError(f"no decode variant {variant!r}; this method's variants: {', '.join(map(repr, variants))}")
    ep = _export_decode(patched, model, step, state, max_batch, variant)
    users = {node.name: len(node.users) for node in ep.graph.nodes if node.op == "placeholder"}
    state_inputs = ep.graph_signature.user_inputs[len(DECODE_STEP_INPUTS):]
    used = [slot for slot, name in zip(state, state_inputs) if users.get(name, 0)]
    if len(used) < len(state):
        ep = _export_decode(patched, model, step, used, max_batch, variant)
    _check_no_state_constants(ep, "decode")
    check_capture(ep.graph_module, patched.controller.layout.num_layers)  # one attention op per layer, no SDPA
    return ep, used


def _export_decode(patched: PatchedModel, model: nn.Module, step: StepState, state: list[StateSlot],
                   max_batch: int, variant: str) -> ExportedProgram:
    batch_size = step.rows.shape[0]
    ids = torch.zeros(batch_size, 1, dtype=torch.long, device=step.rows.device)
    args = (ids, step.positions, step.rows, step.new_offsets, step.num_new, tuple(slot.get() for slot in state))
    batch = Dim("batch", min=1, max=max_batch) if max_batch > 1 else None
    pages = Dim("pool_pages", min=2)
    shapes = tuple({0: batch} if batch is not None else None for _ in DECODE_STEP_INPUTS)
    shapes += (tuple({0: pages} if slot.per_page else None for slot in state),)
    with torch.no_grad():
        return torch.export.export(DecodeProgram(model, patched, state, variant), args, dynamic_shapes=shapes,
                                   strict=False)


def _check_no_state_constants(ep: ExportedProgram, name: str) -> None:
    """Refuse a program that froze a tensor it did not receive as an input or own as a weight: that is KV-core
    state the binding missed (its export-time value would be baked in)."""
    frozen = [spec.target for spec in ep.graph_signature.input_specs
              if spec.kind == torch.export.graph_signature.InputKind.CONSTANT_TENSOR
              and ep.constants[spec.target].numel() > 1 and not str(spec.target).startswith(WEIGHT_PREFIX)]
    if frozen:
        raise ExportError(f"the {name} program captured tensors that are not inputs or weights: {frozen}; they look "
                          "like KV-core state that runtime.state_binding.decode_state does not list")
