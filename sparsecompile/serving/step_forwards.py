"""The forwards of an engine step (a mixin of :class:`~.engine.LLMEngine`): the decode batch (its compiled step
and CUDA graph), a group of prompt chunks, or both in one forward (``enable_mixed_chunk``); the chunks' host inputs
and their bookkeeping after the forward."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..runtime.mixed import ChunkGroup
from .request import PrefillChunk, Request
from .request_state import LiveSequence

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager
    from ..runtime.controller import SparseController
    from .interface import ServedModel
    from .reuse import KVReuse
    from .scheduler import Scheduler


@dataclass
class _ChunkInputs:
    """A group of prompt chunks laid out for one forward."""

    lives: list[LiveSequence]
    width: int  # tokens per row (left-padded)
    every_position: bool  # logits at every position (prompt logprobs), else the last one only
    forward_args: ChunkGroup  # rows, ids, positions, valid [batch, width] (host), logits_to_keep, final per row


class StepForwards:
    """Runs a step's forwards over the engine's controller, scheduler and live sequences; sampling is
    :class:`~.step_sampling.StepSampling`'s (``_sample``)."""

    controller: SparseController
    patched: ServedModel
    scheduler: Scheduler
    manager: CacheManager
    reuse: KVReuse
    device: torch.device
    graph_sizes: list[int]
    _forward: Callable[..., torch.Tensor]  # of prefill and mixed steps: the patched inner, or a CompiledForward
    _live: dict[Request, LiveSequence]
    _counters: dict[str, int]
    # and StepSampling's _sample, _wants_prompt_logprobs, _record_prompt_logprobs (step_sampling.py)

    @staticmethod
    def _decode_inputs(requests: list[Request], device: torch.device | str) -> tuple[list[int], torch.Tensor,
                                                                                      torch.Tensor]:
        """Rows, ids and positions ``[batch, 1]`` of a decode batch (each request's last token, or the next one it
        replays: ``Request.next_input``)."""
        ids = torch.tensor([[r.next_input()] for r in requests], device=device)
        positions = torch.tensor([[r.num_computed] for r in requests], device=device)
        return [r.row for r in requests], ids, positions

    def _run_decode(self, requests: list[Request]) -> list[LiveSequence]:
        rows, ids, positions = self._decode_inputs(requests, self.device)
        pad_to = None
        if self.controller.compiles_decode:
            pad_to = next(s for s in self.graph_sizes if s >= len(rows))
        logits = self.controller.decode(self.patched.inner, rows, ids, positions, pad_to=pad_to)
        for r in requests:
            self.scheduler.decode_done(r)
        lives, last = self._caught_up(requests, logits[:, -1])
        return self._sample(lives, last) if lives else []

    def _run_mixed(self, requests: list[Request], groups: list[list[PrefillChunk]]) -> list[LiveSequence]:
        """The decode batch and every group of prompt chunks in one forward (``SparseController.mixed``); one
        sampling pass for the decodes and the prompts that ended."""
        rows, ids, positions = self._decode_inputs(requests, "cpu")  # host tensors: mixed() uploads them
        chunks = [self._group_inputs(group) for group in groups]
        decode_logits, group_logits = self.controller.mixed(self._forward, rows, ids, positions,
                                                            [c.forward_args for c in chunks])
        for r in requests:
            self.scheduler.decode_done(r)
        lives, last = self._caught_up(requests, decode_logits[:, -1]) if requests else ([], None)
        last = [last] if lives else []
        for group, chunk, logits in zip(groups, chunks, group_logits):
            done = self._group_done(group, chunk, logits)
            lives += [chunk.lives[i] for i in done]
            last.append(logits[done, -1])
        return self._sample(lives, torch.cat(last)) if lives else []

    def _caught_up(self, requests: list[Request], logits: torch.Tensor) -> tuple[list[LiveSequence], torch.Tensor]:
        """The decoded sequences that sample now and their rows of ``logits [batch, vocab]`` (all of them unless one
        replays a token it holds: ``Request.caught_up``)."""
        keep = [i for i, r in enumerate(requests) if r.caught_up]
        if len(keep) < len(requests):
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        return [self._live[requests[i]] for i in keep], logits

    def _run_group(self, group: list[PrefillChunk]) -> list[LiveSequence]:
        """One forward over a group of prompt chunks (left-padded); returns the requests whose prompt ended (one
        token sampled each)."""
        chunk = self._group_inputs(group)
        rows, ids, positions, valid, keep, final = chunk.forward_args
        logits = self.controller.prefill(self._forward, rows, ids.to(self.device, non_blocking=True), None,
                                         positions.to(self.device, non_blocking=True), valid, keep, final=final)
        done = self._group_done(group, chunk, logits)
        if not done:
            return []
        return self._sample([chunk.lives[i] for i in done], logits[done, -1])

    def _group_inputs(self, group: list[PrefillChunk]) -> _ChunkInputs:
        now = time.monotonic()
        for chunk in group:
            r = chunk.request
            r.metrics.first_scheduled_time = r.metrics.first_scheduled_time or now
            if r.row is None:
                r.row = self.controller.add_sequences(1)[0]
        width = max(c.stop - c.start for c in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        positions = torch.zeros(len(group), width, dtype=torch.long)
        valid = torch.zeros(len(group), width, dtype=torch.bool)
        for i, c in enumerate(group):
            n = c.stop - c.start
            ids[i, width - n:] = torch.tensor(c.request.prefill_ids[c.start:c.stop])
            positions[i, width - n:] = torch.arange(c.start, c.stop)
            valid[i, width - n:] = True
        lives = [self._live[c.request] for c in group]
        every_position = any(self._wants_prompt_logprobs(live) for live in lives)  # else: last position only
        return _ChunkInputs(lives, width, every_position, ([c.request.row for c in group], ids, positions, valid,
                                                           0 if every_position else 1, [c.final for c in group]))

    def _group_done(self, group: list[PrefillChunk], chunk: _ChunkInputs, logits: torch.Tensor) -> list[int]:
        """Bookkeeping after a group's forward (prompt logprobs, progress); the indices of prompts that ended and
        sample their next token now (not one replaying tokens it holds: ``Request.caught_up``)."""
        width = chunk.width
        for i, (c, live) in enumerate(zip(group, chunk.lives)):
            if chunk.every_position and self._wants_prompt_logprobs(live):
                self._record_prompt_logprobs(live.group, c.start, logits[i, width - (c.stop - c.start):])
            r = c.request
            self._counters["prompt_tokens"] += c.stop - c.start
            # once a prompt ends, its reservations follow the row's measured slots (exact for resumed rows and KVzip)
            slots = self.manager.slot_count_array([r.row])[0].tolist() if c.final else None
            self.scheduler.chunk_done(c, slots)
            self.reuse.progress(r)
        return [i for i, c in enumerate(group) if c.final and c.request.caught_up]
