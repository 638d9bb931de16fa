"""``snapkv``: keep the prompt entries the last prompt queries attend to (Li et al., https://arxiv.org/abs/2404.14469).

After the prompt's last chunk, each layer scores its prompt slots with the observation window (the
last ``window`` prompt queries, RoPE applied): softmax probabilities in fp32 over every visible key,
summed over the window queries (``snapkv_scores`` op), restricted to the ``n - window`` older slots,
pooled over neighbouring positions (``kernel``, ``pooling`` "max" or "avg" with zero padding counted,
i.e. ``count_include_pad``), then averaged over the query heads of each KV group. Each KV head keeps
its own top ``budget - window`` slots plus the window; decode only appends.

Where the references disagree (methods.md §5) we follow:

* defaults: SnapKV's LongBench configs (window 32, kernel 7, max pooling); budget counts the window and
  a prompt of at most ``budget`` tokens is not compressed (SnapKV / KVCache-Factory);
* GQA: selection per KV head with scores averaged over the group *after* pooling (kvpress; SnapKV and
  KVCache-Factory's default select per query head and store ``g`` times the KV);
* sum over window queries (SnapKV) rather than kvpress's mean: the ranking is the same;
* probabilities stay fp32 (the references cast back to the model dtype before summing).

Chunked prefill: the window queries of each layer are kept per row across chunks (the last chunk may
be shorter than the window), so the selection equals the one-forward result. The prompt is in slot
order when it is scored, so pooling over slots is pooling over positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..config import MethodConfigError, option
from ..kernels import snapkv_scores
from ..runtime.contract import LayerContext
from .eviction import EvictionConfig, EvictionRuntime, check_positive
from .eviction_ops import INF
from .registry import register_method

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager
    from ..runtime.model_info import ModelInfo
    from ..runtime.step import StepState


@dataclass
class SnapKVConfig(EvictionConfig):
    """Options of ``snapkv``.

    Attributes:
        budget / ratio: tokens kept per layer and KV head, window included / fraction of the prompt (exactly one).
        window: observation window (last prompt queries); always kept.
        kernel: pooling width (odd). pooling: "max" or "avg".
    """

    window: int = option(32, "observation window: the last prompt queries, always kept")
    kernel: int = option(7, "pooling width over neighbouring positions (odd)")
    pooling: str = option("max", "pooling of the window scores: max or avg")

    method = "snapkv"

    def protected(self) -> tuple[int, str]:
        return self.window, f"window={self.window} (the observation window is always kept; lower window)"

    def validate(self) -> None:
        check_positive(self.method, window=self.window, kernel=self.kernel)
        if self.kernel % 2 == 0:
            raise MethodConfigError(f"{self.method}: kernel must be odd (pooling is centred on each position), "
                                    f"got {self.kernel}")
        if self.pooling not in ("max", "avg"):
            raise MethodConfigError(f"{self.method}: pooling must be 'max' or 'avg', got {self.pooling!r}")
        super().validate()


@register_method
class SnapKVRuntime(EvictionRuntime):
    name = "snapkv"
    config_class = SnapKVConfig
    config: SnapKVConfig
    step_scoped = (*EvictionRuntime.step_scoped, "_pending")

    def __init__(self, config: SnapKVConfig, model: ModelInfo) -> None:
        super().__init__(config, model)
        # row -> (queries [layers, q_heads, window, head_dim], positions [layers, window]) while its prompt runs
        self._windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: dict[int, torch.Tensor] = {}  # layer -> pooled scores [batch, kv_heads, width] (last chunk)

    def prepare_step(self, manager: CacheManager, step: StepState) -> None:
        super().prepare_step(manager, step)
        self._pending = {}  # this step's own (several prefill steps may share a forward: step_scoped)

    def reset_rows(self, rows: list[int]) -> None:
        for row in rows:
            self._windows.pop(row, None)

    def fork_rows(self, manager: CacheManager, sources: list[int], forks: list[int]) -> None:
        super().fork_rows(manager, sources, forks)
        for source, fork in zip(sources, forks):  # a row forked mid-prompt keeps its observation window
            if source in self._windows:
                self._windows[fork] = tuple(t.clone() for t in self._windows[source])

    def on_attention_end(self, ctx: LayerContext, out: torch.Tensor) -> None:
        step, layer = ctx.step, ctx.layer
        if not step.is_prefill:
            return
        queries, positions = self._update_window(ctx)
        if step.is_last_chunk and self.evicts_layer(layer):
            v = ctx.view
            mass = snapkv_scores(queries, v.k_pool, v.pos_pool, v.index, v.lengths, positions, v.block_size,
                                 ctx.scale, ctx.sliding_window)
            self._pending[layer] = self._pooled(mass, self.step_counts(layer))

    def _update_window(self, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge this chunk's queries into each row's window; returns ``[batch, q_heads, w, d]``, ``[batch, w]``."""
        w, layer, rows = self.config.window, ctx.layer, ctx.step.row_ids
        _, q_heads, _, dim = ctx.query.shape
        for row in rows:
            if row not in self._windows:
                self._windows[row] = (ctx.query.new_zeros(self.model.num_layers, q_heads, w, dim),
                                      torch.full((self.model.num_layers, w), -1, dtype=torch.long,
                                                 device=ctx.query.device))
        # Padding is on the left, so a chunk's newest tokens are its last ones.
        cand_q = torch.cat([torch.stack([self._windows[r][0][layer] for r in rows]), ctx.query[:, :, -w:]], dim=2)
        cand_p = torch.cat([torch.stack([self._windows[r][1][layer] for r in rows]), ctx.step.positions[:, -w:]],
                           dim=1)
        top = cand_p.topk(w, dim=1).indices  # the w newest positions (-1 = no query yet)
        queries = cand_q.gather(2, top[:, None, :, None].expand(-1, q_heads, -1, dim))
        positions = cand_p.gather(1, top)
        for i, row in enumerate(rows):
            self._windows[row][0][layer] = queries[i]
            self._windows[row][1][layer] = positions[i]
        return queries, positions

    def _pooled(self, mass: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``mass [batch, q_heads, width]`` -> scores ``[batch, kv_heads, width]``: older slots pooled then averaged
        over the group, window slots +inf."""
        batch, q_heads, width = mass.shape
        older = (torch.arange(width, device=mass.device) < (counts - self.config.window)[:, None])[:, None, :]
        s = torch.where(older, mass, 0.0)  # zero padding past the older slots (probabilities are >= 0)
        k = self.config.kernel
        if self.config.pooling == "max":
            s = F.max_pool1d(s, k, stride=1, padding=k // 2)
        else:
            s = F.avg_pool1d(s, k, stride=1, padding=k // 2, count_include_pad=True)
        s = s.view(batch, self.model.num_kv_heads, q_heads // self.model.num_kv_heads, width).mean(2)
        return torch.where(older, s, INF)

    def prefill_scores(self, manager: CacheManager, step: StepState, layer: int, width: int) -> torch.Tensor:
        return self._pending.pop(layer)[..., :width]

    def commit_step(self, manager: CacheManager, step: StepState) -> None:
        super().commit_step(manager, step)
        if step.is_prefill and step.is_last_chunk:
            self.reset_rows([r for r, done in zip(step.row_ids, step.ends_prompt) if done])
            self._pending.clear()
