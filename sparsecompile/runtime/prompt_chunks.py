"""How a batch of prompts is cut into prefill chunks.

Cut by columns, a left-padded batch would start each row's chunks at another offset of its own tokens (a row behind
7 pads, chunked by 4, runs 1 token, then 4, ...), and a method whose result depends on where chunks end (H2O evicts
after each chunk, KIVI quantizes the groups a chunk completes) would give a row other tokens in a batch than alone.
So each row's valid tokens are cut from its own first one, exactly as the row alone would be, and the rows run
right-aligned: their chunks end together, so one step ends every prompt and its logits hold every row's last token.
A batch with no padding is cut by columns as before (the same chunks, no gather).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptChunk:
    """One prefill step's share of a ``[batch, tokens]`` prompt batch.

    ``members``: the batch indices of the rows in this step (ascending); ``columns``: a column slice taken by every
    row, or ``[len(members), width]`` int64, the batch column each of the step's slots takes (pad slots: any valid
    column, ignored); ``valid``: ``[len(members), width]`` bool, left-padded within the step; ``last``: every row's
    prompt ends in this step.
    """

    members: list[int]
    columns: slice | torch.Tensor
    valid: torch.Tensor
    last: bool

    @property
    def gathers(self) -> bool:
        return not isinstance(self.columns, slice)

    def take(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """This step's part of a ``[batch, tokens, ...]`` tensor (ids, positions, embeddings), on its device."""
        if tensor is None:
            return None
        if not self.gathers:
            return tensor[:, self.columns]
        # host-to-device copies that do not wait for the device (a synchronous one would stall the next chunk's launch
        # until the previous chunk's kernels end)
        members = torch.tensor(self.members).to(tensor.device, non_blocking=True)
        return tensor[members[:, None], self.columns.to(tensor.device, non_blocking=True)]


def prompt_chunks(valid: torch.Tensor, chunk: int) -> list[PromptChunk]:
    """The steps that run ``valid [batch, tokens]`` (host bool) in chunks of at most ``chunk`` tokens a row."""
    batch, tokens = valid.shape
    counts = valid.sum(1).tolist()
    if tokens <= chunk or bool(valid.all()) or max(counts) == 0:
        starts = range(0, tokens, chunk)
        return [PromptChunk(list(range(batch)), slice(s, min(tokens, s + chunk)), valid[:, s:s + chunk],
                            s + chunk >= tokens) for s in starts]
    own = [max(1, math.ceil(n / chunk)) for n in counts]  # an empty row takes part in the last step, with nothing
    steps = max(own)
    columns = [valid[i].nonzero().flatten() for i in range(batch)]
    out = []
    for j in range(steps):
        members = [i for i in range(batch) if j >= steps - own[i]]
        pieces = [columns[i][(j - steps + own[i]) * chunk:][:chunk] for i in members]
        width = max(len(p) for p in pieces)
        cols = torch.zeros(len(members), width, dtype=torch.int64)
        mask = torch.zeros(len(members), width, dtype=torch.bool)
        for k, piece in enumerate(pieces):
            if len(piece):
                cols[k] = piece[0]  # pad slots repeat the first token's column; they are not valid
                cols[k, width - len(piece):] = piece
                mask[k, width - len(piece):] = True
        out.append(PromptChunk(members, cols, mask, j == steps - 1))
    return out


def place_logits(batch: int, tokens: int, steps: list[tuple[PromptChunk, torch.Tensor]]) -> torch.Tensor:
    """``[batch, tokens, vocab]``: each gathered step's logits ``[members, width, vocab]`` at their rows' batch
    columns (pad columns zero: no step computes logits there)."""
    first = steps[0][1]
    out = first.new_zeros(batch, tokens, first.shape[-1])
    for piece, logits in steps:
        valid = piece.valid.to(logits.device, non_blocking=True)
        members = torch.tensor(piece.members).to(logits.device, non_blocking=True)[:, None].expand_as(valid)
        out[members[valid], piece.columns.to(logits.device, non_blocking=True)[valid]] = logits[valid]
    return out
