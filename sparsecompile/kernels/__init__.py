"""Kernels: torch.library ops with a torch reference on CPU and a Triton kernel on CUDA."""

from .attention_mass_reference import attention_lse_reference
from .dense_attention import dense_attention
from .evict_lowest import evict_lowest, evict_lowest_reference
from .h2o_scores import (
    h2o_accumulate,
    h2o_accumulate_logits,
    h2o_accumulate_logits_reference,
    h2o_accumulate_lse,
    h2o_accumulate_lse_reference,
    h2o_accumulate_reference,
)
from .kivi_attention import kivi_decode_attention, kivi_decode_attention_logits
from .kivi_quant import kivi_dequantize, kivi_quantize, kivi_quantize_reference
from .kivi_reference import kivi_decode_attention_reference
from .kv_write import kv_write, kv_write_bounds, kv_write_reference
from .kvzip_scores import kvzip_scores, kvzip_scores_reference
from .omnikv_scores import omnikv_scores, omnikv_scores_reference
from .paged_attention import paged_attention, paged_attention_reference
from .paged_attention_variants import (
    decode_logits_reference,
    paged_attention_logits,
    paged_attention_lse,
    paged_attention_token_max,
)
from .pool import gather_slots, view_slots, visibility
from .prefill_attention import paged_prefill_attention, prefill_attention_reference
from .quest_scores import quest_page_scores, quest_page_scores_reference
from .slot_move import move_slots, move_slots_reference
from .snapkv_scores import snapkv_scores, snapkv_scores_reference
from .topk_select import topk_select, topk_select_reference

__all__ = [
    "dense_attention", "gather_slots", "kv_write", "kv_write_bounds", "kv_write_reference", "paged_attention",
    "paged_attention_lse", "paged_attention_reference", "paged_attention_token_max",
    "paged_prefill_attention", "prefill_attention_reference", "view_slots", "visibility",
    "omnikv_scores", "omnikv_scores_reference", "quest_page_scores",
    "quest_page_scores_reference", "topk_select", "topk_select_reference",
    "h2o_accumulate", "h2o_accumulate_reference", "h2o_accumulate_lse", "h2o_accumulate_lse_reference",
    "attention_lse_reference", "kvzip_scores", "kvzip_scores_reference", "snapkv_scores", "snapkv_scores_reference",
    "kivi_decode_attention", "kivi_decode_attention_logits", "kivi_decode_attention_reference", "kivi_dequantize",
    "kivi_quantize",
    "kivi_quantize_reference", "evict_lowest", "evict_lowest_reference", "move_slots", "move_slots_reference",
    "decode_logits_reference", "paged_attention_logits", "h2o_accumulate_logits", "h2o_accumulate_logits_reference",
]
