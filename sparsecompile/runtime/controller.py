"""SparseController: drives one method's lifecycle over a model's forwards.

The controller knows nothing of transformers: it is handed an ``inner_forward(input_ids, position_ids,
inputs_embeds, logits_to_keep) -> logits`` callable (the unpatched model forward) and calls it once
per prefill chunk or decode step, with :attr:`step` set so that every attention layer reaches
:meth:`attend`. Host work (page allocation, slot counts) happens around those calls; the per-layer
work inside :meth:`attend` and the method's ``finish_step`` are device-only, so a decode step
(forward + finish) compiles to one graph and, on CUDA, replays as a CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from ..config import EngineConfig
from ..kernels import (
    paged_attention,
    paged_attention_logits,
    paged_attention_lse,
    paged_attention_token_max,
    paged_prefill_attention,
)
from .allocator import OutOfPages
from .cache_manager import CacheManager, KVLayout
from .contract import LayerContext, PrefillMode, SparseMethod
from .decode_unit import DecodeUnit
from .mixed import MixedForward, MixedStep
from .mixed_graphs import CudaGraphRecorder, MixedReplays, Recorder
from .prompt_forward import InnerForward, PromptForward
from .row_ops import RowOperations, capacity_bucket, table_width
from .step import StepState


class SparseController(DecodeUnit, RowOperations, PromptForward, MixedForward):
    """Lifecycle driver for one patched model (see module docstring; decode steps are ``decode_unit.py``'s)."""

    def __init__(self, runtime: SparseMethod, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, config: EngineConfig) -> None:
        self.runtime = runtime
        self.config = config
        storage = runtime.storage  # the method's storage format (None: dense); it may need larger pages
        if storage is not None:  # its "auto" options follow the model's dtype
            storage = runtime.storage = storage.for_model_dtype(dtype)
        page_size = config.page_size if storage is None else storage.page_size(config.page_size)
        self.layout = KVLayout(num_layers, num_kv_heads, head_dim, page_size, dtype, torch.device(device), storage)
        self.oracle = runtime.memory_oracle(self.layout)
        self.oracle.prefill_chunk = self.prefill_chunk
        self.manager: CacheManager | None = None
        self.step: StepState | MixedStep | None = None
        self.attention_calls = 0  # eager calls of attend(); the capture check reads it
        # (thread id, description) of the one thread that may drive this pool (a server's engine thread), or None
        self.owner: tuple[int, str] | None = None
        self._decode_steps: dict[int, StepState] = {}  # by batch size
        self._compiled_decode: Callable | None = None
        self._compiled_shapes: set[tuple] = set()  # (batch, max_seqs, variant) compiled so far (pages: dynamic dims)
        #: the decode variant every step runs instead of the method's choice (None: the method chooses): an artifact's
        #: program runs the default one (install_decode_step), warmup() compiles each (forced_variant)
        self.variant_override: str | None = None
        self._step_compiles = False  # the decode unit compiles at a new shape (an installed program does not)
        self.decode_backend: Callable | None = None  # the capture backend of the compiled decode, if any
        self._pad_row: int | None = None  # see _padding_row
        self._pad_manager: CacheManager | None = None
        self._watched: list[tuple[torch.Tensor, tuple]] = []  # see watch_parameters

    @property
    def prefill_chunk(self) -> int | None:
        """Prompt tokens per prefill forward (None: the whole prompt in one forward), from the engine option and
        the method's prefill mode: the one place that decides it (``generate()``, the scheduler and the memory
        oracle all read it)."""
        chunk = self.config.prefill_chunk_size
        if chunk is None:
            chunk = self.runtime.default_prefill_chunk
        if self.runtime.prefill_mode is PrefillMode.WHOLE or not chunk:
            return None
        return chunk

    # ------------------------------------------------------------------ capacity (host)
    def reserve(self, batch: int, prompt_len: int, max_new_tokens: int) -> None:
        """Make sure ``batch`` more sequences of this size fit (grow the pool when it is auto-sized)."""
        per_seq = self.oracle.peak_slots_per_layer(prompt_len, max_new_tokens)
        pages = batch * self.oracle.pages_for(per_seq)
        widest = math.ceil(max(per_seq) / self.layout.page_size)
        if self.manager is None:
            num_pages = self.config.num_pages or capacity_bucket(pages)
            width = table_width(capacity_bucket(widest))
            self.manager = CacheManager(self.layout, num_pages, capacity_bucket(batch), width)
            self.runtime.setup(self.manager)
            return
        m = self.manager
        rows = len(m.live_rows) + batch
        free = m.allocator.num_free
        short = pages > free and self.config.num_pages is None
        if rows > m.max_seqs or widest > m.max_pages_per_seq or short:
            grown = capacity_bucket(m.num_pages - free + pages) if short else m.num_pages
            m.grow(grown, capacity_bucket(rows), table_width(capacity_bucket(widest)))
            self._decode_steps.clear()

    def configure_pool(self, num_pages: int) -> None:
        """Fix the pool at ``num_pages`` pages (no automatic growth); an idle pool is dropped and rebuilt lazily."""
        if self.manager is not None and self.manager.live_rows:
            raise RuntimeError("cannot resize the KV pool while sequences are live")
        self.config.num_pages = num_pages
        self.manager = None
        self._decode_steps.clear()

    def build_pool(self, num_pages: int, max_seqs: int, max_pages_per_seq: int) -> CacheManager:
        """Create a fixed pool now (the serving engine sizes it from a memory budget; no automatic growth)."""
        if self.manager is not None and self.manager.live_rows:
            raise RuntimeError("cannot rebuild the KV pool while sequences are live")
        self.config.num_pages = num_pages
        self.manager = CacheManager(self.layout, num_pages, max_seqs, max_pages_per_seq)
        self.runtime.setup(self.manager)
        self._decode_steps.clear()
        return self.manager

    def add_sequences(self, batch: int) -> list[int]:
        assert self.manager is not None, "reserve() first"
        return [self.manager.add_sequence() for _ in range(batch)]

    def _make_room(self, step: StepState) -> np.ndarray:
        """Grow every layer's slot count by the step's new tokens (allocating pages; auto-grow the pool).

        Returns the slot counts ``[batch, layers]`` before the step."""
        m = self.manager
        before = m.slot_count_array(step.row_ids)
        counts = before + np.asarray(step.num_new_host, dtype=np.int64)[:, None]
        try:
            m.ensure_slots(step.row_ids, counts)
        except OutOfPages:
            if self.config.num_pages is not None:
                raise
            need = m.pages_needed(step.row_ids, counts)
            widest = math.ceil(int(counts.max()) / self.layout.page_size)
            m.grow(capacity_bucket(m.allocator.num_used + need), m.max_seqs, table_width(capacity_bucket(widest)))
            self._decode_steps.clear()
            m.ensure_slots(step.row_ids, counts)
        return before

    # ------------------------------------------------------------------ the per-layer path (device)
    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               sliding_window: int) -> torch.Tensor:
        """Write new K/V, select, build the view, attend, run the layer hooks.

        Returns ``out [batch, tokens, q_heads, head_dim]``.
        """
        step = self.step
        if step is None or self.manager is None:
            raise RuntimeError("sparsecompile attention ran outside a sparsecompile step: call the patched model "
                               "(model(...) or model.generate(...)), not its submodules")
        if not torch.compiler.is_compiling():
            self.attention_calls += 1
        layout = self.manager.layout
        if key.shape[1] != layout.num_kv_heads or key.shape[-1] != layout.head_dim:  # static shapes: free when traced
            raise RuntimeError(f"layer {layer}'s attention gave K/V of {key.shape[1]} heads x {key.shape[-1]} dims, "
                               f"but the model's config describes {layout.num_kv_heads} x {layout.head_dim} "
                               "(num_key_value_heads / head_dim): the KV pool is sized from the config; fix the "
                               "config to match the model")
        if isinstance(step, MixedStep):  # each part through its own step, its own plan swapped in
            outs = []
            for part, q, k, v in zip(step.parts, step.split(query), step.split(key), step.split(value)):
                step.load(part)
                outs.append(self._attend(part, layer, q, k, v, scale, sliding_window))
                step.save(part)
            return step.join(outs)
        return self._attend(step, layer, query, key, value, scale, sliding_window)

    def _attend(self, step: StepState, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scale: float, sliding_window: int) -> torch.Tensor:
        m, rt = self.manager, self.runtime
        new_slots = m.write(layer, step, key, value)
        ctx = LayerContext(layer, step, m, query, key, value, new_slots, scale, sliding_window)
        if step.scorer is not None:  # a scoring pass: dense over everything resident, the scorer instead of hooks
            ctx.view = view = m.build_view(layer, step, None)
            known = step.dense_lengths[layer] if step.dense_lengths else -1
            out, _ = paged_prefill_attention(query, view.k_pool, view.v_pool, view.pos_pool, view.index, view.lengths,
                                             step.positions, step.num_new, view.block_size, scale, sliding_window,
                                             known, False)
            step.scorer.on_attention_end(ctx, out)
            return out
        selection = rt.build_prefill_selection(ctx) if step.is_prefill else rt.build_decode_selection(ctx)
        ctx.view = view = m.build_view(layer, step, selection, None if step.is_prefill else rt.decode_slot_bound())
        if step.is_prefill:  # tensor-core prefill paths; the log-sum-exp serves methods that score with it
            known = step.dense_lengths[layer] if step.dense_lengths and selection is None else -1
            out, lse = paged_prefill_attention(query, view.k_pool, view.v_pool, view.pos_pool, view.index,
                                               view.lengths, step.positions, step.num_new, view.block_size, scale,
                                               sliding_window, known, rt.uses_prefill_lse, key, value)
            ctx.lse = lse if rt.uses_prefill_lse else None
        elif view.quant is not None:  # quantized storage read in place (KIVI pages + residual)
            if rt.uses_decode_logits:
                out, ctx.lse, ctx.logits = view.quant.decode_attention_logits(query, view, step.positions, scale,
                                                                              sliding_window)
            else:
                out = view.quant.decode_attention(query, view, step.positions, scale, sliding_window)
        elif rt.wants_token_max(ctx):
            out, ctx.token_max = paged_attention_token_max(query, view.k_pool, view.v_pool, view.pos_pool, view.index,
                                                           view.lengths, step.positions, view.block_size, scale,
                                                           sliding_window)
        elif rt.uses_decode_logits:
            out, ctx.lse, ctx.logits = paged_attention_logits(query, view.k_pool, view.v_pool, view.pos_pool,
                                                              view.index, view.lengths, step.positions,
                                                              view.block_size, scale, sliding_window)
        elif rt.uses_decode_lse:
            out, ctx.lse = paged_attention_lse(query, view.k_pool, view.v_pool, view.pos_pool, view.index,
                                               view.lengths, step.positions, view.block_size, scale, sliding_window)
        else:
            out = paged_attention(query, view.k_pool, view.v_pool, view.pos_pool, view.index, view.lengths,
                                  step.positions, view.block_size, scale, sliding_window)
        rt.on_attention_end(ctx, out)
        rt.on_layer_end(ctx)
        m.end_layer(layer, step)  # the storage format commits the layer's new tokens (KIVI: what left the residual)
        return out

    # ------------------------------------------------------------------ steps (host around device)
    def _run(self, inner: InnerForward, step: StepState, **inputs) -> torch.Tensor:
        """One forward with ``step`` active, then the method's device-side finish (the compiled unit)."""
        self.step = step
        try:
            logits = inner(**inputs)
            self.runtime.finish_step(self.manager, step)
        finally:
            self.step = None
        return logits

    def _begin(self, step: StepState) -> None:
        m = self.manager
        before = self._make_room(step)
        if step.is_prefill:
            step.dense_lengths = self._dense_lengths(step, before)
        else:
            step.variant = self.variant_override
            if step.variant is None:
                step.variant = self.runtime.decode_variant(m, step)
        self.runtime.prepare_step(m, step)
        if m.has_shared_rows(step.row_ids):  # copy-on-write: the pages this step writes must be the row's own
            rewrites = self.runtime.rewrites_resident(m, step)
            from_slots = np.where(rewrites[:, None], 0, before)
            short = m.pages_to_copy(step.row_ids, from_slots) - m.allocator.num_free
            if short > 0 and self.config.num_pages is None:
                m.grow(capacity_bucket(m.num_pages + short), m.max_seqs, m.max_pages_per_seq)
                self._decode_steps.clear()
            m.prepare_writes(step.row_ids, from_slots)
        m.flush()

    def _dense_lengths(self, step: StepState, before: np.ndarray) -> list[int]:
        """Per layer, the slots every row reads this step when that is the same for all rows, none is padded and no
        row has empty slots; else -1 (see :attr:`StepState.dense_lengths`)."""
        layers = self.layout.num_layers
        if min(step.num_new_host) != step.num_tokens or self.manager.has_holes(step.row_ids):
            return [-1] * layers
        counts = before + step.num_tokens
        uniform = (counts == counts[:1]).all(axis=0)
        return [int(c) if u else -1 for c, u in zip(counts[0], uniform)]

    def _end(self, step: StepState) -> None:
        self.runtime.commit_step(self.manager, step)

    def replay_mixed_steps(self, decode_sizes: list[int], max_tokens: int, recorder: Recorder | None = None) -> bool:
        """Record mixed steps per shape and replay them (``runtime/mixed_graphs.py``) when the method allows it
        (``replays_mixed_steps``, dense storage); returns whether it does. ``recorder``: CUDA graphs by default."""
        rt = self.runtime
        if not rt.replays_mixed_steps or rt.storage is not None or rt.needs_prompt_tokens:
            self.mixed_replays = None
            return False
        self.mixed_replays = MixedReplays(self, decode_sizes, max_tokens, recorder or CudaGraphRecorder())
        return True

    def close(self) -> None:
        """Drop the KV pool, the step state and the compiled decode (``restore()``). What then still refers to the pool
        is garbage in reference cycles (the compiled step and this controller; dynamo's trace leftovers), which
        ``restore()`` collects: otherwise the pool outlived it, and a model optimized again right after allocated
        its pool beside the old one (on the H200 a 64 GiB pool at 32K x 16 ran the next method out of memory)."""
        self.manager = self._pad_manager = self._pad_row = self.step = None
        self._decode_steps.clear()
        self._compiled_decode = None
        self._compiled_shapes.clear()
        self.mixed_replays = None
        self._watched = []
