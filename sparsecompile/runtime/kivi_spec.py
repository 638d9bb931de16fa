"""``KiviSpec``: the options of the ``kivi`` storage format and the slot arithmetic that the host and the device share
(which leading slots of a list are quantized, what a slot costs). The storage itself is ``kivi.py``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass(frozen=True)
class KiviSpec:
    """KIVI storage options (validated by the method config, ``methods/kivi.py``)."""

    bits: int = 2
    group_size: int = 32
    residual: int = 128
    scale_dtype: torch.dtype | None = None  # None: "auto" (:meth:`for_model_dtype`)
    #: Set by a method that keeps every token (``kivi``, ``quest+kivi``; not a user option): a list's quantized slots
    #: are then its oldest tokens, none of them empty, all before the step's queries (positions grow with slots, as
    #: ``generate()`` and the serving engine give them), and decode attention without a sliding window reads no
    #: positions for them (``kivi_decode_attention``'s ``dense_history``).
    dense_history: bool = False

    def for_model_dtype(self, dtype: torch.dtype) -> KiviSpec:
        """The spec with "auto" scales resolved: the model's dtype when it is float16 or bfloat16 (HF QuantizedCache
        keeps its scales in the compute dtype; the decode kernel then dequantizes with no conversion), else
        float16 (KIVI's)."""
        if self.scale_dtype is not None:
            return self
        return replace(self, scale_dtype=dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16)

    @property
    def ring(self) -> int:
        """Residual capacity per ``(row, layer)``: between steps it holds at most ``R + G - 1`` slots, plus one
        decode token."""
        return self.residual + self.group_size

    def page_size(self, requested: int) -> int:
        """Pages hold whole key groups: ``max(page_size, group_size)`` (both powers of two)."""
        return max(requested, self.group_size)

    def quantized(self, count):
        """``Q(count)``: leading slots stored quantized (int, numpy array or tensor)."""
        R, G = self.residual, self.group_size
        if isinstance(count, torch.Tensor):
            return (count - R).clamp(min=0) // G * G
        return np.maximum(np.asarray(count) - R, 0) // G * G

    def slot_bytes(self, head_dim: int, dtype: torch.dtype, count: int) -> int:
        """K/V bytes one KV head of a ``(row, layer)`` holding ``count`` slots uses: codes, scales and zeros of its
        quantized slots, full-precision residual (positions not counted, as for the dense pool)."""
        q = int(self.quantized(count))
        s = 2  # float16 or bfloat16 scales and zeros
        e = torch.empty((), dtype=dtype).element_size()
        codes = 2 * head_dim * self.bits // 8  # K and V codes per slot
        value_meta = 2 * (head_dim // self.group_size) * s  # scale + zero per slot and channel group
        key_meta = 2 * head_dim * s  # scale + zero per key group and channel
        return q * (codes + value_meta) + (q // self.group_size) * key_meta + (count - q) * 2 * head_dim * e
