"""Heavy hitters over KIVI storage (``h2o+kivi``): decode evicts one whole key group per KV head at a time.

H2O alone evicts, every decode step, the lowest-scoring token outside its recent window and moves the newest token
into its hole. Over KIVI pages either move would re-quantize a key group (keys share a scale and zero per channel
over ``G = group_size`` consecutive slots), and repeated re-quantization compounds the error. Here the unit of decode
eviction is the key group itself, so nothing is ever re-quantized:

* the prompt: H2O's chunks (its own prefill mode, the same chunks as ``h2o`` alone), its accumulation and its
  eviction after every chunk run in full precision: the kept tokens of a prompt whose chunks go on stay in a
  full-precision buffer (``KiviStorage.settle_chunk``), read by the next chunk's view, and are quantized once after
  the prompt's last chunk. The accumulation reads that view, whose pages are the storage's own
  (``AttentionView.pool_pages`` maps its scores back to the pool's slots). The held buffer (``budget + chunk``
  slots a layer, the model's dtype) lives outside the pool: the oracle's ``prompt_buffer_bytes`` counts it and the
  next chunk's buffer beside it (``prompt_copies = 2``);
* decode appends; the attention over pages and residual also writes its logits and log-sum-exp
  (``kivi_decode_attention_logits``), from which H2O's scores grow exactly as alone (the logits of quantized keys
  are those of their dequantized values);
* after a step, a ``(row, layer)`` holding ``budget + G`` slots gives up, in each KV head, the quantized group with the
  lowest *summed* score among the groups none of whose tokens is in the recent window (ties: the lowest group). The
  row's last quantized group moves whole into its slots and the residual's slots move down by ``G``
  (:meth:`SlotAccess.remove_groups`; every pair of a step in one set of eager ops, between compiled steps).
  Between steps a layer holds ``budget`` to ``budget + G - 1`` tokens (H2O: ``budget``);
* a group outside the recent window must always exist: ``budget >= max(recent, residual) + G`` (an explicit budget
  below it is refused with the reason; a ``ratio`` budget is raised to it). H2O's ``interval`` does not apply.

The group's score is the sum of its members' accumulated attention: removing the group loses exactly that much of the
attention mass H2O tracks, the quantity H2O minimises one token at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import MethodConfigError
from ..kernels import gather_slots
from ..runtime.host import to_device
from .eviction import POSITIONS, EvictionRuntime
from .eviction_ops import INF, resident
from .eviction_oracle import EvictionMemoryOracle

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager, KVLayout
    from ..runtime.contract import SparseMethod
    from ..runtime.memory_oracle import MemoryOracle
    from ..runtime.step import StepState


def evicts_by_group(policy: type[SparseMethod]) -> bool:
    """A policy whose decode eviction takes the lowest per-slot score (a slot metadata name) outside its protected
    tokens, scored from the decode attention's logits: over KIVI it evicts key groups (this module)."""
    return (issubclass(policy, EvictionRuntime) and policy.uses_decode_logits
            and policy.victim_values not in (None, POSITIONS))


class HeldChunksMixin:
    """Placed before :class:`~.kivi.KiviStorageMixin` (whose deferred steps are otherwise quantized when they end): a
    prompt's chunks stay in full precision until its last one (``KiviStorage.settle_chunk``)."""

    prompt_copies = 2  # the held chunks, and the next chunk's buffer while it runs

    def finish_deferred(self, manager: CacheManager, step: StepState) -> None:
        manager.storage.settle_chunk(step, [not done for done in step.ends_prompt])


