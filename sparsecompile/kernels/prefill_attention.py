"""``sparsecompile::paged_prefill_attention``: prefill attention over the paged KV pool, with its log-sum-exp.

Same view and visibility semantics as :mod:`.paged_attention` (a key slot is visible to a query iff it is inside
``lengths``, holds a token, ``k_pos <= q_pos`` and, with a window ``w > 0``, ``k_pos > q_pos - w``); it also
returns ``lse [batch, q_heads, queries]`` fp32, the natural-log log-sum-exp of the scaled logits over the visible
keys (-inf, with a zero output, for a query that sees nothing); with ``want_lse=False`` the caller does not read
it (a path that has none leaves it undefined). ``known_length >= 0`` is the host's guarantee that every list of
the view holds exactly that many slots, no row is padded and no slot is empty (the CUDA dispatch then takes the
SDPA paths without a sync); -1: unknown. ``key, value [batch, kv_heads, queries, head_dim]``: the step's own new
K/V (already written to the pool), which a whole-prompt step reads directly instead of gathering it back.

Contract the fast paths rely on (a prefill step's view; the torch reference does not need it): in a page view
(``block_size == page_size``) the step's ``num_new[b]`` tokens are the last ``num_new[b]`` slots of every list of
row ``b``, in position order, queries left-padded (padding queries have position -1), and every earlier slot holds
an older token (position below every query of the step) or is empty (-1). All KV heads of a row read the same
number of slots. Slot-list views (``block_size == 1``) make no such assumption and are read whole.

CUDA implementations, chosen by :data:`CUDA_IMPL` (the benchmark ``benchmarks/prefill_attention.py`` compares them):

* ``"triton"`` (:func:`prefill_attention_triton`): FlashAttention-2 style over the page table, GQA heads packed
  into the query rows, causal block skipping. No host sync. Handles every case.
* ``"sdpa"`` (:func:`prefill_attention_sdpa`): gathers each list into a contiguous ``[B, Hkv, N, D]`` buffer and
  runs flash attention (lower-right causal, native GQA, log-sum-exp). Only valid when every row reads ``N``
  slots, has no padding, no window and no empty slot before its new tokens; it checks this on the device and
  reads the verdict and ``N`` with **one host sync per call**, then falls back to the Triton kernel if invalid.
  Static fallbacks (no sync): a window, a slot-list view, fp32. A caller that knows the answer from host state
  passes ``known_length`` and nothing syncs.
* ``"split"`` (:func:`prefill_attention_split`, not a :data:`CUDA_IMPL`: the dispatch takes it for host-vouched
  dense steps given the step's own K/V, see :data:`SPLIT`): cuDNN's causal attention over the step's own K/V and its
  unmasked attention over the gathered older slots, merged by their log-sum-exps.
* ``"flex"`` (:func:`prefill_attention_flex`): gathers the whole view capacity (``index.shape[-1] * block_size``
  slots, no sync) and runs FlexAttention with a position ``mask_mod`` and a block mask built on the device; exact
  in every case (padding, holes, windows). Compiled by dynamo (dynamic shapes after the first recompile).
"""

from __future__ import annotations

import logging

import torch

from .library import define_op
from .pool import gather_slots, view_slots
from .prefill_triton import (
    PREFILL_FP32_CONFIG,
    PREFILL_LARGE_CONFIG,
    PREFILL_SMALL_CONFIG,
    prefill_attention_reference,
    prefill_attention_triton,
    prefill_config,
)

try:
    import triton
except ImportError:  # pragma: no cover
    triton = None

#: CUDA implementation of the op: "triton", "sdpa" or "flex" (see the module docstring).
CUDA_IMPL = "triton"
#: True: host-vouched dense steps that need the log-sum-exp or follow a prefix take :func:`prefill_attention_split`
#: (cuDNN, two calls) where :func:`split_applicable`; False: gather + flash. On by measurement (H200, 2026-12-02,
#: ``benchmarks/results/prefill_attention_split_h200.jsonl``): chunk 2048 at 32K 2.15 ms against 3.85 for gather +
#: flash (496 against 276 TFLOP/s), at 128K 8.67 against 14.2 ms, H2O's 8192 chunk after 2048 kept 1.96 against
#: 2.98 ms; end to end, h2o's 32K prefill 1.48 s against 1.61 (``prefill_h200_split.jsonl``).
SPLIT = True


