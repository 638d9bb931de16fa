"""The controller's prompt path: prompt chunks through the model, then the method's verdict on prompts that ended
(its scoring passes, such as KVzip's re-read). A mixin of ``SparseController``, whose step hooks it drives (``_begin``,
``_run``, ``_end``, ``_make_room``, ``_dense_lengths``) over its ``layout``, ``runtime`` and ``manager``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..config import EngineConfig
from .cache_manager import CacheManager, KVLayout
from .contract import Scorer, SparseMethod
from .prompt_chunks import PromptChunk, place_logits, prompt_chunks
from .row_ops import capacity_bucket
from .step import StepState, valid_tokens

InnerForward = Callable[..., torch.Tensor]


class PromptForward:
    """Prefill and scoring passes (see module docstring)."""

    manager: CacheManager | None
    runtime: SparseMethod
    layout: KVLayout
    config: EngineConfig
    prefill_chunk: int | None
    step: StepState | None
    _decode_steps: dict

    @torch.no_grad()
    def prefill(self, inner: InnerForward, rows: list[int], input_ids: torch.Tensor | None,
                inputs_embeds: torch.Tensor | None, positions: torch.Tensor, valid: torch.Tensor,
                logits_to_keep: int, progress: Callable[[int], None] | None = None,
                final: bool | list[bool] = True) -> torch.Tensor:
        """Run prompt tokens ``[batch, tokens]`` in chunks; returns ``inner``'s logits for the kept positions. The
        rows of a padded batch are cut from their own first token, as each would be alone (``prompt_chunks``).

        ``final`` (per row, or one for all): False when more prompt tokens of that row follow in a later call (the
        serving scheduler feeds a prompt in chunks across engine steps, several prompts' chunks in one forward), so
        the last chunk here does not end its prompt.
        """
        finals = list(final) if isinstance(final, (list, tuple)) else [bool(final)] * len(rows)
        batch, tokens = positions.shape
        if self.runtime.needs_prompt_tokens and input_ids is None:
            raise ValueError(f"{self.runtime.name} re-reads the prompt's token ids: pass input_ids, not inputs_embeds")
        # the host's copies, read once: a device-to-host read per chunk would wait for the previous chunk's kernels,
        # and the GPU would then idle while the host books the next chunk (h2o's 8192-token chunks at 32K)
        valid_host, positions_host = valid.cpu(), positions.cpu()
        ids_host = input_ids.cpu() if self.runtime.needs_prompt_tokens else None
        plan = prompt_chunks(valid_host, self.prefill_chunk or tokens)
        gathered = plan[0].gathers
        outputs = []
        for j, piece in enumerate(plan):
            if gathered:  # the last step holds every row's last token; other logits are placed by column
                keep = 1 if logits_to_keep == 1 else 0
            else:
                keep = logits_to_keep if piece.last else (0 if logits_to_keep == 0 else 1)
            logits = self._prefill_step(inner, piece, [rows[i] for i in piece.members],
                                        [piece.last and finals[i] for i in piece.members], input_ids, inputs_embeds,
                                        positions, positions_host, ids_host, keep)
            if keep == 0 or piece.last:
                outputs.append((piece, logits))
            if progress is not None:
                progress(tokens * (j + 1) // len(plan) - tokens * j // len(plan))
        if gathered and logits_to_keep != 1:
            placed = place_logits(batch, tokens, outputs)
            return placed if logits_to_keep == 0 else placed[:, -logits_to_keep:]
        return outputs[0][1] if len(outputs) == 1 else torch.cat([out for _, out in outputs], dim=1)

    def _prefill_step(self, inner: InnerForward, piece: PromptChunk, rows: list[int], ends: list[bool],
                      input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, positions: torch.Tensor,
                      positions_host: torch.Tensor, ids_host: torch.Tensor | None, keep: int) -> torch.Tensor:
        """One prefill chunk (``piece`` of the batch) through ``inner``; then the verdict on prompts it ended."""
        step_positions = piece.take(positions_host)
        step = StepState.build(rows, piece.valid, step_positions, is_prefill=True, is_last_chunk=ends,
                               device=self.layout.device)
        if ids_host is not None:
            step.prompt_tokens = valid_tokens(piece.take(ids_host), piece.valid, step_positions)
        self._begin(step)
        step.slot_plan = self.manager.slot_plan(step)
        logits = self._run(inner, step, input_ids=piece.take(input_ids), inputs_embeds=piece.take(inputs_embeds),
                           position_ids=piece.take(positions), logits_to_keep=keep)
        self._end(step)
        if step.is_last_chunk:
            self._after_prompts(inner, [r for r, done in zip(rows, step.ends_prompt) if done])
        return logits

    def _after_prompts(self, inner: InnerForward, rows: list[int]) -> None:
        """The method's scoring passes for prompts that just ended (KVzip's reconstruction), then its verdict."""
        passes = self.runtime.scoring_passes(self.manager, rows)
        for p in passes:
            self.score_pass(inner, p.rows, p.token_ids, p.first_positions, p.scorer)
        if passes:
            self.runtime.scoring_done(self.manager, rows)

    @torch.no_grad()
    def score_pass(self, inner: InnerForward, rows: list[int], token_ids: list[list[int]],
                   first_positions: list[int], scorer: Scorer) -> None:
        """Feed ``token_ids[i]`` to ``rows[i]`` at positions ``first_positions[i]..`` (a left-padded batch) after
        everything resident, attending densely; ``scorer.on_attention_end`` sees every layer and the method's hooks
        do not run. The tokens' KV goes to temporary slots after each row's resident ones, dropped afterwards (their
        pages go back): nothing resident changes except what the scorer itself writes."""
        m, device = self.manager, self.layout.device
        width = max(len(t) for t in token_ids)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (t, first) in enumerate(zip(token_ids, first_positions)):
            ids[i, width - len(t):] = torch.tensor(t, dtype=torch.long)
            positions[i, width - len(t):] = torch.arange(first, first + len(t))
            valid[i, width - len(t):] = True
        step = StepState.build(rows, valid, positions, is_prefill=True, is_last_chunk=False, device=device)
        step.scorer = scorer
        before = self._make_room(step)
        step.dense_lengths = self._dense_lengths(step, before)  # the pass reads densely: the fast attention paths
        try:
            if m.has_shared_rows(rows):  # appends only: the shared tail pages are copied
                short = m.pages_to_copy(rows, before) - m.allocator.num_free
                if short > 0 and self.config.num_pages is None:
                    m.grow(capacity_bucket(m.num_pages + short), m.max_seqs, m.max_pages_per_seq)
                    self._decode_steps.clear()
                m.prepare_writes(rows, before)
            m.flush()
            self.step = step
            inner(input_ids=ids.to(device, non_blocking=True), inputs_embeds=None,
                  position_ids=step.positions.clamp(min=0), logits_to_keep=1)
        finally:
            self.step = None
            layers = self.layout.num_layers
            m.truncate_many(np.repeat(rows, layers), np.tile(np.arange(layers), len(rows)),
                            before.reshape(-1))
            m.flush()
