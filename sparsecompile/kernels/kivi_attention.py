"""``sparsecompile::kivi_decode_attention``: decode attention over KIVI pages plus the full-precision residual.

A ``(sequence, kv_head)`` list of ``lengths`` row-local slots is split in two: slots ``[0, quantized)`` live in
KIVI pages (``kivi_quant.py``: codes, per-group scales and zeros; ``index`` names the list's pages, ``P`` slots
each), slots ``[quantized, lengths)`` in the residual ring ``ring_k / ring_v [rows, kv_heads, RING, D]`` at
``slot % RING`` of ring row ``ring_rows[b]``. Logical positions of every slot are in ``pos_pool`` (page layout),
and visibility is :mod:`.paged_attention`'s (inside ``lengths``, position >= 0, not in the future, inside a
sliding window ``w > 0``).

Kernels (CUDA): where :func:`.kivi_gluon.gluon_supported` (an sm_90 GPU, bf16 or fp16 queries and scales, 2 or 4
bits, group 32, head dim 128, pages of one group) the Gluon kernel (``kivi_gluon.py``) takes the quantized slots and
the Triton kernel (``kivi_triton.py``) only the residual ring, a program a block, as the last splits; elsewhere the
Triton kernel takes every slot. :func:`.paged_attention._combine_kernel` merges the splits; with logits
(``h2o+kivi``) each kernel writes its own slots' and the combine kernel the log-sum-exp. Shapes neither kernel takes
run the torch reference (``kivi_reference.py``), as the CPU does.
"""

from __future__ import annotations

import torch

from .kivi_gluon import KIVI_GLUON_CONFIG, gluon_supported, kivi_gluon_quantized
from .kivi_quant import storage_bits
from .kivi_reference import (
    check_one_query,
    kivi_decode_attention_logits_reference,
    kivi_decode_attention_reference,
)
from .kivi_triton import KIVI_DECODE_CONFIG, _asm_strings, chunk_layout, fast_path_supported, wave_splits
from .library import define_op
from .pool import launch_inputs
from .tiles import FP_FUSION

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
else:
    from .kivi_triton import _kivi_decode_kernel
    from .paged_attention import _combine_kernel


