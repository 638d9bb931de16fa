"""The KIVI payload of a decode :class:`~.view.AttentionView`: the storage's pages and residual ring read in place by
``kivi_decode_attention`` (``kivi.py``'s :meth:`KiviStorage.view` builds it; its ``k_pool / v_pool`` are None)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.kivi_attention import kivi_decode_attention, kivi_decode_attention_logits
from .view import AttentionView


@dataclass
class QuantizedKV:
    """The KIVI payload of a decode :class:`AttentionView` (its ``k_pool / v_pool`` are None)."""

    tensors: tuple[torch.Tensor, ...]  # kcode, vcode, kscale, kzero, vscale, vzero
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    ring_rows: torch.Tensor  # [batch] ring row of each sequence for this layer
    quantized: torch.Tensor  # [batch] leading slots in pages
    dense_history: bool = False  # KiviSpec.dense_history: the quantized slots hold every oldest token, none empty
    #: a selection over the quantized slots (``KiviStorage.view`` with a PageSelection): the pages read, ``[batch,
    #: kv_heads, k]`` pool ids, and their slots ``[batch]``, in place of ``[0, quantized)``; the residual stays read
    quant_index: torch.Tensor | None = None
    quant_count: torch.Tensor | None = None

    def decode_attention(self, query: torch.Tensor, view: AttentionView, q_positions: torch.Tensor, scale: float,
                         sliding_window: int) -> torch.Tensor:
        return kivi_decode_attention(query, *self.tensors, view.pos_pool, self.ring_k, self.ring_v, self.ring_rows,
                                     view.index, view.lengths, self.quantized, q_positions, scale, sliding_window,
                                     self.dense_history, self.quant_index, self.quant_count)

    def slots_read(self, view: AttentionView) -> torch.Tensor:
        """``[batch, kv_heads]`` slots the attention reads: the selection's and the residual, or the whole list."""
        if self.quant_count is None:
            return view.lengths
        return view.lengths - (self.quantized - self.quant_count)[:, None].to(view.lengths.dtype)

    def decode_attention_logits(self, query: torch.Tensor, view: AttentionView, q_positions: torch.Tensor,
                                scale: float, sliding_window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The output plus each query's log-sum-exp ``[batch, q_heads, 1]`` and logits per view position ``[batch,
        q_heads, pages * P]`` (a method that scores decode steps by attention probabilities: H2O; not over a
        selection)."""
        if self.quant_index is not None:
            raise ValueError("kivi: a selection over the quantized slots has no per-slot logits")
        return kivi_decode_attention_logits(query, *self.tensors, view.pos_pool, self.ring_k, self.ring_v,
                                            self.ring_rows, view.index, view.lengths, self.quantized, q_positions,
                                            scale, sliding_window)