class GroupEvictionMixin:
    """Mixed in between :class:`~.kivi.KiviStorageMixin` and a policy for which :func:`evicts_by_group` holds: the
    module docstring's group eviction."""

    def __init__(self, config, model) -> None:
        super().__init__(config, model)
        spec = config.kivi_spec()  # (KiviStorageMixin sets self.storage after this returns)
        self._group, self._residual = spec.group_size, spec.residual
        if getattr(config, "interval", 1) != 1:
            raise MethodConfigError(f"{self.name}: interval={config.interval} does not apply: decode evicts a whole "
                                    f"key group ({spec.group_size} tokens, group_size) once a layer holds budget + "
                                    "group_size tokens; leave interval at 1")
        if config.budget is not None and config.budget < self.group_floor(config.budget):
            floor = self.group_floor(config.budget)
            raise MethodConfigError(
                f"{self.name}: budget={config.budget} is below {floor}, the recent window "
                f"({self.recent_tokens(config.budget)}) or the residual ({spec.residual}), whichever is larger, plus "
                f"one key group ({spec.group_size}): decode evicts whole quantized groups outside the recent window; "
                f"pass budget >= {floor}, or a smaller recent / residual")

    @property
    def decode_interval(self) -> int:
        return 0  # the compiled decode step only appends; groups leave between steps (commit_step)

    def group_floor(self, budget: int) -> int:
        """The smallest decode budget for a row whose budget is ``budget``."""
        return max(self.recent_tokens(budget), self._residual) + self._group

    def raised_budget(self, budget: int) -> int:
        """``budget`` raised until it holds its own floor (the recent window may grow with it)."""
        while budget < self.group_floor(budget):
            budget = self.group_floor(budget)
        return budget

    def decode_slot_bound(self) -> int | None:
        if self.config.budget is None:
            return None
        return self.raised_budget(max(self.layer_budgets(1 << 40))) + self._group

    def memory_oracle(self, layout: KVLayout) -> MemoryOracle:
        return EvictionMemoryOracle(layout, lambda n: [min(n, b) for b in self.layer_budgets(n)],
                                    self.row_decode_budget, self._group, self.chunk_eviction)

    def row_decode_budget(self, prompt_len: int) -> int:
        return self.raised_budget(super().row_decode_budget(prompt_len))

    def commit_step(self, manager: CacheManager, step: StepState) -> None:
        super().commit_step(manager, step)
        if step.is_prefill:
            return
        G = self._group
        rows = np.asarray(step.row_ids, dtype=np.int64)
        counts = manager.slot_count_array(step.row_ids)
        over, layers = np.nonzero(counts >= self._decode_budget[rows][:, None] + G)
        if not len(over):
            return
        held = counts[over, layers]
        self._evict_groups(manager, step, layers, over, held)
        manager.truncate_many(rows[over], layers, held - G, reserve=held, storage_done=True)

    def _evict_groups(self, manager: CacheManager, step: StepState, layers: np.ndarray, at: np.ndarray,
                      counts: np.ndarray) -> None:
        """Device: pick each head's victim group in every ``(at[i], layers[i])`` pair (``at`` the step's batch
        entries, host ``counts`` slots each) and remove it; every pair in one set of ops (all layers of a row reach
        ``budget + G`` at the same step: one eager op sequence per layer cost ~125 small ops a layer)."""
        G, dev = self._group, manager.layout.device
        quantized = self.storage.quantized(counts)
        recent = [self.recent_tokens(int(self._decode_budget[r])) for r in np.asarray(step.row_ids)[at]]
        host = to_device(np.stack([at, layers, quantized, counts, recent]).astype(np.int64), dev)
        index, layer, quant, count, recent_t = host
        rows = step.rows[index]
        width = int(quantized.max())
        slots, _, pos = resident(manager, layer, rows, width)  # [n, kv_heads, width]
        heads = slots.shape[1]
        score = gather_slots(manager.slot_metadata[self.victim_values], slots).reshape(len(at), heads, -1, G).sum(-1)
        newest = step.positions[index, -1].long()  # this decode step's token
        in_recent = (pos.reshape(len(at), heads, -1, G) > (newest - recent_t)[:, None, None, None]).any(-1)
        unquantized = torch.arange(width // G, device=dev) * G >= quant[:, None, None]
        victims = torch.where(in_recent | unquantized, INF, score).argmin(-1)  # [n, kv_heads]
        manager.remove_groups(layer, rows, victims, quant, count, self._residual + G)
