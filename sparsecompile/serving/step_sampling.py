"""Sampling of an engine step (a mixin of :class:`~.engine.LLMEngine`): one token per sequence from the step's
logits, stop conditions, logprobs; ``n > 1`` siblings added at their request's first token and forked
copy-on-write from its row; prompt logprobs recorded as chunks pass."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .request import Request
from .request_state import LiveSequence, RequestGroup
from .sampling import sample

if TYPE_CHECKING:
    from ..runtime.controller import SparseController
    from .logprobs import LogprobRecorder
    from .scheduler import Scheduler


class StepSampling:
    """Turns a step's logits into tokens, finished sequences and forked siblings (see module docstring)."""

    # provided by LLMEngine
    controller: SparseController
    scheduler: Scheduler
    eos_token_ids: set[int]
    max_model_len: int
    _logprobs: LogprobRecorder
    _counters: dict[str, int]
    _add_seq: Callable[[RequestGroup, Request], LiveSequence]
    _finish: Callable[[LiveSequence, str, str | int | None], None]

    def _sample(self, lives: list[LiveSequence], logits: torch.Tensor) -> list[LiveSequence]:
        """Sample one token per sequence from ``logits [batch, vocab]``; apply stop conditions.

        A request with ``n > 1`` at its first token samples all ``n`` first tokens from its one row of logits, then
        its siblings are forked before any sequence that finished frees its row.
        """
        lives, logits, children = self._expand_forks(lives, logits)
        token_t = sample(logits, [lv.group.params for lv in lives], [lv.generator for lv in lives],
                         [lv.history for lv in lives], self.eos_token_ids)
        tokens = token_t.tolist()
        # None unless a sequence asks: then no device work and no host sync beyond the tokens'
        logprobs = self._logprobs.sampled(logits, tokens, [lv.group.params.logprobs for lv in lives])
        now = time.monotonic()
        finished = []
        for i, (live, token) in enumerate(zip(lives, tokens)):
            r = live.request
            r.output_ids.append(token)
            r.metrics.num_generated_tokens += 1
            r.metrics.first_token_time = r.metrics.first_token_time or now
            self._counters["generation_tokens"] += 1
            if logprobs is not None and live.logprobs is not None:
                live.logprobs.append(logprobs[i])
                live.cumulative_logprob += logprobs[i][token].logprob
            reason, stop = live.detok.append(token)
            if reason is None and r.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                finished.append((live, reason, stop))
        done = {id(lv) for lv, _, _ in finished}
        for child, parent in children:
            if id(child) not in done and self.scheduler.add_fork(child.request, parent):
                child.request.row = self._fork_row(parent.row, child.request.prefill_ids)
        for live, reason, stop in finished:
            self._finish(live, reason, stop)
        return lives

    # ------------------------------------------------------------------ n > 1: forks
    def _expand_forks(self, lives: list[LiveSequence], logits: torch.Tensor
                      ) -> tuple[list[LiveSequence], torch.Tensor, list[tuple[LiveSequence, Request]]]:
        """Add the ``n - 1`` siblings of each request sampling its first token, each with a copy of its logits row.

        Returns the sequences to sample, their logits and ``(sibling, request whose row it forks)`` pairs.
        """
        if all(lv.group.params.n == 1 or len(lv.group.seqs) > 1 for lv in lives):
            return lives, logits, []
        expanded, rows, children = [], [], []
        for i, live in enumerate(lives):
            expanded.append(live)
            rows.append(i)
            group = live.group
            if group.params.n == 1 or len(group.seqs) > 1:
                continue
            parent = live.request
            for _ in range(group.params.n - 1):
                request = Request(f"{group.request_id}#{len(group.seqs)}", parent.prompt_ids, group.params,
                                  group.metrics, prompt=parent.prompt)
                child = self._add_seq(group, request)
                expanded.append(child)
                rows.append(i)
                children.append((child, parent))
        return expanded, logits[torch.tensor(rows, device=logits.device)], children

    def _fork_row(self, row: int, tokens: list[int]) -> int:
        """A new row holding what ``row`` holds (the prompt it just finished prefilling): its pages shared
        copy-on-write and the method's per-row state copied (``SparseController.fork_rows``), so ``n`` completions
        of one prompt prefill it once. The scheduler reserved each sibling's pages as if it held its own copy
        (``Scheduler.add_fork``): conservative, never short."""
        return self.controller.fork_rows([row])[0]

    # ------------------------------------------------------------------ prompt logprobs
    def _wants_prompt_logprobs(self, live: LiveSequence) -> bool:
        """Whether this chunk's logits are needed at every position: the request asked for prompt logprobs and this
        is its first pass over the prompt (not a sibling's or a preempted request's recomputation)."""
        return live.group.params.prompt_logprobs is not None and live.index == 0 and not live.request.output_ids

    def _record_prompt_logprobs(self, group: RequestGroup, start: int, logits: torch.Tensor) -> None:
        group.prompt_logprobs = self._logprobs.extend_prompt(group.prompt_logprobs or [], group.prompt_ids, start,
                                                             logits, group.params.prompt_logprobs)
