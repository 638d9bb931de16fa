"""StepState: per-forward metadata shared by the CacheManager, the method runtime and the attention ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepState:
    """What one model forward (a prefill chunk or a decode step) processes.

    Device tensors (read inside compiled graphs; the decode step reuses one instance per batch size):
        rows: ``[batch]`` int64 CacheManager rows of the sequences in this forward.
        positions: ``[batch, tokens]`` int64 logical positions of the new tokens (-1 for padding).
        new_offsets: ``[batch, tokens]`` int64 index of each new token among its row's new tokens
            (-1 for padding); the token lands at row-local slot ``lengths - num_new + offset``.
        num_new: ``[batch]`` int64 non-padding tokens per row.

    Host fields (static for a compiled graph):
        is_prefill: prompt tokens (True) or one decode token per row (False).
        ends_prompt: per row, this forward ends the row's prompt (SnapKV compacts after it); the serving engine
            batches the chunks of several prompts in one forward, so rows differ.
        is_last_chunk: some row's prompt ends here.
        row_ids / num_new_host: host copies of ``rows`` and ``num_new``.
        prompt_tokens: per row, ``(first position, token ids)`` of its valid new tokens, set by the controller for
            methods that read the prompt's ids (``SparseMethod.needs_prompt_tokens``); None otherwise.
        scorer: a scoring pass (``SparseController.score_pass``): its tokens' KV is temporary, every layer attends
            over all resident slots and ``scorer.on_attention_end`` runs instead of the method's layer hooks.
        variant: a decode step's variant (``SparseMethod.decode_variants``), set by the controller before the
            method's ``prepare_step``: a compiled step keeps one graph per (batch size, variant).
    """

    rows: torch.Tensor
    positions: torch.Tensor
    new_offsets: torch.Tensor
    num_new: torch.Tensor
    is_prefill: bool
    ends_prompt: list[bool]
    row_ids: list[int]
    num_new_host: list[int]
    prompt_tokens: list[tuple[int, list[int]]] | None = None
    scorer: Any = None
    variant: str = ""
    #: prefill: per layer, the slot count every row reads when the host vouches the view is dense (all rows equal, no
    #: padding, no empty slot), else -1; attention kernels take a sync-free fast path on it (set by the controller)
    dense_lengths: list[int] | None = None
    #: eager forwards: every layer's slot mapping, computed once after the step's tables are flushed
    #: (``SlotAccess.slot_plan``); None in compiled decode steps, which map slots per layer inside their graph
    slot_plan: Any = None  # a slot_access.SlotPlan (not imported: slot_access imports this module)

    @property
    def is_last_chunk(self) -> bool:
        return any(self.ends_prompt)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[1]

    @staticmethod
    def build(rows: list[int], valid: torch.Tensor, positions: torch.Tensor, *, is_prefill: bool,
              is_last_chunk: bool | list[bool], device: torch.device) -> StepState:
        """Build from host data: ``valid [batch, tokens]`` bool and ``positions [batch, tokens]`` (any device)."""
        positions, offsets, num_new = _token_fields(valid, positions)
        return StepState(
            rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
            positions=positions.to(device, non_blocking=True),
            new_offsets=offsets.to(device, non_blocking=True),
            num_new=num_new.to(device, non_blocking=True),
            is_prefill=is_prefill,
            ends_prompt=list(is_last_chunk) if isinstance(is_last_chunk, list) else [bool(is_last_chunk)] * len(rows),
            row_ids=list(rows),
            num_new_host=num_new.tolist(),
        )

    def refill(self, rows: list[int], valid: torch.Tensor, positions: torch.Tensor, ends_prompt: list[bool]) -> None:
        """Take another step's rows and tokens (host data, the same ``[batch, tokens]`` shape) in place: the device
        tensors keep their addresses (a persistent step that a CUDA graph reads), the host fields are replaced and
        the per-step fields (variant, dense lengths, slot plan) cleared."""
        positions, offsets, num_new = _token_fields(valid, positions)
        if positions.shape != tuple(self.positions.shape) or len(rows) != self.rows.shape[0]:
            raise ValueError(f"refill: a [{len(rows)}, {positions.shape[1]}] step into a persistent "
                             f"{list(self.positions.shape)} one")
        for target, source in ((self.rows, torch.tensor(rows, dtype=torch.int64)), (self.positions, positions),
                               (self.new_offsets, offsets), (self.num_new, num_new)):
            target.copy_(source, non_blocking=True)
        self.row_ids, self.num_new_host, self.ends_prompt = list(rows), num_new.tolist(), list(ends_prompt)
        self.variant, self.dense_lengths, self.slot_plan = "", None, None


def _token_fields(valid: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host ``valid, positions [batch, tokens]`` -> positions (-1 where not valid), new-token offsets (-1 likewise)
    and ``num_new [batch]``."""
    valid = valid.to("cpu", torch.bool)
    positions = positions.to("cpu", torch.int64)
    offsets = torch.where(valid, valid.long().cumsum(1) - 1, torch.full_like(positions, -1))
    return torch.where(valid, positions, torch.full_like(positions, -1)), offsets, valid.long().sum(1)


def valid_tokens(ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> list[tuple[int, list[int]]]:
    """Per row, ``(first position, ids)`` of its valid tokens (one host copy of the chunk)."""
    ids, valid, positions = ids.cpu(), valid.cpu(), positions.cpu()
    out = []
    for i in range(ids.shape[0]):
        mask = valid[i]
        kept = positions[i][mask]
        out.append((int(kept[0]) if kept.numel() else 0, ids[i][mask].tolist()))
    return out
