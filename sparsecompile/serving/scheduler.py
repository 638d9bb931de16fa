"""Continuous-batching scheduler: chunked prefill interleaved with decode, MemoryOracle admission, preemption.

Every engine step the scheduler decides, under a token budget (``max_num_batched_tokens``):

1. **decode**: one token for every request past its prompt. Each needs a *step reservation* (the pages its
   next token may allocate, from the MemoryOracle). When they do not fit, the most recently admitted request
   is preempted (recompute: its pages are released and it re-enters the queue with prompt + output so far)
   until they do.
2. **prefill**: the next chunk of requests already admitted, then new admissions in arrival order. A request
   is admitted only when its reservation (the peak of its prompt's prefill, transient KV included) fits every
   named budget the oracle reports, leaving a small watermark for the running requests' decode steps.

The scheduler holds the *ledger* (pages reserved per request), never the pages themselves: the engine
allocates through the CacheManager and releases a request's row when the scheduler finishes, aborts or
preempts it. Invariant: the pages a request holds never exceed its reservation, and reservations never
exceed the pool, so a step the scheduler emitted never runs out of pages.

The prefill path comes from the method (``prefill_mode``): "chunked" methods are fed chunks of any size;
"aligned" methods exactly ``prefill_chunk_size`` tokens per chunk (the last one shorter), as ``generate()``
feeds them; "whole" methods the whole remaining prompt in one forward. A fixed-size chunk waits for a step
with enough token budget, or runs past the budget when it is the step's only prefill (so it cannot starve).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from ..runtime.contract import PrefillMode
from ..runtime.memory_oracle import MemoryOracle
from .outputs import RequestMetrics, RequestRejected, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted)
    PREFILLING = "prefilling"  # admitted, prompt partly fed
    DECODING = "decoding"  # prompt done, one token per step
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request's scheduling state; tokens are host lists.

    ``prefill_ids`` is what (re)admission feeds: the prompt, or after a preemption prompt + output so far.
    ``num_decoded`` counts decode steps since that prefill (the oracle's ``generated``).
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

    def __post_init__(self) -> None:
        if not self.prefill_ids:
            self.prefill_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (the next decode token's position is ``num_tokens - 1``)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_new_tokens(self) -> int:
        """Decode steps still allowed after the current (re)prefill."""
        return self.params.max_tokens - len(self.output_ids)


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


class Scheduler:
    """See module docstring. Host-only and model-free (the property tests drive it without a model)."""

    def __init__(self, oracle: MemoryOracle, num_pages: int, *, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_chunk_size: int, prefill_mode: PrefillMode | str, max_model_len: int,
                 watermark: float = 0.01) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs; got "
                             f"{max_num_seqs} and {max_num_batched_tokens}")
        self.oracle = oracle
        self.capacity = oracle.resources(num_pages)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_size = prefill_chunk_size or max_num_batched_tokens
        self.prefill_mode = PrefillMode(prefill_mode)
        self.max_model_len = max_model_len
        self.watermark = {name: int(total * watermark) for name, total in self.capacity.items()}
        self.reserved = dict.fromkeys(self.capacity, 0)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted (prefilling or decoding), in admission order
        self.num_preemptions = 0

    # ------------------------------------------------------------------ ledger
    def free(self) -> dict[str, int]:
        return {name: total - self.reserved[name] for name, total in self.capacity.items()}

    def _set_reservation(self, request: Request, cost: dict[str, int]) -> None:
        for name in self.reserved:
            self.reserved[name] += cost.get(name, 0) - request.reserved.get(name, 0)
        request.reserved = dict(cost)

    def _pages(self, slots_per_layer: list[int]) -> dict[str, int]:
        return {"kv_pages": self.oracle.pages_for(slots_per_layer)}

    def _resident(self, request: Request) -> list[int]:
        return self.oracle.resident_slots_per_layer(len(request.prefill_ids), request.num_decoded)

    def _prefill_cost(self, request: Request) -> dict[str, int]:
        return self._pages(self.oracle.peak_slots_per_layer(len(request.prefill_ids), 0))

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        """Queue ``request``; :class:`RequestRejected` when it can never run (too long, larger than the pool)."""
        n = len(request.prompt_ids)
        if n < 1:
            raise RequestRejected("the prompt is empty; pass at least one token")
        if n >= self.max_model_len:
            raise RequestRejected(f"the prompt has {n} tokens; the model's context is {self.max_model_len} tokens, "
                                  f"leaving no room to generate (shorten the prompt to < {self.max_model_len})")
        new = min(request.params.max_tokens, self.max_model_len - n)
        cost = self.oracle.admission_cost(n, new)
        if not self.oracle.fits(cost, self.capacity):
            need = ", ".join(f"{v} {k}" for k, v in cost.items())
            have = ", ".join(f"{v} {k}" for k, v in self.capacity.items())
            raise RequestRejected(f"the request needs {need} at its peak but the KV pool has {have} in all; shorten "
                                  "the prompt or max_tokens, or give the engine more KV memory (kv_cache_memory)")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_fork(self, request: Request) -> bool:
        """Take ``request``, a sibling (``n > 1``) of a request whose prompt just finished prefilling, holding that
        prompt and its own first sampled token.

        Returns True when it joins the running batch now, as if its prompt had been prefilled (the engine then gives
        it a row holding the prompt's KV; the reservation covers the prompt's prefill peak, which a re-prefilled
        fork needs); False when that does not fit: it is queued like a preempted request instead (it re-prefills
        prompt + first token when admitted).
        """
        request.prefill_ids = list(request.prompt_ids)
        request.num_prefilled, request.num_decoded = len(request.prefill_ids), 0
        peak = self._prefill_cost(request)
        resident = self._pages(self._resident(request))
        need = {k: max(peak.get(k, 0), resident.get(k, 0)) for k in set(peak) | set(resident)}
        if len(self.running) < self.max_num_seqs and self.oracle.fits(need, self.free()):
            request.status = RequestStatus.DECODING
            self._set_reservation(request, resident)
            self.running.append(request)
            return True
        request.status = RequestStatus.WAITING
        request.prefill_ids = request.prompt_ids + request.output_ids
        request.num_prefilled = 0
        self.waiting.appendleft(request)
        return False

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """``request`` stopped ("stop", "length" or "abort"): drop it and its reservation."""
        if request.status is RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._set_reservation(request, {})
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.stop_reason = reason, stop_reason

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._set_reservation(request, {})
        request.status = RequestStatus.WAITING
        request.prefill_ids = request.prompt_ids + request.output_ids
        request.num_prefilled = request.num_decoded = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        decoding = [r for r in self.running if r.status is RequestStatus.DECODING]
        # 1. decode reservations (a decoding request reserves its resident pages between steps; a step adds the
        #    oracle's step cost); preempt the newest admissions until they fit
        need = {r: self.oracle.step_cost(len(r.prefill_ids), r.num_decoded, 1) for r in decoding}
        while decoding and not self.oracle.fits(_summed(need.values()), self.free()):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim in need:
                decoding.remove(victim)
                del need[victim]
        for r in decoding:
            self._set_reservation(r, _summed([r.reserved, need[r]]))
        out.decode = decoding
        budget = self.max_num_batched_tokens - len(decoding)
        # 2. continue admitted prompts, then admit new ones (arrival order; the head of the queue blocks)
        for r in self.running:
            if r.status is RequestStatus.PREFILLING and budget > 0:
                budget -= self._add_chunk(out, r, budget)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            cost = self._prefill_cost(r)
            room = {k: v - self.watermark.get(k, 0) for k, v in self.free().items()}
            if not self.oracle.fits(cost, room) and (self.running or not self.oracle.fits(cost, self.free())):
                break
            if self._chunk_size(r, budget, first=not out.prefill) == 0:
                break
            self.waiting.popleft()
            self._set_reservation(r, cost)
            r.status = RequestStatus.PREFILLING
            self.running.append(r)
            budget -= self._add_chunk(out, r, budget)
        return out

    def _chunk_size(self, request: Request, budget: int, first: bool = False) -> int:
        """Tokens of ``request``'s prompt to feed now (0: wait); ``first``: no other prefill in this step yet."""
        left = len(request.prefill_ids) - request.num_prefilled
        if self.prefill_mode is PrefillMode.CHUNKED:
            return min(left, budget, self.prefill_chunk_size)
        size = left if self.prefill_mode is PrefillMode.WHOLE else min(left, self.prefill_chunk_size)
        return size if size <= budget or first else 0

    def _add_chunk(self, out: SchedulerOutput, request: Request, budget: int) -> int:
        size = self._chunk_size(request, budget, first=not out.prefill)
        if size:
            out.prefill.append(PrefillChunk(request, request.num_prefilled, request.num_prefilled + size))
        return size

    # ------------------------------------------------------------------ after the step ran
    def chunk_done(self, chunk: PrefillChunk) -> None:
        """The engine ran ``chunk``; a final chunk turns the request to decoding, its reservation to resident."""
        r = chunk.request
        r.num_prefilled = chunk.stop
        r.metrics.num_prefill_chunks += 1
        if chunk.final:
            r.status = RequestStatus.DECODING
            r.num_decoded = 0
            self._set_reservation(r, self._pages(self._resident(r)))

    def decode_done(self, request: Request) -> None:
        """The engine ran one decode step of ``request``: shrink its reservation to what stays resident."""
        request.num_decoded += 1
        self._set_reservation(request, self._pages(self._resident(request)))


def _summed(costs) -> dict[str, int]:
    """Costs ``{resource: amount}`` added up per resource."""
    total: dict[str, int] = {}
    for cost in costs:
        for name, value in cost.items():
            total[name] = total.get(name, 0) + value
    return total
