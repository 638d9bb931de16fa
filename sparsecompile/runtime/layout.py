"""KVLayout: the shape of one model's KV state (layers, KV heads, head dim, page size, dtype, storage format)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kivi_spec import KiviSpec


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV state of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    device: torch.device
    storage: KiviSpec | None = None  # None: dense K/V in ``dtype``

    @property
    def bytes_per_slot_head(self) -> int:
        """Bytes of K plus V for one token of one KV head."""
        return 2 * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
