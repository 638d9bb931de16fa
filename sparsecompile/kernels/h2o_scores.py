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

Each pool slot must appear at most once in the view (true of every view the CacheManager builds for an
eviction method: a sequence's slot lists never repeat a slot and no two sequences share one), so the
CUDA kernel updates each score with a plain read-add-write, no atomics.
"""

from __future__ import annotations

import torch

from .attention_mass import SUM, TO_POOL, attention_lse_triton, attention_mass_reference, attention_mass_triton, triton
from .library import define_op


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
