"""What the scheduler schedules (``scheduler.py``): a request's scheduling state, a prompt chunk, one step's plan,
and the seam to reusable idle state (:class:`ReuseIndex`, implemented by ``reuse.KVReuse``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from .outputs import RequestMetrics, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted)
    PREFILLING = "prefilling"  # admitted, prompt partly fed
    DECODING = "decoding"  # prompt done, one token per step
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request's scheduling state; tokens are host lists.

    ``prefill_ids`` is what (re)admission feeds: the prompt, or after a preemption prompt + output so far (or the
    prompt alone, its output then replayed: :attr:`caught_up`).
    ``num_decoded`` counts decode steps since that prefill (the oracle's ``generated``). ``num_computed``: tokens
    whose KV the request's row holds (``prompt_ids + output_ids`` in order; the last sampled token is not fed yet).
    ``chain_id``: the session whose idle state a continuation resumes and under which the finished state stays.
    ``resumed``: per-layer slots of a reattached chain row at admission; ``prompt_slots``: the row's slots when
    such a resumed prompt ended (reservations follow them instead of the oracle's fresh-prompt model).
    ``forks``: the siblings of an ``n > 1`` request still to fork from its row when its first prompt ends: admission
    counts their seats in ``max_num_seqs`` and their resident pages in its reservation, so every one of them forks
    (a sibling that does not fit re-prefills the prompt alone and feeds its first token as a decode step:
    :attr:`caught_up`).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    prompt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    prefill_ids: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    num_decoded: int = 0
    row: int | None = None
    reserved: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    chain_id: str | None = None
    num_computed: int = 0
    resumed: list[int] | None = None
    prompt_slots: list[int] | None = None
    chain: Any = None  # the reattached chain record (reuse.py)
    forks: int = 0  # n > 1: siblings forked when its prompt ends, whose seats and resident pages it reserves
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of its full blocks (a memo)

    def __post_init__(self) -> None:
        if not self.prefill_ids:
            self.prefill_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (the next decode token's position is ``num_tokens - 1`` once
        :attr:`caught_up`)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def caught_up(self) -> bool:
        """Whether the row holds every token so far (asked after a forward, before sampling), so that the forward's
        last logits give the next token. Not while a request replays tokens it already holds as decode steps: an
        ``n > 1`` sibling queued instead of forked (``Scheduler.add_fork``: the prompt re-prefilled alone, then its
        first token, as a forked sibling feeds it) and a preempted request of a method that does not recompute by
        prefill (:attr:`.SparseMethod.recomputes_by_prefill`: the prompt, then its output a token a step)."""
        return self.num_computed == self.num_tokens

    def next_input(self) -> int:
        """The token the next decode step feeds (position ``num_computed``): the last sampled one, or while
        replaying the next of the output it holds."""
        return self.output_ids[self.num_computed - len(self.prompt_ids)]

    @property
    def max_new_tokens(self) -> int:
        """Decode steps still allowed after the current (re)prefill."""
        return self.params.max_tokens - len(self.output_ids)


@dataclass
class Resume:
    """What admitting a request reuses (:meth:`ReuseIndex.lookup`; committed by :meth:`ReuseIndex.attach`).

    ``tokens``: prompt tokens whose KV is reused (the prefill starts there); ``idle_pages``: pages that leave the
    reclaimable ledger for the request's reservation; ``resident``: per-layer slots of a reattached chain row (its
    cost follows them), None for a prefix hit (full KV: the fresh prompt's cost); ``miss``: why a request with a
    chain id did not reattach one. ``chain`` / ``blocks``: the reused records (owned by the index).
    """

    tokens: int = 0
    idle_pages: int = 0
    resident: list[int] | None = None
    miss: str | None = None
    chain: Any = None
    blocks: list = field(default_factory=list)


class ReuseIndex(Protocol):
    """Idle state that requests can resume and the scheduler can reclaim (``reuse.KVReuse``)."""

    def reclaimable_pages(self) -> int:
        """Pages held by idle state (no request reserved them)."""

    def lookup(self, request: Request, resume_chain: bool = True) -> Resume | None:
        """What ``request`` would resume if admitted now (no state change that a later admission depends on);
        ``resume_chain`` False: not its idle chain."""

    def attach(self, request: Request, resume: Resume) -> None:
        """Admit with ``resume``: set ``request.row`` (when reused), ``num_prefilled`` and ``num_computed``."""

    def reclaim(self, pages: int, protect: Resume | None) -> int:
        """Free idle state, least recently used first, until ``pages`` left the ledger (or nothing is left; never
        what ``protect`` resumes); returns the pages that left it."""


@dataclass
class PrefillChunk:
    """Feed ``request.prefill_ids[start:stop]``; ``final``: this chunk ends the prompt (sample a token)."""

    request: Request
    start: int
    stop: int

    @property
    def final(self) -> bool:
        return self.stop == len(self.request.prefill_ids)


@dataclass
class SchedulerOutput:
    decode: list[Request] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # the engine releases their rows before the step

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.stop - c.start for c in self.prefill)
