"""The paged attention ops that also return statistics of the attention they compute (one Triton launch,
:func:`.paged_attention.paged_attention_triton`, with a switch each; torch references beside them):

* ``sparsecompile::paged_attention_lse``: each query's log-sum-exp (methods that score decode steps with it);
* ``sparsecompile::paged_attention_token_max``: per view position the largest raw logit over a KV head's query
  heads (OmniKV's filter layers);
* ``sparsecompile::paged_attention_logits``: each query's log-sum-exp and scaled logits per view position (H2O).

Visibility and the view's entries are :mod:`.paged_attention`'s.
"""

from __future__ import annotations

import torch

from .attention_mass_reference import attention_lse_reference
from .library import define_op
from .paged_attention import check_one_query, paged_attention_reference, paged_attention_triton
from .pool import gather_slots, view_slots, visibility

try:
    import triton
except ImportError:  # pragma: no cover
    triton = None


def _group_logits(query: torch.Tensor, k_pool: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode query per sequence: raw logits ``q . k`` per view position ``[batch, kv_heads, group, span]`` fp32
    (each query head against its KV head's keys), and the view's ``slots, valid`` (:func:`view_slots`)."""
    check_one_query(query)
    batch, q_heads, _, head_dim = query.shape
    kv_heads = k_pool.shape[1]
    slots, valid = view_slots(index, lengths, block_size)
    keys = gather_slots(k_pool, slots).float()  # [batch, kv_heads, span, head_dim]
    q = query[:, :, 0].float().reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    return torch.einsum("bhgd,bhsd->bhgs", q, keys), slots, valid


def token_max_reference(query: torch.Tensor, k_pool: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor,
                        block_size: int) -> torch.Tensor:
    """Per view position, the largest raw logit ``q_h . k`` (no scale, no visibility mask) over the query heads of
    the position's KV head, for one decode query per sequence: ``query [batch, q_heads, 1, head_dim]`` ->
    ``[batch, kv_heads, entries * block_size]`` fp32, ``-inf`` at positions past ``lengths``."""
    logits, _, valid = _group_logits(query, k_pool, index, lengths, block_size)
    logits = logits.amax(2)
    return torch.where(valid, logits, torch.full_like(logits, float("-inf")))


def paged_attention_token_max_reference(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size,
                                        scale, sliding_window) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention_reference` plus :func:`token_max_reference`."""
    check_one_query(query)
    out = paged_attention_reference(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                    sliding_window)
    return out, token_max_reference(query, k_pool, index, lengths, block_size)


def _triton_token_max(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                      sliding_window):
    return paged_attention_triton(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                  sliding_window, with_token_max=True)


def _fake_token_max(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window):
    check_one_query(query)
    batch, q_heads, queries, head_dim = query.shape
    return (query.new_empty(batch, queries, q_heads, head_dim),
            query.new_empty(batch, k_pool.shape[1], index.shape[2] * block_size, dtype=torch.float32))


def decode_logits_reference(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                            lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                            sliding_window: int) -> torch.Tensor:
    """One decode query per sequence: ``[batch, q_heads, entries * block_size]`` fp32, per view position the query's
    scaled logit ``scale * q . k`` against its KV head's key, ``-inf`` where the query does not see the slot (past
    the list included), so that ``exp(logits - lse)`` is the softmax probability the attention gave the slot."""
    logits, slots, valid = _group_logits(query, k_pool, index, lengths, block_size)
    seen = visibility(gather_slots(pos_pool, slots), valid, q_positions, sliding_window)  # [batch, kv_heads, 1, span]
    return (logits * scale).masked_fill(~seen, float("-inf")).flatten(1, 2)


def paged_attention_logits_reference(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                     sliding_window) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`paged_attention_lse_reference` plus :func:`decode_logits_reference` (one query per sequence)."""
    logits = decode_logits_reference(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                     sliding_window)
    out, lse = paged_attention_lse_reference(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size,
                                             scale, sliding_window)
    return out, lse, logits


def _triton_logits(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window):
    return paged_attention_triton(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                  sliding_window, with_logits=True)


def _fake_logits(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window):
    check_one_query(query)
    out, lse = _fake_lse(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                         sliding_window)
    return out, lse, query.new_empty(query.shape[0], query.shape[1], index.shape[2] * block_size, dtype=torch.float32)


def paged_attention_lse_reference(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                  sliding_window) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention_reference` plus each query's log-sum-exp ``[batch, q_heads, queries]`` fp32."""
    out = paged_attention_reference(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                    sliding_window)
    return out, attention_lse_reference(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                        sliding_window)


def _triton_lse(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window):
    return paged_attention_triton(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                  sliding_window, with_lse=True)


def _fake_lse(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window):
    batch, q_heads, queries, head_dim = query.shape
    return query.new_empty(batch, queries, q_heads, head_dim), query.new_empty(batch, q_heads, queries,
                                                                                dtype=torch.float32)


#: The same attention, also returning each query's log-sum-exp (methods that score decode steps with it: H2O).
paged_attention_lse = define_op(
    "paged_attention_lse(Tensor query, Tensor k_pool, Tensor v_pool, Tensor pos_pool, Tensor index, "
    "Tensor lengths, Tensor q_positions, int block_size, float scale, int sliding_window) -> (Tensor out, Tensor lse)",
    cpu=paged_attention_lse_reference,
    cuda=_triton_lse if triton is not None else None,
    fake=_fake_lse,
)

#: The same attention for one decode query per sequence, also returning per view position the largest raw logit
#: over each KV head's query heads (OmniKV's filter layers score their prompt with it, without a second key pass).
paged_attention_token_max = define_op(
    "paged_attention_token_max(Tensor query, Tensor k_pool, Tensor v_pool, Tensor pos_pool, Tensor index, "
    "Tensor lengths, Tensor q_positions, int block_size, float scale, int sliding_window) -> "
    "(Tensor out, Tensor token_max)",
    cpu=paged_attention_token_max_reference,
    cuda=_triton_token_max if triton is not None else None,
    fake=_fake_token_max,
)

#: The same attention for one decode query per sequence, also returning each query's log-sum-exp and its scaled logits
#: per view position (``[batch, q_heads, span]``, -inf where unseen):
#: a method that scores decode steps by attention probabilities (H2O) reads them instead of the keys a second time.
paged_attention_logits = define_op(
    "paged_attention_logits(Tensor query, Tensor k_pool, Tensor v_pool, Tensor pos_pool, Tensor index, "
    "Tensor lengths, Tensor q_positions, int block_size, float scale, int sliding_window) -> "
    "(Tensor out, Tensor lse, Tensor logits)",
    cpu=paged_attention_logits_reference,
    cuda=_triton_logits if triton is not None else None,
    fake=_fake_logits,
)
