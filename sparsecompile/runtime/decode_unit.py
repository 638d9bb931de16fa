"""The decode unit of the SparseController (a mixin): one decode token per row as one unit — the forward and the
method's ``finish_step`` — run eagerly, compiled once per batch size (``enable_compiled_decode``), or an installed
program (``install_decode_step``: an exported artifact's, or precompiled ones). Compiled units see fixed addresses:
one persistent :class:`StepState` per batch size, batches padded with an empty row to the CUDA-graph sizes, and
the model's parameters watched (a compiled unit does not guard them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from .compilation import allow_recompiles, compile_notice, compile_step, static_address
from .step import StepState

if TYPE_CHECKING:
    from .cache_manager import CacheManager, KVLayout
    from .contract import SparseMethod
    from .prompt_forward import InnerForward


class DecodeUnit:
    """Decode steps of a SparseController (see module docstring)."""

    # provided by SparseController
    runtime: SparseMethod
    layout: KVLayout
    manager: CacheManager | None
    variant_override: str | None
    decode_backend: Callable | None
    _decode_steps: dict[int, StepState]
    _compiled_decode: Callable | None
    _compiled_shapes: set[tuple]
    _step_compiles: bool
    _pad_row: int | None
    _pad_manager: CacheManager | None
    _watched: list[tuple[torch.Tensor, tuple]]
    _run: Callable[..., torch.Tensor]
    _begin: Callable[[StepState], None]
    _end: Callable[[StepState], None]

    @torch.no_grad()
    def decode(self, inner: InnerForward, rows: list[int], input_ids: torch.Tensor, positions: torch.Tensor,
               pad_to: int | None = None) -> torch.Tensor:
        """One decode token per row: ``input_ids, positions [batch, 1]`` -> logits ``[batch, 1, vocab]``.

        ``pad_to``: run the step at this batch size, the extra entries reading an empty padding row and writing
        nothing, so a compiled step (one CUDA graph per batch size) serves every batch up to that size.
        """
        batch = len(rows)
        if pad_to is not None and pad_to > batch:
            extra = pad_to - batch
            rows = rows + [self._padding_row()] * extra
            input_ids = torch.cat([input_ids, input_ids.new_zeros(extra, 1)])
            positions = torch.cat([positions, positions.new_full((extra, 1), -1)])
        if self._watched and self._compiled_decode is not None:
            self._check_parameters()
        step = self._decode_step(rows, batch)
        step.positions.copy_(positions)
        self._begin(step)
        if self._compiled_decode is None:
            logits = self._decode_eager(inner, step, input_ids, step.positions)
        elif self._step_compiles and (key := (len(rows), self.manager.max_seqs, step.variant)) \
                not in self._compiled_shapes:
            compiles = getattr(self._compiled_decode, "compiles", None)  # a step that may load a program instead
            what = f"the decode step for batch {len(rows)}" + (f" ({step.variant} variant)" if step.variant else "")
            with compile_notice(what, compiles is None or compiles(step)):
                logits = self._compiled_decode(inner, step, input_ids, step.positions)
            self._compiled_shapes.add(key)
        else:
            logits = self._compiled_decode(inner, step, input_ids, step.positions)
        self._end(step)
        return logits[:batch]

    @property
    def compiles_decode(self) -> bool:
        """Decode steps run as one unit (compiled, or an installed program) at padded batch sizes."""
        return self._compiled_decode is not None

    @property
    def decode_step_compiles(self) -> bool:
        """The decode unit is compiled here, once per batch size (an installed program is not)."""
        return self._step_compiles

    def _padding_row(self) -> int:
        """A live row that never holds a slot: the batch padding of decode steps reads it (length 0)."""
        m = self.manager
        if self._pad_row is None or self._pad_manager is not m:
            self._pad_row, self._pad_manager = m.add_sequence(), m
        return self._pad_row

    def _decode_eager(self, inner: InnerForward, step: StepState, input_ids: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
        return self._run(inner, step, input_ids=input_ids, inputs_embeds=None, position_ids=positions,
                         logits_to_keep=1)

    def _decode_step(self, rows: list[int], valid: int) -> StepState:
        """One persistent StepState per batch size: static tensors, so a compiled step (and its CUDA graph) sees
        fixed addresses; this step's rows (the first ``valid`` real, the rest padding) are copied into it."""
        batch = len(rows)
        step = self._decode_steps.get(batch)
        if step is None:
            step = StepState.build(rows, torch.ones(batch, 1, dtype=torch.bool),
                                   torch.zeros(batch, 1, dtype=torch.long), is_prefill=False, is_last_chunk=False,
                                   device=self.layout.device)
            for t in (step.rows, step.positions, step.new_offsets, step.num_new):
                static_address(t)
            self._decode_steps[batch] = step
        elif step.row_ids != rows:
            step.row_ids = list(rows)
            step.rows.copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
        if sum(step.num_new_host) != valid:
            real = torch.arange(batch) < valid
            step.num_new_host = real.long().tolist()
            step.num_new.copy_(real.long(), non_blocking=True)
            step.new_offsets.copy_(torch.where(real, 0, -1)[:, None], non_blocking=True)
        return step

    def watch_parameters(self, parameters: list[torch.Tensor]) -> None:
        """Refuse compiled decode steps once any of ``parameters`` (a model's first and last, say) changed dtype,
        device, shape or strides: the compiled step does not guard the model's tensor metadata
        (:func:`~.compilation.decode_guard_filter`), and a model cast or moved after ``optimize`` would otherwise
        run the graph built for the old tensors."""
        self._watched = [(p, _tensor_meta(p)) for p in parameters]

    def _check_parameters(self) -> None:
        for tensor, meta in self._watched:
            if _tensor_meta(tensor) != meta:
                raise RuntimeError(f"the model's parameters changed since optimize() (dtype/device/shape {meta[:3]} "
                                   f"-> {_tensor_meta(tensor)[:3]}): call sparsecompile.restore(model) before casting "
                                   "or moving it, then optimize() again")

    def install_decode_step(self, step_fn: Callable, *, variants: bool = True) -> None:
        """Run decode steps with ``step_fn(inner, step, input_ids, positions) -> logits`` (forward and
        ``finish_step`` in one unit, like the compiled step): an exported artifact's decode program, or precompiled
        programs in front of the compiled step (``serving/decode_programs.py``; ``step_fn.compiles(step)`` then says
        whether a step will compile). Batches are then padded to the serving engine's CUDA-graph sizes, as with a
        compiled step. ``variants`` False: ``step_fn`` runs only the method's default decode variant (the one
        programs are traced in; an artifact's program has nothing to fall back on), so every step runs that one."""
        self._compiled_decode = step_fn
        if not variants:
            self.variant_override = self.runtime.decode_variants[0]

    @contextmanager
    def forced_variant(self, variant: str) -> Iterator[None]:
        """Decode steps inside the block run ``variant`` (one of the method's ``decode_variants``), whatever the
        method would choose: ``warmup()`` compiles each variant's graph this way."""
        if variant not in self.runtime.decode_variants:
            raise ValueError(f"{self.runtime.name} has no decode variant {variant!r}; its variants: "
                             f"{', '.join(map(repr, self.runtime.decode_variants))}")
        before, self.variant_override = self.variant_override, variant
        try:
            yield
        finally:
            self.variant_override = before

    def enable_compiled_decode(self, backend: Callable) -> None:
        """Compile the decode unit (forward + ``finish_step``) with ``backend`` (see ``passes.capture``)."""
        self.decode_backend = backend
        allow_recompiles(8 * len(self.runtime.decode_variants))  # dynamo's default of 8 graphs, per variant
        self._compiled_decode = compile_step(self._decode_eager, backend)
        self._step_compiles = True


def _tensor_meta(tensor: torch.Tensor) -> tuple:
    return tensor.dtype, tensor.device, tuple(tensor.shape), tensor.stride()