def kivi_decode_attention_triton(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v,
                                 ring_rows, index, lengths, quantized, q_positions, scale, sliding_window,
                                 dense_history: bool = False, quant_index: torch.Tensor | None = None,
                                 quant_count: torch.Tensor | None = None, *,
                                 num_splits: int | None = None, config: dict | None = None, with_logits: bool = False,
                                 residual_splits: int = 0):
    """CUDA launch (the Gluon and Triton kernels) with the semantics of :func:`kivi_decode_attention_reference`
    (``with_logits``: of :func:`kivi_decode_attention_logits_reference`, the output, log-sum-exp and logits).
    ``num_splits`` / ``config`` (tests, sweeps) force the Triton kernel with that many splits of each list, of its
    quantized slots alone with ``residual_splits`` more for the ring's blocks (the Gluon launch's arrangement).
    ``dense_history`` (:attr:`.KiviSpec.dense_history`): every list's quantized slots hold its oldest tokens, none
    empty, before every query; without a sliding window the Gluon kernel then reads no positions for them (the
    result is the same). ``quant_index / quant_count`` (a selection over the quantized slots, Quest over KIVI pages):
    the quantized splits read those pages' first ``quant_count[b]`` slots instead of ``[0, quantized)`` (the same
    kernels, launched on them), the ring's splits the residual as ever; the ring then always has splits of its own."""
    batch, q_heads, queries, dim = query.shape
    heads, page_size = kcode.shape[1], kcode.shape[2]
    group_size = page_size // kscale.shape[2]
    group = q_heads // heads
    bits = storage_bits(kcode, dim)
    selected = quant_index is not None
    if with_logits and selected:
        raise ValueError("kivi_decode_attention: the logits of a selection over the quantized slots are not offered")
    if with_logits and (not fast_path_supported(group_size, dim, bits) or group > 64):
        return kivi_decode_attention_logits_reference(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool,
                                                      ring_k, ring_v, ring_rows, index, lengths, quantized,
                                                      q_positions, scale, sliding_window)
    if not fast_path_supported(group_size, dim, bits) or queries * group > 64:  # torch, sync-free: every slot
        return kivi_decode_attention_reference(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k,
                                               ring_v, ring_rows, index, lengths, quantized, q_positions, scale,
                                               sliding_window, span=index.shape[2] * page_size,
                                               quant_index=quant_index, quant_count=quant_count)
    query, index, q_positions = launch_inputs(query, index, q_positions)
    # the Gluon kernel takes the quantized slots (every split but the last), this one the residual (the last)
    gluon = num_splits is None and config is None and \
        gluon_supported(query, bits, group_size, dim, page_size, queries * group, kscale.dtype)
    cfg = {**KIVI_DECODE_CONFIG, **(config or {})}
    # the residual ring a program a block of block_f slots (Gluon or a selection: always; else when asked)
    rsplits = -(-ring_k.shape[2] // cfg["block_f"]) if gluon or selected else residual_splits
    block_m = max(8, triton.next_power_of_2(queries * group))  # an m16n8 MMA's 8 columns: GQA 4 wastes half
    out = torch.empty(batch, queries, q_heads, dim, dtype=query.dtype, device=query.device)
    span = index.shape[2] * page_size
    qspan = (quant_index if selected else index).shape[2] * page_size  # what the quantized splits spread over
    if gluon:
        launch = KIVI_GLUON_CONFIG[bits]
        splits = wave_splits(batch * heads, qspan, launch["min_groups"] * group_size, launch["programs_per_sm"],
                             query.device) + rsplits
    else:
        splits = (num_splits or wave_splits(batch * heads, qspan, 4 * group_size, cfg["programs_per_sm"],
                                            query.device)) + rsplits
    if splits > 1:
        mid_o = torch.empty(batch, q_heads, queries, splits, dim, dtype=torch.float32, device=query.device)
        mid_lse = torch.empty(batch, q_heads, queries, splits, dtype=torch.float32, device=query.device)
    else:
        mid_o = mid_lse = out
    if with_logits:  # slots no split reaches (past a list's length) stay -inf
        logits = torch.full((batch, q_heads, span), float("-inf"), dtype=torch.float32, device=query.device)
        lse = torch.empty(batch, q_heads, queries, dtype=torch.float32, device=query.device)
    else:
        logits = lse = out
    quantized = quantized.contiguous()
    # what the quantized splits read: the list's leading slots, or the selection's pages
    qindex, qcount = (quant_index.contiguous(), quant_count.contiguous()) if selected else (index, quantized)
    dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(query.dtype, tl.float32)
    asm = _asm_strings(bits, dim, group_size, query.dtype, query.is_cuda)

    def triton_splits(first: int, count: int, index=index, quantized=quantized) -> None:
        """The Triton kernel over splits ``first .. first + count - 1`` (``index, quantized``: what they read)."""
        _kivi_decode_kernel[(batch * heads, count)](
            query, kcode.view(torch.uint8), vcode.view(torch.uint8), kscale, kzero, vscale, vzero, pos_pool, ring_k,
            ring_v, ring_rows.contiguous(), index, lengths, quantized, q_positions, out, mid_o, mid_lse,
            logits, lse,
            query.stride(0), query.stride(1), query.stride(2), index.stride(0), index.stride(1),
            lengths.stride(0), lengths.stride(1), q_positions.stride(0),
            ring_k.stride(0), ring_k.stride(1), ring_k.stride(2), out.stride(0), out.stride(1), out.stride(2),
            float(scale), int(sliding_window), queries, span,
            KV_HEADS=heads, GROUP=group, PAGE=page_size, G=group_size, D=dim, BITS=bits, RING=ring_k.shape[2],
            BLOCK_M=block_m, BLOCK_F=cfg["block_f"], C=chunk_layout(dim, bits, group_size)[0], NUM_SPLITS=splits,
            DT=dt, ASM0=asm[0], ASM1=asm[1], ASM2=asm[2], ASM3=asm[3], VSM0=asm[4], VSM1=asm[5], VSM2=asm[6],
            VSM3=asm[7], WRITE_LOGITS=with_logits, RSPLITS=rsplits, FIRST_SPLIT=first,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),  # a register cap: more programs per SM
            **FP_FUSION,
        )

    # the quantized splits (the Gluon kernel's, or the Triton kernel's), then the ring's blocks, as two launches
    # whenever the ring has its own splits (the Triton kernel alone then runs the Gluon launch's arrangement)
    if gluon:
        kivi_gluon_quantized(query, kcode, kscale, kzero, vcode, vscale, vzero, pos_pool, qindex, qcount,
                             q_positions, scale, sliding_window, mid_o, mid_lse, splits - rsplits,
                             logits if with_logits else None, dense_history and sliding_window <= 0)
    elif rsplits:
        triton_splits(0, splits - rsplits, qindex, qcount)
    if rsplits:
        triton_splits(splits - rsplits, rsplits)
    else:
        triton_splits(0, splits)
    if splits > 1:
        _combine_kernel[(batch * q_heads * queries,)](
            mid_o, mid_lse, out, lse, out.stride(0), out.stride(1), out.stride(2), queries,
            Q_HEADS=q_heads, HEAD_DIM=dim, BLOCK_D=dim, NUM_SPLITS=splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)), WRITE_LSE=with_logits,
            **FP_FUSION,
        )
    return (out, lse, logits) if with_logits else out


