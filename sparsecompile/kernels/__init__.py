"""Kernels: torch.library ops with a torch reference on CPU and a Triton kernel on CUDA."""

from .dense_attention import dense_attention
from .kv_write import kv_write, kv_write_reference
from .paged_attention import gather_slots, paged_attention, paged_attention_reference, view_slots, visibility

__all__ = [
    "dense_attention", "gather_slots", "kv_write", "kv_write_reference", "paged_attention", "paged_attention_reference",
    "view_slots", "visibility",
]
