"""AttentionView and Selection: what a layer's attention reads, and how a method asks for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionView:
    """The payload an attention kernel reads for one layer of one batch.

    Attributes:
        k_pool, v_pool: ``[num_pages, kv_heads, page_size, head_dim]`` (the whole pool; read in place).
        pos_pool: ``[num_pages, kv_heads, page_size]`` int32 logical positions (-1 = empty slot).
        index: ``[batch, kv_heads, entries]`` int32: page ids when ``block_size == page_size``, global slot
            ids when ``block_size == 1``.
        lengths: ``[batch, kv_heads]`` int32 number of slots read (``<= entries * block_size``).
        block_size: slots covered by one entry of ``index``.
        quant: quantized storage read in place (a KIVI decode view, ``runtime/kivi.py``: ``k_pool / v_pool`` are
            None and ``quant.decode_attention`` attends); None for full-precision views.
        pool_pages: ``[view pages]`` int64, for a view over pages of its own (a storage format's prefill view
            materialises its rows in full precision, ``KiviStorage``): the pool page each of them stands for. A hook
            that writes slot metadata through the view's ``index`` maps pages through it (None: ``index`` names
            pool pages).
    """

    k_pool: torch.Tensor | None
    v_pool: torch.Tensor | None
    pos_pool: torch.Tensor
    index: torch.Tensor
    lengths: torch.Tensor
    block_size: int
    quant: Any = None
    pool_pages: torch.Tensor | None = None

    @property
    def slots_read(self) -> torch.Tensor:
        """``[batch, kv_heads]`` slots the attention reads (a quantized view's selection may read fewer than
        ``lengths``)."""
        return self.lengths if self.quant is None else self.quant.slots_read(self)


@dataclass
class SlotSelection:
    """Token-granular logical selection: read these row-local slot indices only.

    Attributes:
        slots: ``[batch, kv_heads, k]`` int64 row-local slot indices (``0 <= s < resident slots``).
        counts: ``[batch, kv_heads]`` how many leading entries of ``slots`` are used.
    """

    slots: torch.Tensor
    counts: torch.Tensor


@dataclass
class PageSelection:
    """Page-granular logical selection: read these row-local page numbers only.

    Attributes:
        pages: ``[batch, kv_heads, k]`` int64 row-local page numbers, the partially filled last page last.
        tokens: ``[batch, kv_heads]`` slots covered (full pages except the last).
    """

    pages: torch.Tensor
    tokens: torch.Tensor

    def pool_pages(self, table: torch.Tensor) -> torch.Tensor:
        """The pool pages of :attr:`pages` through the block-table rows ``table [batch, max_pages]``: ``[batch,
        kv_heads, k]`` int32 (padding entries name the row's first page)."""
        heads = self.pages.shape[1]
        return torch.gather(table[:, None, :].expand(-1, heads, -1), 2, self.pages.clamp(min=0)).to(torch.int32)


Selection = SlotSelection | PageSelection | None
