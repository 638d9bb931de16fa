"""Replayed mixed steps: a serving step's one forward (decode tokens and prompt chunks) recorded once per shape as
a CUDA graph, then replayed.

Why: a mixed step's forward runs op by op. On the H200 a step carrying a 512-token prompt chunk beside 8 decodes of
the 8B shape took 44-72 ms, eager or with its decoder layers compiled (``results/serving_burst_h200_regional*``),
against 15-18 ms of GPU work (the replay's, timed): host time per op, per layer, per part (the attention callbacks
above all). Replayed, the forward costs one launch, and running streams keep close to their decode-step pace while a
burst of prompts is prefilled (issue #13, item 6).

What a graph is recorded for (:class:`MixedShape`, the canonical layout): the decode part padded to one of the
engine's decode graph sizes with the controller's padding row (no token written, nothing read), all chunk groups
merged into one group of ``chunk_rows`` (a power of two) x ``chunk_width`` (:func:`width_bucket`) tokens,
left-padded, extra rows being the padding row, and one kept logit per row (its last position). Steps outside
it run the ordinary way (:meth:`~.mixed.MixedForward.mixed`): chunks asking for every position's logits (prompt
logprobs), more padding than real tokens, more tokens than the step budget, a decode batch above every graph size.

The first step of a shape runs eagerly in that layout (its warm-up: Triton and inductor compiles, cuBLAS plans, all
outside a capture); the second is recorded and replayed; later ones replay. Inside a recorded step nothing may read
host data that changes between steps: the parts are persistent :class:`StepState` objects refilled in place before
each step, their slot plans are computed inside the recorded forward (from the device tables, at replay time) and
the prefill parts' dense lengths stay off (the Triton prefill kernel reads the lengths on the device). The
method vouches for the rest (``SparseMethod.replays_mixed_steps``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .cache_manager import CacheManager
from .compilation import logger
from .contract import SparseMethod
from .layout import KVLayout
from .mixed import ChunkGroup, MixedStep
from .step import StepState

#: the narrowest chunk width recorded
MIN_WIDTH = 16
#: shapes recorded at most (each keeps its static inputs and a graph); further shapes run eagerly
MAX_SHAPES = 32

Replay = Callable[[], torch.Tensor]


class StepDriver(Protocol):
    """What replays need of the controller (``SparseController``, which owns them): its method, pool and layout, the
    active step, and the host hooks around a step's forward."""

    runtime: SparseMethod
    manager: CacheManager
    layout: KVLayout
    step: Any

    def _begin(self, step: StepState) -> None: ...

    def _end_parts(self, inner: Callable[..., torch.Tensor], mixed: MixedStep) -> None: ...

    def _padding_row(self) -> int: ...


class Recorder(Protocol):
    """Records a step's forward: ``record(fn)`` returns a callable that repeats it over the same tensors."""

    def record(self, fn: Replay) -> Replay: ...


class CudaGraphRecorder:
    """CUDA graphs sharing one memory pool (steps replay one at a time, as the engine's steps run)."""

    def __init__(self) -> None:
        self._pool = None

    def record(self, fn: Replay) -> Replay:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread-local: another thread's CUDA calls (a server's) must not invalidate the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class RerunRecorder:
    """The CPU stand-in of :class:`CudaGraphRecorder` (tests): a replay reruns the recorded function, which reads only
    the shape's persistent inputs, so an input not refilled for the new step shows as wrong tokens."""

    def record(self, fn: Replay) -> Replay:
        return fn


@dataclass(frozen=True)
class MixedShape:
    """The canonical layout of a replayed step: padded decode rows (0: none), chunk rows and their width."""

    decode_batch: int
    chunk_rows: int
    chunk_width: int

    @property
    def tokens(self) -> int:
        return self.decode_batch + self.chunk_rows * self.chunk_width


class _Recorded:
    """One shape's persistent inputs (parts, token ids, positions, kept positions) and its replays by variant."""

    def __init__(self, shape: MixedShape, owners: list, device: torch.device) -> None:
        self.shape = shape
        parts = []
        if shape.decode_batch:
            parts.append(_blank(shape.decode_batch, 1, False, device))
        parts.append(_blank(shape.chunk_rows, shape.chunk_width, True, device))
        self.mixed = MixedStep(parts, owners)
        self.input_ids = torch.zeros(1, shape.tokens, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, shape.tokens, dtype=torch.long, device=device)
        W, first = shape.chunk_width, shape.decode_batch
        last = first + torch.arange(shape.chunk_rows) * W + W - 1  # each chunk row's last position
        self.keep = torch.cat([torch.arange(first), last]).to(device)
        self.replays: dict[str, Replay] = {}
        self.warmed: set[str] = set()


