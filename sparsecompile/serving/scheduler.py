"""Continuous-batching scheduler: chunked prefill interleaved with decode, MemoryOracle admission, preemption.

Every engine step the scheduler decides, under a token budget (``max_num_batched_tokens``):

1. **decode**: one token for every request past its prompt. Each needs a *step reservation* (the pages its
   next token may allocate, from the MemoryOracle). When they do not fit, the most recently admitted request
   is preempted (recompute: its pages are released and it re-enters the queue with prompt + output so far)
   until they do.
2. **prefill**: the next chunk of requests already admitted, then new admissions in arrival order. A request
   is admitted only when its reservation (the peak of its prompt's prefill, transient KV included) fits every
   named budget the oracle reports, leaving a small watermark for the running requests' decode steps. An ``n > 1``
   request is admitted with its siblings' seats and resident pages (``Request.forks``), so they fork its row when
   its prompt ends instead of re-prefilling.

The scheduler holds the *ledger* (pages reserved per request), never the pages themselves: the engine
allocates through the CacheManager and releases a request's row when the scheduler finishes, aborts or
preempts it. Invariant: the pages a request holds never exceed its reservation, and reservations never
exceed the pool, so a step the scheduler emitted never runs out of pages.

Reusable idle state (``reuse``, see ``reuse.py``): idle chains and cached prefix blocks hold pages that no request
has reserved. They sit in a separate ledger: the free budget is the pool minus reservations minus that ledger, and
its state is reclaimed (least recently used first) before an admission waits or a decode step preempts. A request
that resumes some of it (a chain continuation, a prefix-cache hit) starts its prefill after the resumed tokens, and
the resumed pages move from that ledger into its reservation.

Prompt buffers (methods whose prompts keep full-precision buffers outside the pool until they are compacted: the
``<policy>+kivi`` compositions; ``MemoryOracle.prompt_buffer_bytes``): when the engine leaves room for them
(``buffer_budget``), a prompt reserves its buffer's bytes as a second resource from admission to its last chunk, and
a step takes prompt chunks only while its chunks times the largest buffer among them (a step's buffer is padded to
its widest row), plus the buffers of prompts not in the step, fit that room.

The prefill path comes from the method (``prefill_mode``): "chunked" methods are fed chunks of any size;
"aligned" methods exactly ``prefill_chunk_size`` tokens per chunk (the last one shorter), as ``generate()``
feeds them; "whole" methods the whole remaining prompt in one forward. A fixed-size chunk waits for a step
with enough token budget, or runs past the budget when it is the step's only prefill (so it cannot starve).

``max_prefill_tokens_while_decoding`` lowers the prompt budget of a step that also decodes: a step runs as long as its
prompt work, and that is every running stream's gap between two tokens (on the 8B shape an 8,192-token step takes
about 0.3 s against 6.5 ms for a decode step). Steps without decodes keep the whole budget.

Preemption recomputes: a preempted request is queued again with prompt + output as its prompt, exact for dense
methods (vLLM's recompute). With ``replay_outputs`` (methods whose state that prefill would not rebuild:
``SparseMethod.recomputes_by_prefill``) it re-prefills the prompt alone and replays its output as decode steps
(``Request.caught_up``), so it holds and reserves at every step what it did the first time: exact, and never
more than the pool held for it then (a prefill of prompt + output under an eviction method can need more than
the whole pool: the request then waited forever).
"""

from __future__ import annotations

from collections import deque

from ..runtime.contract import PrefillMode
from ..runtime.memory_oracle import PROMPT_BUFFER, MemoryOracle
from .outputs import RequestRejected
from .request import PrefillChunk, Request, RequestStatus, Resume, ReuseIndex, SchedulerOutput


