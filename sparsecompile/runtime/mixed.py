"""MixedStep: several steps in one model forward (the serving engine's one forward per step).

A serving step that decodes running requests and prefills new prompts used to run a forward for the decode batch,
then one per group of prompt chunks. One forward over all of them reads the weights once and lets the decode tokens
ride along with the chunks' matmuls.

Layout of the forward's tokens ``[1, T]``: the parts end to end, each part a :class:`StepState` of ``[batch_i,
width_i]`` tokens laid out row by row: the decode part first (``[decode_batch, 1]``, one token per row) when there
is one, then each group of prompt chunks (left-padded to its own width, so groups of different lengths pad only
within themselves). Linear layers, norms and RoPE work token by token, so they never see the split; only attention
does, and :meth:`SparseController.attend` runs each part through its own step (decode selection and the decode
kernel for the decode part, the prefill path for a chunk group), then concatenates the outputs.

Methods keep one step's plan in attributes between ``prepare_step`` and ``commit_step`` (``step_scoped``, on the
runtime and on the storage format): :class:`MixedStep` keeps them per part and the controller swaps them in around
each part's hooks, so steps sharing a forward never see each other's plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .step import StepState, valid_tokens

#: One group of prompt chunks: rows, ``input_ids, positions, valid [batch, width]`` (left-padded), logits_to_keep
#: (1: each row's last position, 0: every position) and, per row, whether the chunk ends its prompt.
ChunkGroup = tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, int, list[bool]]


@dataclass
class MixedStep:
    """The parts of one forward, in token order (see module docstring).

    ``owners``: the objects whose ``step_scoped`` attributes hold a step's plan (the method runtime, the storage
    format); :meth:`save` / :meth:`load` keep one copy of them per part.
    """

    parts: list[StepState]
    owners: list[Any]
    _scopes: dict[int, list[Any]] = field(default_factory=dict)  # id(part) -> values, in owners' attribute order

    def __post_init__(self) -> None:
        self.owners = [o for o in self.owners if o is not None and getattr(o, "step_scoped", ())]

    def save(self, part: StepState) -> None:
        self._scopes[id(part)] = [getattr(o, name) for o in self.owners for name in o.step_scoped]

    def load(self, part: StepState) -> None:
        values = iter(self._scopes[id(part)])
        for owner in self.owners:
            for name in owner.step_scoped:
                setattr(owner, name, next(values))

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``[1, heads, T, D]`` (the layout attention receives) -> per part ``[batch_i, heads, width_i, D]``: views,
        one op each (an eager forward pays host time per op, per layer, per part; the kernels and the K/V write take
        any strides with a dense last dim)."""
        _, heads, _, dim = tensor.shape
        _, s_head, s_token, s_dim = tensor.stride()
        offset, pieces = tensor.storage_offset(), []
        for batch, width in (tuple(part.positions.shape) for part in self.parts):
            pieces.append(tensor.as_strided((batch, heads, width, dim), (width * s_token, s_head, s_token, s_dim),
                                            offset))
            offset += batch * width * s_token
        return pieces

    def finish(self, runtime: Any, manager: Any) -> None:
        """Each part's device-side finish (``runtime.finish_step``), with its own plan swapped in."""
        for part in self.parts:
            self.load(part)
            runtime.finish_step(manager, part)
            self.save(part)

    @staticmethod
    def join(outs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Attention outputs ``[batch_i, width_i, heads, D]`` per part -> ``[1, T, heads, D]``."""
        return torch.cat([o.flatten(0, 1) for o in outs])[None]


class MixedForward:
    """The controller's many-step forward: a mixin of ``SparseController``, whose step hooks it drives
    (``_begin``, ``_end``, ``_after_prompts``) over its ``layout``, ``runtime`` and ``manager``; ``mixed_replays``:
    its recorded mixed steps (a ``mixed_graphs.MixedReplays``), or None."""

    mixed_replays = None

    @torch.no_grad()
    def mixed(self, inner: Callable[..., torch.Tensor], decode_rows: list[int], decode_ids: torch.Tensor | None,
              decode_positions: torch.Tensor | None,
              groups: list[ChunkGroup]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """A decode step (none when ``decode_rows`` is empty) and one prefill step per chunk group, in one forward.

        Decode: one token per row of ``decode_rows`` (``decode_ids, decode_positions [decode_batch, 1]``, host
        tensors). Groups: as the engine feeds :meth:`prefill` (one forward each, no further chunking). Returns the
        decode logits ``[decode_batch, 1, vocab]`` (None without decode rows) and, per group, ``[batch, 1, vocab]``
        (last positions) or ``[batch, width, vocab]`` (``logits_to_keep`` 0). The decode part runs eagerly with the
        ops and hooks of a decode step. With :meth:`~.controller.SparseController.replay_mixed_steps` on, a step that
        fits a recorded shape replays instead (``runtime/mixed_graphs.py``).
        """
        if self.mixed_replays is not None:
            replayed = self.mixed_replays.run(inner, decode_rows, decode_ids, decode_positions, groups)
            if replayed is not None:
                return replayed
        device = self.layout.device
        n = len(decode_rows)
        parts: list[StepState] = []
        if n:
            parts.append(StepState.build(decode_rows, torch.ones(n, 1, dtype=torch.bool), decode_positions,
                                         is_prefill=False, is_last_chunk=False, device=device))
        for rows, input_ids, positions, valid, _, final in groups:
            step = StepState.build(rows, valid, positions, is_prefill=True, is_last_chunk=list(final), device=device)
            if self.runtime.needs_prompt_tokens:
                step.prompt_tokens = valid_tokens(input_ids, valid, positions)
            parts.append(step)
        mixed = MixedStep(parts, [self.runtime, self.manager.storage])
        for part in parts:
            self._begin(part)
            mixed.save(part)
        for part in parts:  # after every part's flush: a later part's may grow the pool
            part.slot_plan = self.manager.slot_plan(part)
        ids = [g[1].reshape(-1) for g in groups]
        pos = [g[2].reshape(-1) for g in groups]
        if n:
            ids, pos = [decode_ids.reshape(-1), *ids], [decode_positions.reshape(-1), *pos]
        keep, spans = _kept_positions(n, groups)
        self.step = mixed
        try:
            logits = inner(input_ids=torch.cat(ids)[None].to(device), inputs_embeds=None,
                           position_ids=torch.cat(pos)[None].to(device),
                           logits_to_keep=0 if keep is None else keep.to(device))
            mixed.finish(self.runtime, self.manager)
        finally:
            self.step = None
        self._end_parts(inner, mixed)
        if keep is not None and logits.shape[1] != keep.numel():  # a model without logits_to_keep: every position
            logits = logits[:, keep.to(logits.device)]
        logits = logits[0]
        out = [logits[a:b].unflatten(0, shape) for (a, b), shape in spans]
        return (out.pop(0) if n else None), out

    def _end_parts(self, inner: Callable[..., torch.Tensor], mixed: MixedStep) -> None:
        """After a mixed forward: each part's host end (``commit_step``), then the method's scoring passes for the
        prompts that ended."""
        ended: list[int] = []
        for part in mixed.parts:
            mixed.load(part)
            self._end(part)
            if part.is_prefill:
                ended += [r for r, done in zip(part.row_ids, part.ends_prompt) if done]
        if ended:
            self._after_prompts(inner, ended)


def _kept_positions(n: int, groups: list[ChunkGroup]) -> tuple[torch.Tensor | None, list]:
    """The forward's positions whose logits are kept (None: all of them) and, per part, the kept rows' span in the
    kept logits with its shape: ``[n, 1]`` for the decode part, ``[batch, 1]`` or ``[batch, width]`` per group."""
    indices, spans, start, kept = [], [], 0, 0
    if n:
        indices.append(torch.arange(n))
        spans.append(((0, n), (n, 1)))
        start = kept = n
    for _, _, positions, _, logits_to_keep, _ in groups:
        batch, width = positions.shape
        rows = start + torch.arange(batch) * width
        take = (rows + width - 1) if logits_to_keep else (rows[:, None] + torch.arange(width)).reshape(-1)
        indices.append(take)
        spans.append(((kept, kept + take.numel()), (batch, 1 if logits_to_keep else width)))
        start, kept = start + batch * width, kept + take.numel()
    if kept == start:  # every position is kept
        return None, spans
    return torch.cat(indices), spans