def _reference(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows, index,
               lengths, quantized, q_positions, scale, sliding_window, dense_history=False, quant_index=None,
               quant_count=None):
    """The op's CPU kernel: :func:`kivi_decode_attention_reference` (``dense_history`` changes no result)."""
    return kivi_decode_attention_reference(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v,
                                           ring_rows, index, lengths, quantized, q_positions, scale, sliding_window,
                                           quant_index=quant_index, quant_count=quant_count)


def _fake(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows, index, lengths,
          quantized, q_positions, scale, sliding_window, dense_history=False, quant_index=None, quant_count=None):
    batch, q_heads, queries, dim = query.shape
    return query.new_empty(batch, queries, q_heads, dim)


def _triton_logits(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows, index,
                   lengths, quantized, q_positions, scale, sliding_window):
    check_one_query(query)
    return kivi_decode_attention_triton(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v,
                                        ring_rows, index, lengths, quantized, q_positions, scale, sliding_window,
                                        with_logits=True)


def _fake_logits(query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, ring_rows, index,
                 lengths, quantized, q_positions, scale, sliding_window):
    check_one_query(query)
    batch, q_heads, queries, dim = query.shape
    return (query.new_empty(batch, queries, q_heads, dim), query.new_empty(batch, q_heads, 1, dtype=torch.float32),
            query.new_empty(batch, q_heads, index.shape[2] * kcode.shape[2], dtype=torch.float32))


kivi_decode_attention = define_op(
    "kivi_decode_attention(Tensor query, Tensor kcode, Tensor vcode, Tensor kscale, Tensor kzero, Tensor vscale, "
    "Tensor vzero, Tensor pos_pool, Tensor ring_k, Tensor ring_v, Tensor ring_rows, Tensor index, Tensor lengths, "
    "Tensor quantized, Tensor q_positions, float scale, int sliding_window, bool dense_history=False, "
    "Tensor? quant_index=None, Tensor? quant_count=None) -> Tensor",
    cpu=_reference,
    cuda=kivi_decode_attention_triton if triton is not None else None,
    fake=_fake,
)

#: The same attention for one decode query per sequence, also returning each query's log-sum-exp and its scaled
#: logits per view position (``[batch, q_heads, pages * P]``, -inf where unseen): H2O's decode scores over KIVI
#: storage (``h2o+kivi``) read them instead of the keys a second time.
kivi_decode_attention_logits = define_op(
    "kivi_decode_attention_logits(Tensor query, Tensor kcode, Tensor vcode, Tensor kscale, Tensor kzero, "
    "Tensor vscale, Tensor vzero, Tensor pos_pool, Tensor ring_k, Tensor ring_v, Tensor ring_rows, Tensor index, "
    "Tensor lengths, Tensor quantized, Tensor q_positions, float scale, int sliding_window) -> "
    "(Tensor out, Tensor lse, Tensor logits)",
    cpu=kivi_decode_attention_logits_reference,
    cuda=_triton_logits if triton is not None else None,
    fake=_fake_logits,
)