class Scheduler:
    """See module docstring. Host-only and model-free (the property tests drive it without a model)."""

    def __init__(self, oracle: MemoryOracle, num_pages: int, *, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_chunk_size: int, prefill_mode: PrefillMode | str, max_model_len: int,
                 watermark: float = 0.01, reuse: ReuseIndex | None = None,
                 max_prefill_tokens_while_decoding: int | None = None, replay_outputs: bool = False) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs; got "
                             f"{max_num_seqs} and {max_num_batched_tokens}")
        self.oracle = oracle
        self.reuse = reuse
        self.capacity = oracle.resources(num_pages)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        self.prefill_chunk_size = prefill_chunk_size or max_num_batched_tokens
        self.prefill_mode = PrefillMode(prefill_mode)
        self.max_model_len = max_model_len
        self.replay_outputs = replay_outputs  # a preempted request recomputes its output as decode steps
        self.watermark = {"kv_pages": int(self.capacity["kv_pages"] * watermark)}  # room for decode growth
        self.reserved = dict.fromkeys(self.capacity, 0)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted (prefilling or decoding), in admission order
        self.num_preemptions = 0

    # ------------------------------------------------------------------ ledger
    def free(self) -> dict[str, int]:
        """Budgets left: the pool minus reservations minus the pages idle state holds (reclaimable)."""
        idle = {"kv_pages": self.reuse.reclaimable_pages()} if self.reuse is not None else {}
        return {name: total - self.reserved[name] - idle.get(name, 0) for name, total in self.capacity.items()}

    def settle(self) -> None:
        """After the engine released this step's preempted rows: their reservations counted as free when
        :meth:`schedule` preempted them for the step's decodes, but the prefix cache keeps their full blocks (idle,
        reclaimable, not free), so reclaim idle state until the reservations fit the pool again (before, that step
        could run out of pages: ``OutOfPages``)."""
        short = -self.free()["kv_pages"]
        if short > 0 and self.reuse is not None:
            self.reuse.reclaim(short, None)

    def _set_reservation(self, request: Request, cost: dict[str, int]) -> None:
        for name in self.reserved:
            self.reserved[name] += cost.get(name, 0) - request.reserved.get(name, 0)
        request.reserved = dict(cost)

    def _pages(self, slots_per_layer: list[int]) -> dict[str, int]:
        return {"kv_pages": self.oracle.pages_for(slots_per_layer)}

    def _held(self, request: Request) -> list[int]:
        """Slots whose pages the request's row keeps between steps (what its reservation shrinks to)."""
        n = len(request.prefill_ids)
        if request.prompt_slots is not None:
            return self.oracle.resumed_held_slots(request.prompt_slots, n, request.num_decoded)
        return self.oracle.held_slots_per_layer(n, request.num_decoded)

    def _step_cost(self, request: Request) -> dict[str, int]:
        if request.prompt_slots is None:
            return self.oracle.step_cost(len(request.prefill_ids), request.num_decoded, 1)
        n = len(request.prefill_ids)
        now = self.oracle.resumed_resident_slots(request.prompt_slots, n, request.num_decoded)
        return self.oracle.growth_cost(now, self._held(request), 1)

    def _prefill_cost(self, request: Request, resume: Resume | None = None) -> dict[str, int]:
        n = len(request.prefill_ids)
        if resume is not None and resume.resident is not None:
            pages = self._pages(self.oracle.resumed_peak_slots(resume.resident, n, n - resume.tokens))
        else:
            pages = self._pages(self.oracle.peak_slots_per_layer(n, 0))
        return _summed([pages, self.oracle.prompt_cost(n)] + [self._fork_cost(request)] * request.forks)

    def _fork_cost(self, request: Request) -> dict[str, int]:
        """The oracle's model of what one sibling of ``request`` reserves when it forks, which admission reserves for
        it: the pages the prompt leaves resident (shared copy-on-write with its source, counted once per row as for
        every request; ``add_fork`` then reserves the row's measured slots)."""
        return self._pages(self.oracle.held_slots_per_layer(len(request.prompt_ids), 0))

    def _seats(self) -> int:
        """Rows of ``max_num_seqs`` taken: the running requests and the siblings they will fork."""
        return len(self.running) + sum(r.forks for r in self.running)

    def _buffers_fit(self, out: SchedulerOutput, request: Request, need: int) -> bool:
        """``request``'s chunk (its prompt buffer ``need`` bytes) may join this step's prompt chunks: the step's
        buffer, padded to its widest row, and the buffers of prompts not in the step fit the room left for them."""
        room = self.capacity.get(PROMPT_BUFFER, 0)
        if not room:
            return True
        step = [c.request for c in out.prefill]
        widest = max([need] + [r.reserved.get(PROMPT_BUFFER, 0) for r in step])
        elsewhere = sum(r.reserved.get(PROMPT_BUFFER, 0) for r in self.running
                        if r.status is RequestStatus.PREFILLING and r is not request and r not in step)
        return (len(step) + 1) * widest + elsewhere <= room

    def _fits_after_reclaim(self, cost: dict[str, int], protect: Resume | None, watermark: bool) -> bool:
        """``cost`` fits what is free (less the watermark), after reclaiming idle state if it must."""
        def room() -> dict[str, int]:
            free = self.free()
            return {k: v - self.watermark.get(k, 0) for k, v in free.items()} if watermark else free

        if self.oracle.fits(cost, room()):
            return True
        if self.reuse is None:
            return False
        short = max(cost.get(k, 0) - v for k, v in room().items())
        return self.reuse.reclaim(short, protect) > 0 and self.oracle.fits(cost, room())

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
        request.forks = min(request.params.n, self.max_num_seqs) - 1
        while request.forks and not self.oracle.fits(self._prefill_cost(request), self.capacity):
            request.forks -= 1  # siblings beyond what the pool can ever hold with it re-prefill when they find room
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_fork(self, request: Request, source: Request) -> bool:
        """Take ``request``, a sibling (``n > 1``) of ``source``, whose prompt just finished prefilling, holding that
        prompt and its own first sampled token.

        Returns True when it joins the running batch now, as if its prompt had been prefilled (the engine then gives
        it a copy of ``source``'s row, reserving what that row holds, as measured when the prompt ended, which the
        source's admission reserved for it by the oracle's model: ``Request.forks``); False when that does not fit
        (siblings beyond what the batch or the pool could hold): it is queued like a preempted request instead (it
        re-prefills the prompt alone when admitted, reserving that prefill's peak then, and feeds its first token as
        a decode step: :attr:`.Request.caught_up`).
        """
        request.prefill_ids = list(request.prompt_ids)
        request.num_prefilled = request.num_computed = len(request.prefill_ids)
        request.num_decoded = 0
        request.prompt_slots = source.prompt_slots  # the same row: its reservations follow the same measured slots
        # pages only: a fork keeps no prompt buffer (re-prefilled later, it reserves one when it is admitted again)
        resident = self._pages(self._held(request))
        if len(self.running) < self.max_num_seqs and self.oracle.fits(resident, self.free()):
            request.status = RequestStatus.DECODING
            self._set_reservation(request, resident)
            self.running.append(request)
            return True
        request.status = RequestStatus.WAITING
        request.num_prefilled = 0
        request.prompt_slots = None
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
        # recompute: prompt + output as one prompt, or the prompt, then the output replayed as decode steps
        request.prefill_ids = request.prompt_ids + ([] if self.replay_outputs else request.output_ids)
        request.num_prefilled = request.num_decoded = 0  # num_computed stays: the engine caches what it held
        request.resumed = request.prompt_slots = None
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
        need = {r: self._step_cost(r) for r in decoding}
        while decoding and not self.oracle.fits(_summed(need.values()), self.free()):
            if self._fits_after_reclaim(_summed(need.values()), None, watermark=False):
                break
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
        if decoding and self.max_prefill_tokens_while_decoding is not None:  # a step's time is the decode streams'
            budget = min(budget, self.max_prefill_tokens_while_decoding)  # inter-token gap: bound its prompt work
        # 2. continue admitted prompts, then admit new ones (arrival order; the head of the queue blocks)
        for r in self.running:
            if (r.status is RequestStatus.PREFILLING and budget > 0
                    and self._buffers_fit(out, r, r.reserved.get(PROMPT_BUFFER, 0))):
                budget -= self._add_chunk(out, r, budget)
        while self.waiting and budget > 0 and self._seats() < self.max_num_seqs:
            r = self.waiting[0]
            if r in out.preempted or self._seats() + 1 + r.forks > self.max_num_seqs:
                break  # a preempted row is released after this call (and its blocks cached): next step
            resume = self.reuse.lookup(r) if self.reuse is not None else None
            cost = self._prefill_cost(r, resume)
            if resume is not None and resume.chain is not None and not self.oracle.fits(cost, self.capacity):
                # resuming its chain needs more than the whole pool (a resumed prompt's peak can exceed a fresh one's):
                # prefill from scratch (before, the request headed the queue forever)
                resume = self.reuse.lookup(r, resume_chain=False)
                cost = self._prefill_cost(r, resume)
            start = resume.tokens if resume is not None else 0
            if self._chunk_size(r, budget, first=not out.prefill, start=start) == 0:
                break
            brought = resume.idle_pages if resume is not None else 0
            net = {k: v - (brought if k == "kv_pages" else 0) for k, v in cost.items()}
            if (not self._fits_after_reclaim(net, resume, watermark=bool(self.running))
                    or not self._buffers_fit(out, r, cost.get(PROMPT_BUFFER, 0))):
                break
            self.waiting.popleft()
            r.num_prefilled = r.num_computed = 0
            if resume is not None:
                self.reuse.attach(r, resume)
            self._set_reservation(r, cost)
            r.status = RequestStatus.PREFILLING
            self.running.append(r)
            budget -= self._add_chunk(out, r, budget)
        return out

    def _chunk_size(self, request: Request, budget: int, first: bool = False, start: int | None = None) -> int:
        """Tokens of ``request``'s prompt to feed now (0: wait); ``first``: no other prefill in this step yet;
        ``start``: where its prefill would start (a request not admitted yet: after what it resumes)."""
        left = len(request.prefill_ids) - (request.num_prefilled if start is None else start)
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
    def chunk_done(self, chunk: PrefillChunk, slots: list[int] | None = None) -> None:
        """The engine ran ``chunk``; a final chunk turns the request to decoding, its reservation to resident.

        ``slots``: the row's per-layer slot counts after a final chunk, measured: what stays resident then follows
        them rather than the oracle's model of a fresh prompt (a chain continuation resumed a compacted prefix; KVzip's
        global selection keeps a data-dependent number per layer)."""
        r = chunk.request
        r.num_prefilled = r.num_computed = chunk.stop
        r.metrics.num_prefill_chunks += 1
        if chunk.final:
            r.status = RequestStatus.DECODING
            r.num_decoded = 0
            r.forks = 0  # the engine forks them when it samples this step (add_fork): nothing is scheduled between
            if slots is not None:
                r.prompt_slots = list(slots)
            self._set_reservation(r, self._pages(self._held(r)))

    def decode_done(self, request: Request) -> None:
        """The engine ran one decode step of ``request``: shrink its reservation to what stays resident."""
        request.num_decoded += 1
        request.num_computed += 1
        self._set_reservation(request, self._pages(self._held(request)))


def _summed(costs) -> dict[str, int]:
    """Costs ``{resource: amount}`` added up per resource."""
    total: dict[str, int] = {}
    for cost in costs:
        for name, value in cost.items():
            total[name] = total.get(name, 0) + value
    return total


def pack_chunks(chunks: list[PrefillChunk], max_tokens: int) -> list[list[PrefillChunk]]:
    """Group prompt chunks into padded batches: longest first, a group taking the next chunk while its padded size
    (members x longest) stays within ``max_tokens`` (a single chunk may exceed it). Order inside the step does not
    matter: each chunk belongs to a different request."""
    groups: list[list[PrefillChunk]] = []
    for chunk in sorted(chunks, key=lambda c: c.stop - c.start, reverse=True):
        if groups and (len(groups[-1]) + 1) * (groups[-1][0].stop - groups[-1][0].start) <= max_tokens:
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
    return groups
