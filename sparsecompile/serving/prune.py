"""Interval pruning of idle state (paper: interval pruning, appendix B.2).

An application names an idle chain (by ``chain_id``, or by its complete ``token_ids``), half-open page-aligned
position ranges ``[L, R)`` of its history and a budget ``keep_tokens``: in every layer and KV head, at most
``keep_tokens`` of the resident entries whose positions fall in the ranges stay (one budget shared by all ranges),
chosen by a scoring policy; ``keep_tokens=0`` drops them all without scoring. Entries outside the ranges are not
touched. Freed pages go back to the allocator at once; the chain's logical token history is unchanged and stays
its matching key, and later continuations are marked as using compressed history.

Policies (scoring passes, ``methods/interval_scoring.py``; their KV is temporary):

* ``kvzip``: the ranges' tokens are re-read after the whole history, in chunks of 2048 (fewer when the row's
  block table, sized by ``max_model_len``, cannot hold the history, a lead-in and a whole chunk) after KVzip's lead-ins
  (the method's ``repeat_ids`` / ``continue_ids`` when it has them, else the tokenizer's ids of KVzip's texts,
  else none); an entry scores the maximum attention it receives from its KV group's reconstruction queries.
* ``snapkv``: the history's last 32 tokens are fed again as an observation window; an entry scores the window's
  softmax mass (averaged over its group), max-pooled over its 7 nearest range entries in position order.

Refused with the reason, changing nothing: an unknown or running chain, ranges that are empty, overlapping,
unaligned or out of bounds, a negative budget, an unknown policy, and methods that keep every token (vanilla,
quest, omnikv: their state is a full history that dense or page / token selection reads, and that the prefix cache
shares by page). Adjacent ranges are merged.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..methods.interval_scoring import ReconstructionScorer, WindowScorer, keep_slots, resident_layout
from ..methods.kvzip import CONTINUE_TEXT, REPEAT_TEXT
from ..runtime.allocator import OutOfPages
from .chain_cache import Chain

POLICIES = ("kvzip", "snapkv")
CHUNK, LEAD_IN, SINKS = 2048, 8, 4  # KVzip's re-read chunk, lead-in and sinks
WINDOW, KERNEL = 32, 7  # SnapKV's observation window and pooling width
_KEEP_RECORDS = 1024


class PruneRejected(ValueError):
    """A prune request that cannot run as given; nothing was changed."""


class PruneBlocked(PruneRejected):
    """The state is in use by a running request (retried when it goes idle, for submitted prunes)."""


@dataclass
class PruneSpec:
    """What to prune (see module docstring)."""

    ranges: list[tuple[int, int]]
    keep_tokens: int
    policy: str = "kvzip"
    chain_id: str | None = None
    token_ids: list[int] | None = None


@dataclass
class PruneResult:
    """A prune's outcome (``status``: pending, blocked, completed or failed)."""

    prune_id: str
    status: str
    reason: str | None = None
    chain_id: str | None = None
    ranges: list[tuple[int, int]] = field(default_factory=list)
    keep_tokens: int = 0
    policy: str = "kvzip"
    removed_entries: int = 0  # (layer, KV head, token) entries dropped
    freed_pages: int = 0
    seconds: float = 0.0


