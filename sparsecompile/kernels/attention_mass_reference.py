"""Torch references of the attention-mass ops (``attention_mass.py``'s kernels): the softmax probability each slot of
an AttentionView receives from a set of queries, with :func:`.pool.visibility`'s mask, in fp32, queries in blocks
to bound memory. They run the ops on CPU and are what the Triton kernels are tested against.
"""

from __future__ import annotations

import torch

from .pool import gather_slots, used_view_slots, visibility

# Above this many fp32 logits the reference processes queries in blocks to bound memory.
_REFERENCE_ELEMENTS = 1 << 24

# Reductions over (group heads, queries) and where the result goes (constexprs of the mass kernel).
SUM, MAX = 0, 1
TO_POOL, TO_HEAD, TO_KV_HEAD = 0, 1, 2


def _logit_blocks(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window):
    """Yield ``(start, stop, logits)`` per block of queries, ``logits [batch, kv_heads, group, t, span]`` fp32
    (``-inf`` where invisible) over the view's first ``span`` slots, those up to the last one any query of the
    block sees (a causal prefill's early queries see only the first keys: about half the work); the first item
    is ``(slots, valid)`` of the used view."""
    batch, q_heads, queries, head_dim = query.shape
    kv_heads = k_pool.shape[1]
    slots, valid = used_view_slots(index, lengths, block_size)
    yield slots, valid
    keys_t = gather_slots(k_pool, slots).float().transpose(-1, -2)[:, :, None]  # [batch, kv_heads, 1, dim, slots]
    kpos = gather_slots(pos_pool, slots)
    q = query.float().reshape(batch, kv_heads, q_heads // kv_heads, queries, head_dim)
    step = max(1, _REFERENCE_ELEMENTS // max(1, batch * q_heads * slots.shape[-1]))
    for start in range(0, queries, step):
        stop = min(queries, start + step)
        mask = visibility(kpos, valid, q_positions[:, start:stop], sliding_window)[:, :, None]
        seen = mask.flatten(0, -2).any(0).nonzero()
        span = int(seen[-1]) + 1 if len(seen) else 0
        logits = (q[:, :, :, start:stop] @ keys_t[..., :span]).mul_(scale)
        yield start, stop, logits.masked_fill_(~mask[..., :span], float("-inf"))


def attention_lse_reference(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                            lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                            sliding_window: int) -> torch.Tensor:
    """``[batch, q_heads, queries]`` fp32: log-sum-exp of each query's scaled logits over the slots it sees
    (``-inf`` where it sees none). Arguments as :func:`attention_mass_reference`."""
    batch, q_heads, queries, _ = query.shape
    blocks = _logit_blocks(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window)
    next(blocks)
    lse = torch.empty(batch, q_heads, queries, dtype=torch.float32, device=query.device)
    for start, stop, logits in blocks:
        lse[:, :, start:stop] = torch.logsumexp(logits, -1).reshape(batch, q_heads, stop - start)  # -inf if empty
    return lse


def attention_mass_reference(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                             lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                             sliding_window: int, lse: torch.Tensor | None = None,
                             reduce: int = SUM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference.

    Args:
        query: ``[batch, q_heads, queries, head_dim]`` (RoPE applied).
        k_pool: ``[num_pages, kv_heads, page_size, head_dim]``; pos_pool ``[num_pages, kv_heads, page_size]``.
        index, lengths: the view (see :func:`paged_attention.view_slots`).
        q_positions: ``[batch, queries]`` logical positions (-1: the query is padding and contributes nothing).
        lse: ``[batch, q_heads, queries]`` each query's log-sum-exp (None: computed here, i.e. the softmax).
        reduce: ``SUM`` or ``MAX`` over the queries.
    Returns:
        ``mass [batch, q_heads, span]`` fp32 (per query head, the probability each of the first ``span`` view
        slots received, summed or maximised over the queries), and the view's ``slots, valid [batch, kv_heads, span]``.
    """
    batch, q_heads = query.shape[:2]
    kv_heads = k_pool.shape[1]
    blocks = _logit_blocks(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window)
    slots, valid = next(blocks)
    mass = torch.zeros(batch, kv_heads, q_heads // kv_heads, slots.shape[-1], dtype=torch.float32,
                       device=query.device)
    for start, stop, logits in blocks:  # logits: this block's own tensor, -inf where not visible
        span = logits.shape[-1]
        if span == 0:  # no query of the block sees a slot
            continue
        if lse is None:
            probs = _softmax_(logits)
        else:
            norm = lse[:, :, start:stop].float().reshape(logits.shape[:-1])
            probs = logits.sub_(_finite(norm)[..., None]).exp_()
        if reduce == SUM:
            mass[..., :span] += probs.sum(3)
        else:
            mass[..., :span] = torch.maximum(mass[..., :span], probs.amax(3))
    return mass.reshape(batch, q_heads, -1), slots, valid


def _finite(norm: torch.Tensor) -> torch.Tensor:
    """A row that sees nothing has all logits and its normaliser at -inf: subtracting 0 instead keeps its
    probabilities at exp(-inf) = 0 (-inf - -inf would be nan)."""
    return norm.masked_fill(torch.isneginf(norm), 0.0)


def _softmax_(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, in place (the CPU reference's largest cost was computing the log-sum-exp, then
    the probabilities from it, in separate passes with temporaries); rows that see nothing give zeros."""
    probs = logits.sub_(_finite(logits.amax(-1, keepdim=True))).exp_()
    return probs.div_(probs.sum(-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny))


def view_scores_reference(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                          lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                          sliding_window: int, reduce: int, target: int) -> torch.Tensor:
    """Mass per view column over the whole view capacity: ``[batch, heads, entries * block_size]`` fp32, 0 past the
    used slots; ``heads`` is q_heads for ``TO_HEAD``, kv_heads for ``TO_KV_HEAD`` (also reduced over the group)."""
    batch, q_heads = query.shape[:2]
    kv_heads = k_pool.shape[1]
    mass, _, _ = attention_mass_reference(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                                          sliding_window, reduce=reduce)
    if target == TO_KV_HEAD:
        mass = mass.view(batch, kv_heads, q_heads // kv_heads, -1)
        mass = mass.amax(2) if reduce == MAX else mass.sum(2)
    width = index.shape[-1] * block_size
    out = torch.zeros(batch, mass.shape[1], width, dtype=torch.float32, device=query.device)
    span = min(width, mass.shape[-1])
    out[..., :span] = mass[..., :span]
    return out
