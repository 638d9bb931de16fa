"""H2O's accumulation: add a step's attention probabilities to H2O's persistent scores.

``scores`` is pool-shaped slot metadata ``[num_pages, kv_heads, page_size]`` fp32 (it moves with its
token on compaction). Every query of the step adds the softmax probability (fp32) it gives each slot
of the view; for GQA the probabilities of a KV head's query group are averaged, so one score unit is
one query's worth of attention, as in MHA H2O.

Two ops with the same result:

* ``sparsecompile::h2o_accumulate``: computes each query's softmax normaliser itself (one extra read
  of the keys);
* ``sparsecompile::h2o_accumulate_lse``: takes the normaliser from the attention that just ran over
  the same view (``lse [batch, q_heads, tokens]`` fp32, natural-log log-sum-exp of the scaled logits
  over the slots the query sees, ``-inf`` where it sees none) and reads the keys once.

* ``sparsecompile::h2o_accumulate_logits`` (decode): takes the logits too (``paged_attention_logits``'
  by-product, ``[batch, q_heads, span]``) and reads no key at all: 16 bytes a (KV head, slot) for a group of 4
  instead of the key's 256.

Each pool slot must appear at most once in the view (true of every view the CacheManager builds for an
eviction method: a sequence's slot lists never repeat a slot and no two sequences share one), so the
CUDA kernel updates each score with a plain read-add-write, no atomics.
"""

from __future__ import annotations

import torch

from .attention_mass import attention_lse_triton, attention_mass_triton, triton
from .attention_mass_reference import SUM, TO_POOL, attention_mass_reference
from .library import define_op
from .pool import view_slots
from .tiles import FP_FUSION

if triton is not None:
    import triton.language as tl

    from .tiles import view_rows