def width_bucket(width: int) -> int:
    """The recorded chunk width for chunks of ``width`` tokens: the next of 16, 24, 32, 48, 64, 96, 128, 192, ...
    (two shapes an octave; at most a third of a row is padding)."""
    width = max(width, MIN_WIDTH)
    power = 1 << (width - 1).bit_length()
    return power * 3 // 4 if width <= power * 3 // 4 else power


def _blank(batch: int, width: int, is_prefill: bool, device: torch.device) -> StepState:
    return StepState.build([0] * batch, torch.zeros(batch, width, dtype=torch.bool),
                           torch.zeros(batch, width, dtype=torch.long), is_prefill=is_prefill, is_last_chunk=False,
                           device=device)


class MixedReplays:
    """The recorded mixed steps of one controller (see the module docstring).

    ``decode_sizes``: the decode batch sizes a step's decode part may be padded to (the engine's graph sizes);
    ``max_tokens``: the most tokens (padding included) a recorded step may carry (the engine's step budget).
    """

    def __init__(self, controller: StepDriver, decode_sizes: list[int], max_tokens: int,
                 recorder: Recorder) -> None:
        self.controller = controller
        self.decode_sizes = sorted(decode_sizes)
        self.max_tokens = max_tokens
        self.recorder = recorder
        self._recorded: dict[MixedShape, _Recorded] = {}
        self._signature: tuple = ()
        self.replayed = 0  # steps replayed so far (tests and benchmarks read it)
        self.disabled = False  # a forward could not be recorded: every step runs the ordinary way

    def shape_of(self, decode_batch: int, groups: list[ChunkGroup]) -> MixedShape | None:
        """The canonical shape of a step, or None when it runs the ordinary way (see the module docstring)."""
        if self.disabled or not groups or any(keep == 0 for *_, keep, _ in groups):
            return None
        padded_decode = 0
        if decode_batch:
            padded_decode = next((s for s in self.decode_sizes if s >= decode_batch), 0)
            if not padded_decode:
                return None
        rows = sum(len(g[0]) for g in groups)
        width = width_bucket(max(g[1].shape[1] for g in groups))
        shape = MixedShape(padded_decode, 1 << (rows - 1).bit_length(), width)
        real = sum(int(g[3].sum()) for g in groups)
        if shape.chunk_rows * width > 2 * real + MIN_WIDTH or shape.tokens > self.max_tokens + padded_decode:
            return None
        if shape not in self._recorded and len(self._recorded) >= MAX_SHAPES:
            return None
        return shape

    def run(self, inner: Callable[..., torch.Tensor], decode_rows: list[int], decode_ids: torch.Tensor | None,
            decode_positions: torch.Tensor | None,
            groups: list[ChunkGroup]) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
        """:meth:`~.mixed.MixedForward.mixed`'s step in the canonical layout: eagerly the first time its shape comes,
        recorded the second, replayed after. None when the step does not fit a canonical shape (the caller runs it
        the ordinary way). Same arguments and results as ``mixed``."""
        shape = self.shape_of(len(decode_rows), groups)
        if shape is None:
            return None
        c = self.controller
        entry = self._recorded.get(shape)
        if entry is None:
            entry = self._recorded[shape] = _Recorded(shape, [c.runtime, c.manager.storage], c.layout.device)
        self._fill(entry, decode_rows, decode_ids, decode_positions, groups)
        parts, mixed = entry.mixed.parts, entry.mixed
        for part in parts:
            c._begin(part)
            part.dense_lengths = None  # the sync-free Triton path, whatever the lengths (a graph reads them anew)
            mixed.save(part)
        if self._stale(inner):  # after the parts' begin, which may have grown the pool: nothing recorded holds
            self._recorded = {shape: entry}
            entry.replays.clear()
            entry.warmed.clear()
        variant = parts[0].variant if shape.decode_batch else ""
        forward = self._forward(inner, entry)
        replay = entry.replays.get(variant)
        if replay is None and variant in entry.warmed:
            replay = self._record(forward, entry, variant)
        if replay is None:  # the warm-up (compiles and plans happen here, never inside a capture), or no graph
            logits = forward()
            entry.warmed.add(variant)
        else:
            logits = replay()
            self.replayed += 1
        logits = logits[0]
        c._end_parts(inner, mixed)
        n, first = len(decode_rows), shape.decode_batch
        decode = logits[:n, None].clone() if n else None
        out, row = [], first
        for rows, *_ in groups:
            out.append(logits[row:row + len(rows), None].clone())
            row += len(rows)
        return decode, out

    def _record(self, forward: Replay, entry: _Recorded, variant: str) -> Replay | None:
        """Record ``forward``; a forward that cannot be recorded (an op that syncs with the host, say) leaves replays
        off for good (None: this step, and every later one, runs op by op), with a warning naming the reason."""
        try:
            replay = entry.replays[variant] = self.recorder.record(forward)
            return replay
        except RuntimeError as err:
            logger.warning("a mixed step could not be recorded as a CUDA graph (%s); mixed steps of %s run op by op "
                           "from now on", str(err).splitlines()[0], self.controller.runtime.name)
            self.controller.step = None
            self.disabled = True
            return None

    def _forward(self, inner: Callable[..., torch.Tensor], entry: _Recorded) -> Replay:
        """The step's device work over the entry's persistent inputs: the forward, then each part's finish."""
        c, mixed = self.controller, entry.mixed

        def forward() -> torch.Tensor:
            c.step = mixed
            for part in mixed.parts:  # every layer's slots and tables in a dozen ops on the device, inside the graph
                part.slot_plan = c.manager.slot_plan(part)  # (mapped per layer and part, ~15 kernels each: ~1,000)
            try:
                logits = inner(input_ids=entry.input_ids, inputs_embeds=None, position_ids=entry.position_ids,
                               logits_to_keep=entry.keep)
                if logits.shape[1] != entry.keep.numel():  # a model without logits_to_keep: every position
                    logits = logits[:, entry.keep]
                mixed.finish(c.runtime, c.manager)
            finally:
                c.step = None
                for part in mixed.parts:
                    part.slot_plan = None
            return logits

        return forward

    def _fill(self, entry: _Recorded, decode_rows: list[int], decode_ids: torch.Tensor | None,
              decode_positions: torch.Tensor | None, groups: list[ChunkGroup]) -> None:
        """Lay the step out in the entry's persistent inputs (host data copied in place)."""
        shape, pad = entry.shape, self.controller._padding_row()
        ids, positions = [], []
        parts = iter(entry.mixed.parts)
        if shape.decode_batch:
            n, extra = len(decode_rows), shape.decode_batch - len(decode_rows)
            valid = (torch.arange(shape.decode_batch) < n)[:, None]
            pos = torch.cat([decode_positions.reshape(-1).cpu(), torch.zeros(extra, dtype=torch.long)])[:, None]
            next(parts).refill(decode_rows + [pad] * extra, valid, pos, [False] * shape.decode_batch)
            ids.append(torch.cat([decode_ids.reshape(-1).cpu(), torch.zeros(extra, dtype=torch.long)]))
            positions.append(pos.reshape(-1))
        W, R = shape.chunk_width, shape.chunk_rows
        chunk_ids = torch.zeros(R, W, dtype=torch.long)
        chunk_pos = torch.zeros(R, W, dtype=torch.long)
        chunk_valid = torch.zeros(R, W, dtype=torch.bool)
        rows, finals, r = [], [], 0
        for g_rows, g_ids, g_pos, g_valid, _, g_final in groups:  # each group is left-padded: align the right ends
            width = g_ids.shape[1]
            chunk_ids[r:r + len(g_rows), W - width:] = g_ids
            chunk_pos[r:r + len(g_rows), W - width:] = g_pos
            chunk_valid[r:r + len(g_rows), W - width:] = g_valid
            rows += g_rows
            finals += list(g_final)
            r += len(g_rows)
        chunk_pos = torch.where(chunk_valid, chunk_pos, 0)
        next(parts).refill(rows + [pad] * (R - r), chunk_valid, chunk_pos, finals + [False] * (R - r))
        ids.append(chunk_ids.reshape(-1))
        positions.append(chunk_pos.reshape(-1))
        entry.input_ids.copy_(torch.cat(ids)[None], non_blocking=True)
        entry.position_ids.copy_(torch.cat(positions)[None], non_blocking=True)

    def _stale(self, inner: Callable[..., torch.Tensor]) -> bool:
        """Whether the recorded steps are stale: they hold the addresses of the pool and tables, and of the method's
        per-row buffers, so a new pool (growth, a rebuild) or another forward voids them. Method buffers are sized by
        the pool's rows, pages and table width (``grow_rows``), so those sizes stand for them."""
        m = self.controller.manager
        tensors = (m.k_pool, m.v_pool, m.pos_pool, m.block_table, m.lengths, *m.slot_metadata.values(),
                   *m.page_metadata.values())
        signature = (id(inner), id(m), m.num_pages, m.max_seqs, m.max_pages_per_seq,
                     *(t.data_ptr() if t is not None else 0 for t in tensors))
        stale, self._signature = signature != self._signature, signature
        return stale
