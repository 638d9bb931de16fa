"""MixedStep: a decode step and a prefill step in one model forward (the serving engine's mixed batch).

A serving step that decodes running requests and prefills new prompts used to run two forwards: the decode batch,
then the prompt chunks. One forward over both reads the weights once and lets the decode tokens ride along with the
chunk's matmuls, so a burst of new prompts stretches running streams' inter-token gap by the chunk's cost only.

Layout of the forward's tokens ``[1, T]``, ``T = decode_batch + prefill_batch * width``: the decode tokens first
(one per decode row), then the prefill rows' chunks, each left-padded to ``width`` and laid end to end. Linear
layers, norms and RoPE work token by token, so they never see the split; only attention does, and
:meth:`SparseController.attend` runs each part through its own :class:`StepState` (decode selection and the
decode kernel for the first part, the prefill path for the second), then concatenates the outputs.

Methods keep one step's plan in attributes between ``prepare_step`` and ``commit_step`` (``step_scoped``, on the
runtime and on the storage format): :class:`MixedStep` keeps them per part and the controller swaps them in around
each part's hooks, so two steps in flight never see each other's plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .step import StepState, valid_tokens


@dataclass
class MixedStep:
    """The parts of one mixed forward: ``decode`` (``[decode_batch, 1]``) then ``prefill`` (``[batch, width]``).

    ``owners``: the objects whose ``step_scoped`` attributes hold a step's plan (the method runtime, the storage
    format); :meth:`save` / :meth:`load` keep one copy of them per part.
    """

    decode: StepState
    prefill: StepState
    owners: list[Any]
    _scopes: dict[int, list[Any]] = field(default_factory=dict)  # id(part) -> values, in owners' attribute order

    def __post_init__(self) -> None:
        self.owners = [o for o in self.owners if o is not None and getattr(o, "step_scoped", ())]

    @property
    def parts(self) -> tuple[StepState, StepState]:
        return self.decode, self.prefill

    @property
    def num_decode(self) -> int:
        return len(self.decode.row_ids)

    def save(self, part: StepState) -> None:
        self._scopes[id(part)] = [getattr(o, name) for o in self.owners for name in o.step_scoped]

    def load(self, part: StepState) -> None:
        values = iter(self._scopes[id(part)])
        for owner in self.owners:
            for name in owner.step_scoped:
                setattr(owner, name, next(values))

    def split(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, heads, T, D]`` (the layout attention receives) -> the decode part ``[decode_batch, heads, 1, D]``
        and the prefill part ``[batch, heads, width, D]``, both contiguous."""
        n, (batch, width) = self.num_decode, self.prefill.positions.shape
        head = tensor[0, :, :n].transpose(0, 1).unsqueeze(2)
        tail = tensor[0, :, n:].unflatten(1, (batch, width)).transpose(0, 1)
        return head.contiguous(), tail.contiguous()

    @staticmethod
    def join(decode_out: torch.Tensor, prefill_out: torch.Tensor) -> torch.Tensor:
        """Attention outputs ``[decode_batch, 1, heads, D]``, ``[batch, width, heads, D]`` -> ``[1, T, heads, D]``."""
        return torch.cat([decode_out.flatten(0, 1), prefill_out.flatten(0, 1)])[None]


class MixedForward:
    """The controller's mixed step: a mixin of ``SparseController``, whose step hooks it drives (``_begin``,
    ``_end``, ``_after_prompts``) over its ``layout``, ``runtime`` and ``manager``."""

    @torch.no_grad()
    def mixed(self, inner: Callable[..., torch.Tensor], decode_rows: list[int], decode_ids: torch.Tensor,
              decode_positions: torch.Tensor, rows: list[int], input_ids: torch.Tensor, positions: torch.Tensor,
              valid: torch.Tensor, logits_to_keep: int, final: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step and a prompt-chunk step in one forward (``mixed.py``): the serving engine's mixed batch.

        Decode: one token per row of ``decode_rows`` (``decode_ids, decode_positions [decode_batch, 1]``). Prefill:
        chunks of ``rows`` as in :meth:`prefill` (``input_ids, positions, valid [batch, width]``, left-padded, one
        forward; ``final`` per row). Returns decode logits ``[decode_batch, 1, vocab]`` and prefill logits
        ``[batch, 1, vocab]`` (last position; every position with ``logits_to_keep=0``). The decode part runs eagerly,
        with the same ops and hooks as a decode step.
        """
        n, (batch, width) = len(decode_rows), positions.shape
        device = self.layout.device
        mixed = MixedStep(
            StepState.build(decode_rows, torch.ones(n, 1, dtype=torch.bool), decode_positions, is_prefill=False,
                            is_last_chunk=False, device=device),
            StepState.build(rows, valid, positions, is_prefill=True, is_last_chunk=list(final), device=device),
            [self.runtime, self.manager.storage])
        if self.runtime.needs_prompt_tokens:
            mixed.prefill.prompt_tokens = valid_tokens(input_ids, valid, positions)
        for part in mixed.parts:
            self._begin(part)
            mixed.save(part)
        ids = torch.cat([decode_ids.reshape(-1).to(device), input_ids.reshape(-1).to(device)])[None]
        position_ids = torch.cat([decode_positions.reshape(-1).to(device), positions.reshape(-1).to(device)])[None]
        keep: int | torch.Tensor = 0
        if logits_to_keep:
            last = n + torch.arange(batch) * width + width - 1  # each chunk's last position
            keep = torch.cat([torch.arange(n), last]).to(device)
        self.step = mixed
        try:
            logits = inner(input_ids=ids, inputs_embeds=None, position_ids=position_ids, logits_to_keep=keep)
            for part in mixed.parts:
                mixed.load(part)
                self.runtime.finish_step(self.manager, part)
                mixed.save(part)
        finally:
            self.step = None
        for part in mixed.parts:
            mixed.load(part)
            self._end(part)
        if mixed.prefill.is_last_chunk:
            self._after_prompts(inner, [r for r, done in zip(rows, mixed.prefill.ends_prompt) if done])
        if isinstance(keep, torch.Tensor) and logits.shape[1] != keep.numel():  # a model without logits_to_keep
            logits = logits[:, keep]
        logits = logits[0]
        prefill = logits[n:, None] if logits_to_keep else logits[n:].unflatten(0, (batch, width))
        return logits[:n, None], prefill