class Pruner:
    """Runs prunes against one engine's idle chains; keeps the submitted ones' records (see module docstring)."""

    def __init__(self, engine: Any) -> None:  # the LLMEngine (engine.py imports this module)
        self.engine = engine
        self.records: OrderedDict[str, PruneResult] = OrderedDict()
        self._blocked: dict[str, PruneSpec] = {}
        self._ids = 0

    # ------------------------------------------------------------------ submitted prunes (the HTTP API)
    def submit(self, spec: PruneSpec) -> PruneResult:
        """Run now; a prune of state in use waits (``blocked``) and runs when that state goes idle."""
        self._ids += 1
        record = PruneResult(f"prune-{self._ids}", "pending", chain_id=spec.chain_id, keep_tokens=spec.keep_tokens,
                             policy=spec.policy)
        self.records[record.prune_id] = record
        while len(self.records) > _KEEP_RECORDS:
            self.records.popitem(last=False)
        self._attempt(record.prune_id, spec)
        return self.records[record.prune_id]

    @property
    def has_blocked(self) -> bool:
        return bool(self._blocked)

    def status(self, prune_id: str) -> PruneResult | None:
        return self.records.get(prune_id)

    def retry(self) -> None:
        """Run the blocked prunes whose state went idle (the engine calls this when a request finishes)."""
        for prune_id, spec in list(self._blocked.items()):
            self._attempt(prune_id, spec)

    def _attempt(self, prune_id: str, spec: PruneSpec) -> None:
        record = self.records.get(prune_id)
        if record is None:
            self._blocked.pop(prune_id, None)
            return
        try:
            done = self.prune(spec)
        except PruneBlocked as err:
            record.status, record.reason = "blocked", str(err)
            self._blocked[prune_id] = spec
            return
        except PruneRejected as err:
            record.status, record.reason = "failed", str(err)
        except Exception as err:  # noqa: BLE001 - reported to the client; the engine goes on
            record.status, record.reason = "failed", f"internal error: {err!r}"
        else:
            done.prune_id = prune_id
            self.records[prune_id] = done
        self._blocked.pop(prune_id, None)

    # ------------------------------------------------------------------ one prune
    def prune(self, spec: PruneSpec) -> PruneResult:
        """Prune now; raises :class:`PruneRejected` (or :class:`PruneBlocked`) with the reason, changing nothing."""
        start = time.perf_counter()
        chain, ranges = self._validate(spec)
        engine = self.engine
        m = engine.manager
        free_before = m.allocator.num_free
        counts = m.slot_count_array([chain.row])[0]
        scores = None
        if spec.keep_tokens > 0 and self._over_budget(chain, ranges, spec.keep_tokens, counts):
            try:
                scores = self._score(chain, ranges, spec.policy, counts)
            except OutOfPages as err:  # the re-read's temporary tokens need free pages; nothing changed yet
                raise PruneRejected(f"not enough free KV pages for the scoring pass ({err}); retry when requests "
                                    "have finished, or prune with keep_tokens=0 (no scoring)") from None
        try:  # removal moves entries: pages shared with a fork are copied first
            m.prepare_writes([chain.row], np.zeros_like(m.slot_count_array([chain.row])))
        except OutOfPages as err:
            raise PruneRejected(f"not enough free KV pages to copy the pages this chain shares with a fork ({err})") \
                from None
        finally:
            m.flush()
        removed = 0
        for layer in range(m.layout.num_layers):
            removed += self._prune_layer(chain.row, layer, int(counts[layer]), ranges, spec.keep_tokens,
                                         None if scores is None else scores.get(layer), spec.policy)
        m.flush()
        reuse = engine.reuse
        held = sum(len(m.pages_of(chain.row, layer)) for layer in range(m.layout.num_layers))
        reuse.chains.idle_pages += held - chain.pages
        chain.pages, chain.compressed = held, True
        return PruneResult("", "completed", None, chain.chain_id, ranges, spec.keep_tokens, spec.policy, removed,
                           m.allocator.num_free - free_before, time.perf_counter() - start)

    def _validate(self, spec: PruneSpec) -> tuple[Chain, list[tuple[int, int]]]:
        rt = self.engine.controller.runtime
        if rt.keeps_all_tokens:
            raise PruneRejected(f"{rt.name} keeps every token in order (dense attention, or page / token selection "
                                "over the full history, whose pages the prefix cache may share): it cannot prune; "
                                "serve an eviction method (snapkv, pyramidkv, h2o, streamingllm, kvzip) to prune")
        if rt.storage is not None:
            raise PruneRejected(f"{rt.name} stores KV quantized in groups of tokens (KIVI): removing entries from a "
                                "range would re-quantize the groups around them; prune under the policy alone "
                                "(snapkv, pyramidkv, h2o, streamingllm, kvzip)")
        if spec.policy not in POLICIES:
            raise PruneRejected(f"unknown policy {spec.policy!r}; use one of {', '.join(POLICIES)}")
        if isinstance(spec.keep_tokens, bool) or not isinstance(spec.keep_tokens, int) or spec.keep_tokens < 0:
            raise PruneRejected(f"keep_tokens must be an integer >= 0 (0 drops the ranges), got {spec.keep_tokens!r}")
        chain = self._target(spec)
        return chain, self._ranges(spec.ranges, chain.num_tokens)

    def _target(self, spec: PruneSpec) -> Chain:
        reuse, running = self.engine.reuse, self.engine.scheduler.running
        if (spec.chain_id is None) == (spec.token_ids is None):
            raise PruneRejected("name the state to prune with exactly one of chain_id or token_ids")
        if spec.chain_id is not None:
            chain = reuse.chains.idle.get(spec.chain_id)
            if chain is None:
                if reuse.chains.active.get(spec.chain_id):
                    raise PruneBlocked(f"chain {spec.chain_id!r} is in use by a running request")
                raise PruneRejected(f"no idle chain {spec.chain_id!r} (unknown, or its state was freed)")
            return chain
        tokens = np.asarray(spec.token_ids, dtype=np.int64)

        def matches(candidate: Chain) -> bool:
            n = candidate.num_tokens
            return len(tokens) in (n, n + 1) and np.array_equal(tokens[:n], candidate.tokens)

        if any(r.chain is not None and matches(r.chain) for r in running):
            raise PruneBlocked("the state of these token_ids is in use by a running request")
        found = [chain for chain in reuse.chains.idle.values() if matches(chain)]
        if not found:
            raise PruneRejected("no idle chain holds these token_ids (the processed tokens of a finished request "
                                "with a chain_id, optionally followed by its last sampled token)")
        return found[-1]  # the most recently used

    def _ranges(self, ranges, limit: int) -> list[tuple[int, int]]:
        P = self.engine.manager.layout.page_size
        if not ranges:
            raise PruneRejected("ranges is empty; pass at least one [L, R)")
        clean = []
        for item in ranges:
            try:
                lo, hi = item
            except (TypeError, ValueError):
                raise PruneRejected(f"each range is a pair [L, R), got {item!r}") from None
            if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in (lo, hi)):
                raise PruneRejected(f"range bounds must be integers, got {item!r}")
            lo, hi = int(lo), int(hi)
            if hi <= lo:
                raise PruneRejected(f"range [{lo}, {hi}) is empty")
            if lo < 0 or hi > limit:
                raise PruneRejected(f"range [{lo}, {hi}) is outside the processed history [0, {limit})")
            if lo % P or hi % P:
                raise PruneRejected(f"range [{lo}, {hi}) is not page-aligned: both bounds must be multiples of the "
                                    f"page size ({P})")
            clean.append((lo, hi))
        clean.sort()
        merged = [clean[0]]
        for lo, hi in clean[1:]:
            if lo < merged[-1][1]:
                raise PruneRejected(f"ranges [{merged[-1][0]}, {merged[-1][1]}) and [{lo}, {hi}) overlap")
            if lo == merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
            else:
                merged.append((lo, hi))
        return merged

    # ------------------------------------------------------------------ scoring and removal
    def _positions(self, row: int, layer: int, count: int) -> torch.Tensor:
        m = self.engine.manager
        rows = torch.tensor([row], device=m.layout.device)
        return resident_layout(m, layer, rows, torch.tensor([count], device=rows.device), count)[2][0]  # [H, count]

    @staticmethod
    def _in_ranges(pos: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        inside = torch.zeros_like(pos, dtype=torch.bool)
        for lo, hi in ranges:
            inside |= (pos >= lo) & (pos < hi)
        return inside

    def _over_budget(self, chain: Chain, ranges, keep: int, counts: np.ndarray) -> bool:
        """Some layer and head holds more than ``keep`` entries in the ranges (else nothing needs scoring)."""
        return any(int(self._in_ranges(self._positions(chain.row, layer, int(counts[layer])), ranges).sum(-1).max())
                   > keep for layer in range(len(counts)) if counts[layer])

    def _lead_ids(self) -> tuple[list[int], list[int]]:
        config, tokenizer = self.engine.controller.runtime.config, self.engine.tokenizer
        ids = [getattr(config, "repeat_ids", None), getattr(config, "continue_ids", None)]
        for i, text in enumerate((REPEAT_TEXT, CONTINUE_TEXT)):
            if ids[i] is None and hasattr(tokenizer, "encode"):
                try:
                    ids[i] = tokenizer.encode(text, add_special_tokens=False)
                except Exception:  # noqa: BLE001 - no text tokenizer: no lead-in
                    ids[i] = None
        return list(ids[0] or ()), list(ids[1] or ())

    def _score(self, chain: Chain, ranges, policy: str, counts: np.ndarray) -> dict[int, torch.Tensor]:
        """Per layer ``[H, count]`` fp32 scores of the resident entries (only the ranges' are meaningful)."""
        m, c, engine = self.engine.manager, self.engine.controller, self.engine
        device = m.layout.device
        widths = [int(x) for x in counts]
        scores = {layer: torch.zeros(m.layout.num_kv_heads, max(w, 1), device=device) for layer, w in
                  enumerate(widths)}

        def store(layer, local, slots, values, mask):
            target = scores[layer]
            idx = torch.where(mask[0], local[0], target.shape[-1])
            padded = torch.cat([target, target.new_zeros(target.shape[0], 1)], dim=-1)
            scores[layer] = padded.scatter(-1, idx, torch.where(mask[0], values[0].float(), 0.0))[:, :-1]

        tokens, n = chain.tokens.tolist(), chain.num_tokens
        if policy == "snapkv":
            window = tokens[-WINDOW:]
            self._room(max(widths), len(window), "SnapKV's observation window")
            c.score_pass(engine.patched.inner, [chain.row], [window], [n], WindowScorer(widths, store))
            return {layer: self._pool(s, self._positions(chain.row, layer, widths[layer]), ranges)
                    for layer, s in scores.items()}
        repeat, cont = self._lead_ids()
        longest_lead = max(len(repeat), len(cont) + LEAD_IN)  # chunks of 2048, fewer if the row cannot hold them
        chunk = min(CHUNK, self._room(max(widths), longest_lead + LEAD_IN, "KVzip's re-read") - longest_lead)
        first = True
        for lo, hi in ranges:
            for start in range(lo, hi, chunk):
                stop = min(hi, start + chunk)
                lead = repeat if first else cont + tokens[max(0, start - LEAD_IN):start]
                first = False
                bounds = torch.tensor([[start, stop]], device=device)
                scorer = ReconstructionScorer(bounds[:, 0], bounds[:, 1], SINKS, widths, stop - start, store)
                c.score_pass(engine.patched.inner, [chain.row], [lead + tokens[start:stop]], [n], scorer)
        return scores

    def _room(self, resident: int, need: int, what: str) -> int:
        """Slots a layer of the row can still take after ``resident`` entries (the scoring pass appends its
        temporary tokens there); refuses when fewer than ``need``."""
        # the pages max_model_len asks for (the block table may be wider: its width is rounded up for alignment)
        slots = self.engine.row_pages * self.engine.manager.layout.page_size
        if slots - resident < need:
            raise PruneRejected(f"{what} needs room for {need} tokens after the {resident} resident entries, and a "
                                f"sequence holds {slots} slots per layer (max_model_len): serve with a larger "
                                "max_model_len, or prune with keep_tokens=0 (no scoring)")
        return slots - resident

    def _pool(self, scores: torch.Tensor, pos: torch.Tensor, ranges) -> torch.Tensor:
        """Max-pool each head's range scores over its neighbours in position order (SnapKV's smoothing)."""
        inside = self._in_ranges(pos, ranges)
        key = torch.where(inside, pos, torch.iinfo(torch.int64).max)
        order = key.argsort(dim=-1, stable=True)
        ordered = torch.where(inside.gather(-1, order), scores.gather(-1, order), 0.0)
        pooled = F.max_pool1d(ordered[:, None, :], KERNEL, stride=1, padding=KERNEL // 2)[:, 0]
        return torch.zeros_like(scores).scatter(-1, order, pooled)

    def _prune_layer(self, row: int, layer: int, count: int, ranges, keep: int, scores: torch.Tensor | None,
                     policy: str) -> int:
        if count == 0:
            return 0
        pos = self._positions(row, layer, count)
        inside = self._in_ranges(pos, ranges)
        kept_inside = torch.zeros_like(inside)
        if keep > 0:
            if scores is None:  # every head holds at most keep entries of the ranges: all stay
                kept_inside = inside
            else:
                ranked = torch.where(inside, scores[:, :count], -float("inf"))
                order = ranked.sort(dim=-1, descending=True, stable=True).indices[:, :keep]
                kept_inside = torch.zeros_like(inside).scatter(-1, order, True) & inside
        keep_mask = (~inside & (pos >= 0)) | kept_inside
        removed = int((inside & ~kept_inside).sum())
        keep_slots(self.engine.manager, row, layer, keep_mask)
        return removed