def h2o_accumulate_reference(scores: torch.Tensor, query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor,
                             index: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int,
                             scale: float, sliding_window: int, lse: torch.Tensor | None = None) -> None:
    """Torch reference.

    Args:
        scores: ``[num_pages, kv_heads, page_size]`` fp32, updated in place.
        query: ``[batch, q_heads, tokens, head_dim]`` the step's queries (RoPE applied).
        k_pool, pos_pool: the pool; index, lengths: the view the queries attended (``[batch, kv_heads, ...]``).
        q_positions: ``[batch, tokens]`` logical positions (-1 for padding queries, which add nothing).
        lse: ``[batch, q_heads, tokens]`` the queries' log-sum-exp (None: computed here).
    """
    kv_heads = k_pool.shape[1]
    mass, slots, valid = attention_mass_reference(query, k_pool, pos_pool, index, lengths, q_positions, block_size,
                                                  scale, sliding_window, lse=lse)
    batch = mass.shape[0]
    mass = mass.view(batch, kv_heads, -1, mass.shape[-1]).mean(2)  # [batch, kv_heads, span]
    page_size = scores.shape[2]
    head = torch.arange(kv_heads, device=slots.device)[None, :, None].expand_as(slots)
    s = slots[valid]
    scores.index_put_((s // page_size, head[valid], s % page_size), mass[valid], accumulate=True)


def h2o_accumulate_lse_reference(scores: torch.Tensor, query: torch.Tensor, k_pool: torch.Tensor,
                                 pos_pool: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor,
                                 q_positions: torch.Tensor, lse: torch.Tensor, block_size: int, scale: float,
                                 sliding_window: int) -> None:
    """Torch reference of ``h2o_accumulate_lse`` (arguments as :func:`h2o_accumulate_reference`)."""
    h2o_accumulate_reference(scores, query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                             sliding_window, lse=lse)


def h2o_accumulate_lse_triton(scores: torch.Tensor, query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor,
                              index: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor, lse: torch.Tensor,
                              block_size: int, scale: float, sliding_window: int,
                              mass_config: dict | None = None) -> None:
    """Triton launch with the semantics of :func:`h2o_accumulate_lse_reference` (``scores`` contiguous)."""
    group = query.shape[1] // k_pool.shape[1]
    attention_mass_triton(scores, query, k_pool, pos_pool, index, lengths, q_positions, lse, block_size, scale,
                          sliding_window, SUM, TO_POOL, weight=1.0 / group, config=mass_config)


def h2o_accumulate_triton(scores: torch.Tensor, query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor,
                          index: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int,
                          scale: float, sliding_window: int, lse_config: dict | None = None,
                          mass_config: dict | None = None) -> None:
    """Triton launch with the semantics of :func:`h2o_accumulate_reference`: the lse pass, then the mass pass."""
    lse = attention_lse_triton(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                               sliding_window, config=lse_config)
    h2o_accumulate_lse_triton(scores, query, k_pool, pos_pool, index, lengths, q_positions, lse, block_size, scale,
                              sliding_window, mass_config=mass_config)


def h2o_accumulate_logits_reference(scores: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                                    index: torch.Tensor, lengths: torch.Tensor, block_size: int) -> None:
    """Torch reference of ``h2o_accumulate_logits``: the same update as :func:`h2o_accumulate_reference` for one
    decode query per sequence, from the attention's own logits.

    Args:
        scores: ``[num_pages, kv_heads, page_size]`` fp32, updated in place.
        logits: ``[batch, q_heads, span]`` fp32 scaled logits per view position, ``-inf`` where unseen.
        lse: ``[batch, q_heads, 1]`` fp32 (``-inf`` for a query that sees nothing).
        index, lengths: the view (``span = entries * block_size``).
    """
    batch, q_heads, span = logits.shape
    kv_heads = index.shape[1]
    shift = lse.reshape(batch, q_heads, 1).float()
    shift = torch.where(shift.isneginf(), torch.zeros_like(shift), shift)  # its logits are all -inf: adds 0
    mass = torch.exp(logits.float() - shift).reshape(batch, kv_heads, -1, span).mean(2)  # [batch, kv_heads, span]
    slots, valid = view_slots(index, lengths, block_size)
    page_size = scores.shape[2]
    head = torch.arange(kv_heads, device=slots.device)[None, :, None].expand_as(slots)
    s = slots[valid]
    scores.index_put_((s // page_size, head[valid], s % page_size), mass[valid], accumulate=True)


if triton is not None:

    @triton.jit
    def _accumulate_logits_kernel(SCORES, LOGITS, LSE, INDEX, LENGTHS, stride_ib, stride_ih, stride_lb, stride_lh,
                                  span, weight, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                                  BLOCK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
        """One program: BLOCK_S list positions of one (sequence, kv_head); each score is read, added to and written
        by this program alone (a view never names a slot twice)."""
        pid_bh = tl.program_id(0)
        b = pid_bh // KV_HEADS
        h = pid_bh % KV_HEADS
        start = tl.program_id(1) * BLOCK_S
        length = tl.load(LENGTHS + b * stride_lb + h * stride_lh)
        if start < length:
            base, _, jmask = view_rows(INDEX + b * stride_ib + h * stride_ih, start, length, h, KV_HEADS, PAGE, BLOCK,
                                       1, BLOCK_S)
            g = tl.arange(0, BLOCK_G)
            gmask = g < GROUP
            rows = pid_bh * GROUP + g  # the group's q heads: (b * KV_HEADS + h) * GROUP + g
            lse = tl.load(LSE + rows, mask=gmask, other=0.0)
            shift = tl.where(lse == float("-inf"), 0.0, lse)
            j = start + tl.arange(0, BLOCK_S)
            logit = tl.load(LOGITS + rows.to(tl.int64)[:, None] * span + j[None, :],
                            mask=gmask[:, None] & jmask[None, :], other=float("-inf"))
            mass = tl.sum(tl.exp(logit - shift[:, None]), 0) * weight
            old = tl.load(SCORES + base, mask=jmask, other=0.0)
            tl.store(SCORES + base, old + mass, mask=jmask)


def h2o_accumulate_logits_triton(scores: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, index: torch.Tensor,
                                 lengths: torch.Tensor, block_size: int) -> None:
    """Triton launch with the semantics of :func:`h2o_accumulate_logits_reference` (``scores``, ``logits`` and
    ``lse`` contiguous, as the ops that make them return them)."""
    batch, q_heads, span = logits.shape
    kv_heads, page_size = scores.shape[1], scores.shape[2]
    group = q_heads // kv_heads
    if index.stride(2) != 1:
        index = index.contiguous()
    if span == 0 or batch == 0:
        return
    block_s = 256  # whole pages per program (view_rows' page path) for power-of-two pages up to 256 slots
    _accumulate_logits_kernel[(batch * kv_heads, triton.cdiv(span, block_s))](
        scores, logits, lse, index, lengths, index.stride(0), index.stride(1), lengths.stride(0), lengths.stride(1),
        span, 1.0 / group, KV_HEADS=kv_heads, GROUP=group, PAGE=page_size, BLOCK=block_size,
        BLOCK_G=max(2, triton.next_power_of_2(group)), BLOCK_S=block_s, num_warps=4,
        **FP_FUSION,
    )


def _fake_logits(scores, logits, lse, index, lengths, block_size) -> None:
    return None


def _fake(scores, query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window) -> None:
    return None


def _fake_lse(scores, query, k_pool, pos_pool, index, lengths, q_positions, lse, block_size, scale,
              sliding_window) -> None:
    return None


h2o_accumulate = define_op(
    "h2o_accumulate(Tensor(a!) scores, Tensor query, Tensor k_pool, Tensor pos_pool, Tensor index, Tensor lengths, "
    "Tensor q_positions, int block_size, float scale, int sliding_window) -> ()",
    cpu=h2o_accumulate_reference,
    cuda=h2o_accumulate_triton if triton is not None else None,
    fake=_fake,
)

h2o_accumulate_lse = define_op(
    "h2o_accumulate_lse(Tensor(a!) score, Tensor query, Tensor k_pool, Tensor pos_pool, Tensor index, "
    "Tensor lengths, Tensor q_positions, Tensor lse, int block_size, float scale, int sliding_window) -> ()",
    cpu=h2o_accumulate_lse_reference,
    cuda=h2o_accumulate_lse_triton if triton is not None else None,
    fake=_fake_lse,
)

#: Decode: the update of ``h2o_accumulate`` from the logits and log-sum-exp the attention wrote
#: (``paged_attention_logits``), without reading the keys.
h2o_accumulate_logits = define_op(
    "h2o_accumulate_logits(Tensor(a!) scores, Tensor logits, Tensor lse, Tensor index, Tensor lengths, "
    "int block_size) -> ()",
    cpu=h2o_accumulate_logits_reference,
    cuda=h2o_accumulate_logits_triton if triton is not None else None,
    fake=_fake_logits,
)