# ----------------------------------------------------------------------------------------- gather-based variants
def gather_view(pool: torch.Tensor, index: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    """The first ``n`` slots of every list of a view as ``[batch, kv_heads, n, *rest]`` (no sync).

    Page views copy whole pages (one index per ``page_size`` slots); slots past ``lengths`` hold stale data.
    """
    page_size = pool.shape[2]
    if block_size != page_size:
        return gather_slots(pool, view_slots(index[..., : -(-n // block_size)], index.new_full((1, 1), n),
                                             block_size)[0][..., :n])
    pages = index[..., : -(-n // page_size)].long()
    head = torch.arange(pool.shape[1], device=pool.device)[None, :, None]
    blocks = pool[pages, head]  # [batch, kv_heads, pages, page_size, *rest]
    return blocks.flatten(2, 3)[:, :, :n]


def _flash_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower-right causal attention of ``query [B, Hq, T, D]`` over ``key/value [B, Hkv, N, D]`` (N >= T), native
    GQA; returns ``out [B, T, Hq, D]`` contiguous and ``lse [B, Hq, T]``. CUDA: the flash kernel (causal is
    bottom-right aligned there); CPU (tests): the CPU flash kernel with an explicit mask."""
    queries, n = query.shape[2], key.shape[2]
    if query.is_cuda:
        res = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False, scale=scale)
    else:
        group = query.shape[1] // key.shape[1]
        mask = None  # queries == n: plain causal, the kernel skips the masked blocks (4x faster than a mask)
        if queries != n:
            visible = torch.ones(queries, n, dtype=torch.bool, device=query.device).tril(n - queries)
            mask = torch.zeros(queries, n, dtype=query.dtype, device=query.device).masked_fill(~visible, -torch.inf)
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), 0.0, mask is None,
            attn_mask=mask, scale=scale)
    return res[0].transpose(1, 2).contiguous(), res[1][..., :queries].float()


def _sdpa_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [B, Hq, T, D]`` over ``key/value [B, Hkv, N, D]``, unmasked or with the top-left causal
    mask, native GQA, with its log-sum-exp: ``out [B, Hq, T, D]`` (any strides) and ``lse [B, Hq, T]`` fp32. CUDA:
    cuDNN (its fused kernel runs a causal 8K prompt at 576 TFLOP/s on the H200, flash at 307); CPU (tests): the CPU
    flash kernel."""
    batch, q_heads, queries = query.shape[:3]
    if query.is_cuda:
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, None, True, 0.0, causal, False,
                                                                 scale=scale)
    else:
        group = q_heads // key.shape[1]
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), 0.0, causal, scale=scale)
    return res[0], res[1].float().reshape(batch, q_heads, -1)[..., :queries]


def prefill_attention_split(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, index: torch.Tensor,
                            block_size: int, scale: float, length: int, key: torch.Tensor,
                            value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A host-vouched dense step (every list ``length`` slots, no padding, no hole, no window) as two fused attention
    calls merged by their log-sum-exps: the queries over their own ``key/value [B, Hkv, T, D]`` with the top-left
    causal mask, and over the ``length - T`` older slots gathered from the pool, unmasked (the module's contract:
    every earlier slot holds an older token). Flash's lower-right causal mask does both in one call, at about half
    of cuDNN's speed; cuDNN has only the top-left one, hence the split. Returns ``out [B, T, Hq, D]`` contiguous and
    ``lse [B, Hq, T]``."""
    queries = query.shape[2]
    out, lse = _sdpa_with_lse(query, key, value, True, scale)
    prefix = length - queries
    if prefix > 0:
        out_p, lse_p = _sdpa_with_lse(query, gather_view(k_pool, index, block_size, prefix),
                                      gather_view(v_pool, index, block_size, prefix), False, scale)
        total = torch.logaddexp(lse, lse_p)
        out = out.float().mul_(torch.exp(lse - total)[..., None]).add_(
            out_p.float().mul_(torch.exp(lse_p - total)[..., None])).to(query.dtype)
        lse = total
    return out.transpose(1, 2).contiguous(), lse


_SPLIT_BROKEN: list[str] = []  # the first error of the split path in this process (it is then not tried again)


def _split_failed(err: RuntimeError) -> None:
    """The split path raised (cuDNN refused the shape or is missing a kernel): warn once, use gather + flash from
    now on. Nothing was written by then, so the fallback recomputes the same step."""
    if not _SPLIT_BROKEN:
        logging.getLogger("sparsecompile").warning(
            "cuDNN prefill attention failed (%s); using gather + flash attention for the rest of this process",
            str(err).splitlines()[0][:200])
    _SPLIT_BROKEN.append(str(err))


def split_applicable(query: torch.Tensor) -> bool:
    """May the CUDA dispatch take :func:`prefill_attention_split`? cuDNN's fused attention, enabled in torch, on a
    Hopper or later GPU (measured there; elsewhere gather + flash stays), head_dim a multiple of 8 up to 128, and
    the path has not failed in this process (:func:`_split_failed`)."""
    head_dim = query.shape[-1]
    return (not _SPLIT_BROKEN and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(query.device)[0] >= 9 and head_dim % 8 == 0 and head_dim <= 128)


def prefill_attention_dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill step with no prefix and no padding is causal attention over its own ``key/value [B, Hkv, T, D]``:
    no gather at all (the caller knows this on the host). Returns ``out [B, T, Hq, D]`` and ``lse [B, Hq, T]``."""
    return _flash_with_lse(query, key, value, scale)


def sdpa_applicable(index: torch.Tensor, lengths: torch.Tensor, pos_pool: torch.Tensor, num_new: torch.Tensor,
                    queries: int, block_size: int) -> torch.Tensor:
    """Device ``[2]`` int64: (1 if the gathered-SDPA path is exact else 0, longest list). Exact when every list has
    the same length, no row is padded and no slot before a row's new tokens is empty (read over the capacity of
    the view: position ids only, 4 bytes a slot)."""
    span = index.shape[-1] * block_size
    lens = lengths.long()
    longest = lens.max()
    kpos = gather_view(pos_pool, index, block_size, span)
    j = torch.arange(span, device=index.device)
    holes = ((kpos < 0) & (j < lens[..., None])).any()
    ok = (lens == longest).all() & (num_new == queries).all() & ~holes
    return torch.stack([ok.long(), longest])


def prefill_attention_sdpa(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor,
                           index: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor,
                           num_new: torch.Tensor, block_size: int, scale: float, sliding_window: int, *,
                           known_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather + flash attention (variant b); falls back to :func:`prefill_attention_triton` when not exact.

    ``known_length``: the caller vouches (from host state) that the path is exact with lists of this length, so
    nothing syncs; otherwise one host sync reads :func:`sdpa_applicable`.
    """
    queries = query.shape[2]
    flash_dtype = query.dtype in (torch.bfloat16, torch.float16) or not query.is_cuda
    static_ok = sliding_window <= 0 and block_size == k_pool.shape[2] and flash_dtype
    if static_ok and known_length is None:
        ok, known_length = sdpa_applicable(index, lengths, pos_pool, num_new, queries, block_size).tolist()
        static_ok = bool(ok)
    if not static_ok or known_length < queries:
        fallback = prefill_attention_triton if query.is_cuda else prefill_attention_reference
        return fallback(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, num_new, block_size, scale,
                        sliding_window)
    keys = gather_view(k_pool, index, block_size, known_length)
    values = gather_view(v_pool, index, block_size, known_length)
    return _flash_with_lse(query, keys, values, scale)


_FLEX_BLOCK = 128
_compiled_flex = None


def _flex_fn(device: torch.device):
    """FlexAttention compiled on CUDA (the eager path materialises every logit); eager on CPU (tests)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)  # automatic dynamic: few recompiles across shapes
    return _compiled_flex


def prefill_attention_flex(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor,
                           index: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor,
                           num_new: torch.Tensor, block_size: int, scale: float,
                           sliding_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the view's capacity + FlexAttention (variant c). No host sync; exact in every case.

    The block mask skips key blocks past each query block's causal bound (page views, the module's contract) and
    past ``lengths``; it treats a leading run of key blocks as fully visible (no mask_mod) when the row has no
    window, no padding query in the block and no empty slot before its new tokens.
    """
    from torch.nn.attention.flex_attention import BlockMask

    batch, q_heads, queries, _ = query.shape
    kv_heads = k_pool.shape[1]
    group = q_heads // kv_heads
    span = index.shape[-1] * block_size
    keys = gather_view(k_pool, index, block_size, span)
    values = gather_view(v_pool, index, block_size, span)
    lens = lengths.long()
    j = torch.arange(span, device=query.device)
    kpos = torch.where(j < lens[..., None], gather_view(pos_pool, index, block_size, span).long(), -1)
    qpos = q_positions.long()

    def mask_mod(b, h, q_idx, kv_idx):
        p = kpos[b, h // group, kv_idx]
        q = qpos[b, q_idx]
        vis = (p >= 0) & (p <= q)
        if sliding_window > 0:
            vis = vis & (p > q - sliding_window)
        return vis

    blk = _FLEX_BLOCK
    q_blocks, kv_blocks = -(-queries // blk), -(-span // blk)
    length = lens.max(1).values  # [batch]; equal across heads by contract
    padding = queries - num_new.long()  # [batch] leading padding queries
    last_t = torch.clamp(torch.arange(q_blocks, device=query.device) * blk + blk - 1, max=queries - 1)
    last_offset = last_t[None, :] - padding[:, None]  # [batch, q_blocks]
    if block_size == k_pool.shape[2]:
        bound = torch.where(last_offset >= 0, torch.minimum(length[:, None], length[:, None] - num_new[:, None]
                                                            + last_offset + 1), 0)
    else:
        bound = length[:, None].expand(-1, q_blocks)
    total = -(-bound // blk)
    prefix = (length - num_new.long()).clamp(min=0)
    holes = ((kpos < 0) & (j < prefix[:, None, None])).flatten(1).any(1)  # [batch]
    first_t = torch.arange(q_blocks, device=query.device) * blk
    dense = (first_t[None, :] >= padding[:, None]) & ~holes[:, None] & (sliding_window <= 0)
    full = torch.where(dense, prefix[:, None] // blk, 0).clamp(max=total)
    cols = torch.arange(kv_blocks, device=query.device)
    partial = (cols + full[..., None]).clamp(max=kv_blocks - 1)  # blocks full..total-1 (entries past are unread)
    block_mask = BlockMask.from_kv_blocks(
        (total - full)[:, None].to(torch.int32), partial[:, None].to(torch.int32),
        full[:, None].to(torch.int32), cols.expand(batch, 1, q_blocks, -1).to(torch.int32),
        BLOCK_SIZE=(blk, blk), mask_mod=mask_mod, seq_lengths=(queries, span))
    out, lse = _flex_fn(query.device)(query, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True,
                                      return_lse=True)
    return out.transpose(1, 2).contiguous(), lse.float()


_IMPLEMENTATIONS = {"sdpa": prefill_attention_sdpa, "flex": prefill_attention_flex}


def _cuda(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, num_new, block_size, scale, sliding_window,
          known_length=-1, want_lse=True, key=None, value=None):
    """CUDA dispatch, by measurement on the H200 (benchmarks/results/prefill_attention*.jsonl): with the lists'
    length vouched for by the host (``known_length >= 0``: no padding, equal lengths, no empty slot, no window),
    a whole prompt without prefix runs public SDPA (cuDNN: 576 TFLOP/s at 8K, against 307 for the flash kernel and
    225 for the Triton kernel) unless its log-sum-exp is needed, and a chunk after a prefix (or a whole prompt
    whose log-sum-exp is needed) runs gather + flash (262-309 TFLOP/s, 75-88 % of contiguous flash, against 235-246
    for Triton), or with :data:`SPLIT` cuDNN in two calls; everything else, the Triton kernel (:data:`CUDA_IMPL`
    overrides it for experiments)."""
    queries = query.shape[2]
    exact = (known_length >= queries and sliding_window <= 0 and block_size == k_pool.shape[2]
             and query.dtype in (torch.bfloat16, torch.float16))
    if CUDA_IMPL == "triton" and exact:
        if known_length == queries and not want_lse:  # the step's own K/V when given: nothing to gather
            keys = key if key is not None else gather_view(k_pool, index, block_size, queries)
            values = value if value is not None else gather_view(v_pool, index, block_size, queries)
            out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale,
                                                                   enable_gqa=True)
            return out.transpose(1, 2).contiguous(), query.new_empty(query.shape[:3], dtype=torch.float32)
        if key is not None and value is not None and SPLIT and split_applicable(query):
            try:
                return prefill_attention_split(query, k_pool, v_pool, index, block_size, scale, known_length, key,
                                               value)
            except RuntimeError as err:  # e.g. a cuDNN build with no plan for this shape: exact gather + flash
                _split_failed(err)
        return prefill_attention_sdpa(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, num_new,
                                      block_size, scale, sliding_window, known_length=known_length)
    launch = _IMPLEMENTATIONS.get(CUDA_IMPL, prefill_attention_triton)
    return launch(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, num_new, block_size, scale,
                  sliding_window)


def _cpu(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, num_new, block_size, scale, sliding_window,
         known_length=-1, want_lse=True, key=None, value=None):
    """CPU: the host-vouched dense steps (``known_length``, as on CUDA) run the CPU flash kernel in fp32 on the
    step's own K/V (a whole prompt) or on the gathered view (a chunk after a prefix), 4-15x faster than the
    reference at 3K tokens; everything else (padding, holes, windows, slot lists) runs the fp32 reference."""
    queries = query.shape[2]
    if known_length >= queries and sliding_window <= 0 and block_size == k_pool.shape[2]:
        if known_length == queries and key is not None:
            keys, values = key, value
        else:
            keys = gather_view(k_pool, index, block_size, known_length)
            values = gather_view(v_pool, index, block_size, known_length)
        out, lse = _flash_with_lse(query.float(), keys.float(), values.float(), scale)
        return out.to(query.dtype), lse
    return prefill_attention_reference(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, num_new,
                                       block_size, scale, sliding_window)


def _fake(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, num_new, block_size, scale, sliding_window,
          known_length=-1, want_lse=True, key=None, value=None):
    batch, q_heads, queries, head_dim = query.shape
    return (query.new_empty(batch, queries, q_heads, head_dim),
            query.new_empty(batch, q_heads, queries, dtype=torch.float32))


paged_prefill_attention = define_op(
    "paged_prefill_attention(Tensor query, Tensor k_pool, Tensor v_pool, Tensor pos_pool, Tensor index, "
    "Tensor lengths, Tensor q_positions, Tensor num_new, int block_size, float scale, int sliding_window, "
    "int known_length=-1, bool want_lse=True, Tensor? key=None, Tensor? value=None) -> (Tensor out, Tensor lse)",
    cpu=_cpu,
    cuda=_cuda if triton is not None else None,
    fake=_fake,
)

__all__ = ["CUDA_IMPL", "SPLIT", "paged_prefill_attention", "prefill_attention_reference",
           "prefill_attention_triton", "prefill_attention_sdpa", "prefill_attention_split", "prefill_attention_flex",
           "prefill_attention_dense", "gather_view", "split_applicable", "sdpa_applicable", "prefill_config",
           "PREFILL_LARGE_CONFIG", "PREFILL_SMALL_CONFIG", "PREFILL_FP32_CONFIG"]
