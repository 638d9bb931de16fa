"""``h2o``: heavy hitters by accumulated attention plus a recent window (Zhang et al., https://arxiv.org/abs/2306.14048).

Every forward adds, per KV head, the softmax probability (fp32) each query of the step gives each
visible resident entry to that entry's persistent score (slot metadata, so it moves with its entry and
is freed with it): prefill chunks re-read the keys with the attention's log-sum-exp
(``h2o_accumulate_lse``), decode steps take the probabilities from the logits the attention wrote
(``h2o_accumulate_logits``). New entries start at zero and receive their own column
sums in the step that writes them. Then a layer holding more than its budget keeps its ``recent``
newest tokens plus the ``budget - recent`` highest-scoring older ones (paper: ``R_i`` from
``A_i = R_{i-1} ∪ {i}``): after every prefill chunk (chunk-wise eviction during chunked prefill)
and, during decode, once a layer holds ``budget + interval`` entries (``interval=1``: every step,
the original real-drop H2O). Scores of retained entries persist.

Where the references disagree (methods.md §5) we follow the original H2O real-drop cache (per head,
every step, raw sums of probabilities, no ``1/(n-j)`` normalisation as in kvpress'
ObservedAttention), with these choices:

* GQA: the probabilities of a KV head's query group are *averaged* (one score unit = one query's
  attention, as in MHA H2O); selection is per KV head.
* ``recent`` defaults to half the budget: the paper's equal split between heavy hitters and recent
  tokens (also SparseEngine's ``h2o_recent_ratio=0.5``).
* With ``ratio``, the budget during prefill is ``int(ratio * tokens so far)``, so it grows chunk by
  chunk to ``int(ratio * n)``, which then holds during decode.

Raw sums favour entries that many queries saw: a needle that only the question attends to needs a far
larger budget than with SnapKV (SmolLM2, 3K-token passkey: SnapKV answers at 512, H2O at 1536; see
``tests/test_eviction_smollm2.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import MethodConfigError, option
from ..kernels import gather_slots, h2o_accumulate, h2o_accumulate_logits, h2o_accumulate_lse
from ..runtime.contract import LayerContext, PrefillMode
from ..runtime.host import to_device
from .eviction import EvictionConfig, EvictionRuntime, check_positive
from .eviction_ops import INF, recent_mask, resident
from .registry import register_method

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager
    from ..runtime.step import StepState

SCORE = "h2o_score"


@dataclass
class H2OConfig(EvictionConfig):
    """Options of ``h2o``.

    Attributes:
        budget / ratio: tokens kept per layer and KV head (heavy hitters + recent) / fraction of the prompt.
        recent: newest tokens always kept (None: half the budget).
        interval: during decode, evict once a layer holds ``budget + interval`` tokens (1: every step).
    """

    recent: int | None = option(None, "newest tokens always kept (default: half the budget)")
    interval: int = option(1, "during decode, evict once a layer holds budget + interval tokens (1: every step)")

    method = "h2o"

    def protected(self) -> tuple[int, str]:
        recent = self.recent or 0
        return max(1, recent), f"recent={recent} (the protected recent window)"

    def validate(self) -> None:
        if self.recent is not None and (isinstance(self.recent, bool) or not isinstance(self.recent, int)
                                        or self.recent < 0):
            raise MethodConfigError(f"h2o: recent must be an integer >= 0 (or None for half the budget), "
                                    f"got {self.recent!r}")
        check_positive(self.method, interval=self.interval)
        super().validate()


@register_method
class H2ORuntime(EvictionRuntime):
    name = "h2o"
    config_class = H2OConfig
    config: H2OConfig
    chunk_eviction = True
    uses_prefill_lse = True  # prefill: one pass over the keys to accumulate attention mass, with the attention's lse
    uses_decode_lse = uses_decode_logits = True  # decode: no key pass, the attention's logits and lse
    # 8192-token chunks: the prompt's attention reads at most budget + chunk keys (128K on the H200: 7.9 s against
    # 38.7 s for the whole prompt, whose mass accumulation is compute-bound over all query-key pairs)
    default_prefill_chunk = 8192
    prefill_mode = PrefillMode.ALIGNED  # what is kept depends on where chunks end: the same chunks as generate()
    victim_values = SCORE  # decode (interval 1): the lowest score outside the recent window, one op per layer

    @property
    def decode_interval(self) -> int:
        return self.config.interval

    def recent_tokens(self, budget: int) -> int:
        return self.config.recent if self.config.recent is not None else budget // 2

    def rewrites_resident(self, manager: CacheManager, step: StepState) -> np.ndarray:
        return np.ones(len(step.row_ids), dtype=bool)  # every step adds attention mass to every visible slot

    def setup(self, manager: CacheManager) -> None:
        super().setup(manager)
        manager.register_slot_metadata(SCORE, torch.float32, 0.0)

    def on_kv_loaded(self, manager: CacheManager, rows: list[int], prompt_lengths: list[int]) -> None:
        """Loaded entries start with score zero (no attention was observed for them)."""
        super().on_kv_loaded(manager, rows, prompt_lengths)
        rows_t = to_device(np.asarray(rows, dtype=np.int64), manager.layout.device)
        counts = manager.slot_count_array(rows)
        for layer in range(self.model.num_layers):
            slots, valid, _ = resident(manager, layer, rows_t, int(counts[:, layer].max()))
            scores = manager.slot_metadata[SCORE]
            manager.scatter_slots(scores, torch.where(valid, slots, -1), torch.zeros_like(slots, dtype=scores.dtype))

    def on_attention_end(self, ctx: LayerContext, out: torch.Tensor) -> None:
        score = ctx.manager.slot_metadata[SCORE]
        if ctx.view.pool_pages is None:
            self._accumulate(ctx, score)
            return
        # a view over pages of its own (KIVI's prefill, h2o+kivi): accumulate in their shape, then into the pool's
        local = torch.zeros(ctx.view.pos_pool.shape, dtype=score.dtype, device=score.device)
        self._accumulate(ctx, local)
        score.index_add_(0, ctx.view.pool_pages, local)  # a page named twice is a padding page: it adds zeros

    @staticmethod
    def _accumulate(ctx: LayerContext, score: torch.Tensor) -> None:
        """Add this step's attention probabilities to ``score`` (slot metadata in the view's page layout)."""
        v = ctx.view
        if ctx.logits is not None:  # decode: the probabilities from the attention's own logits
            h2o_accumulate_logits(score, ctx.logits, ctx.lse, v.index, v.lengths, v.block_size)
        elif ctx.lse is not None:  # prefill: the attention's normaliser, one pass over the keys
            h2o_accumulate_lse(score, ctx.query, v.k_pool, v.pos_pool, v.index, v.lengths, ctx.step.positions,
                               ctx.lse, v.block_size, ctx.scale, ctx.sliding_window)
        else:
            h2o_accumulate(score, ctx.query, v.k_pool, v.pos_pool, v.index, v.lengths, ctx.step.positions,
                           v.block_size, ctx.scale, ctx.sliding_window)

    def _scores(self, manager: CacheManager, slots: torch.Tensor, pos: torch.Tensor,
                recent: torch.Tensor) -> torch.Tensor:
        score = gather_slots(manager.slot_metadata[SCORE], slots)
        return torch.where(recent_mask(pos, recent), INF, score)

    def prefill_scores(self, manager: CacheManager, step: StepState, layer: int, width: int) -> torch.Tensor:
        slots, _, pos = resident(manager, layer, step.rows, width)
        return self._scores(manager, slots, pos, self.step_recent())

    def decode_scores(self, manager: CacheManager, step: StepState, layer: int, slots: torch.Tensor,
                      pos: torch.Tensor) -> torch.Tensor:
        return self._scores(manager, slots, pos, self.decode_recent(step.rows))
