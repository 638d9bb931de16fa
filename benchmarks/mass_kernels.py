"""Microbenchmarks of the attention-mass ops (H2O accumulation, SnapKV window scores, KVzip scores) on CUDA.

Run through ``benchmarks/kernels.py --only mass [--sweep] [--quick]``. Each row reports the median time of
CUDA-graph replays cycling several input copies, the bytes the op must read (keys, positions, and the score
buffer it updates) with the achieved share of the measured bandwidth, and the QK^T TFLOP/s for the
compute-bound shapes (prefill chunks, KVzip). Shapes: the Llama-3.1-8B attention (8 KV heads, 32 query
heads, head_dim 128, bf16, page 16).
"""

from __future__ import annotations

import torch
from bandwidth import time_graph

from sparsecompile.kernels.attention_mass import (
    LSE_CONFIG,
    MASS_DECODE_CONFIG,
    MASS_PREFILL_CONFIG,
    attention_lse_triton,
)
from sparsecompile.kernels.h2o_scores import (
    h2o_accumulate_logits_triton,
    h2o_accumulate_lse_triton,
    h2o_accumulate_triton,
)
from sparsecompile.kernels.kvzip_scores import kvzip_scores_triton
from sparsecompile.kernels.paged_attention import paged_attention_triton
from sparsecompile.kernels.snapkv_scores import snapkv_scores_triton

KV_HEADS, GROUP, DIM, PAGE = 8, 4, 128, 16
SCALE = DIM ** -0.5


def sequence_pool(batch: int, tokens: int, copies: int) -> list[tuple]:
    """``copies`` pools holding ``batch`` sequences of ``tokens`` tokens each on shuffled pages, positions in page
    order (so causality is real), and the page view of each: ``(k_pool, pos_pool, index, lengths)``."""
    pages = -(-tokens // PAGE)
    out = []
    for _ in range(copies):
        k = torch.randn(batch * pages + 1, KV_HEADS, PAGE, DIM, device="cuda", dtype=torch.bfloat16)
        pos = torch.full(k.shape[:3], -1, device="cuda", dtype=torch.int32)
        owned = torch.randperm(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages) + 1
        logical = torch.arange(pages * PAGE, device="cuda", dtype=torch.int32).view(1, pages, 1, PAGE)
        pos[owned.long()] = logical.expand(batch, -1, KV_HEADS, -1)
        index = owned[:, None, :].expand(batch, KV_HEADS, pages).contiguous()
        lengths = torch.full((batch, KV_HEADS), tokens, device="cuda", dtype=torch.int32)
        out.append((k, pos, index, lengths))
    return out


def _queries(batch: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randn(batch, KV_HEADS * GROUP, count, DIM, device="cuda", dtype=torch.bfloat16)
    return q, torch.arange(first, first + count, device="cuda").repeat(batch, 1)


def _row(kernel: str, fns: list, mb_read: float, flops: float = 0.0, iters: int = 20, **info) -> dict:
    seconds = time_graph(fns, iters=iters)
    row = {"kernel": kernel, **info, "us": seconds * 1e6, "MB_read": mb_read, "GBps": mb_read * 1e6 / seconds / 1e9}
    if flops:
        row["TFLOPs_qk"] = flops / seconds / 1e12
    return row


def _h2o_decode(copies: int, iters: int, configs: list, batch: int = 64, budget: int = 2048,
                attention_configs: tuple = (None,)) -> list[dict]:
    sets = []
    for k, pos, index, lengths in sequence_pool(batch, budget, copies):
        q, qpos = _queries(batch, budget - 1, 1)
        lse = attention_lse_triton(q, k, pos, index, lengths, qpos, PAGE, SCALE, 0)
        sets.append((torch.zeros(k.shape[:3], device="cuda"), q, k, pos, index, lengths, qpos, lse))
    mb = batch * KV_HEADS * budget * (DIM * 2 + 4 + 4) / 1e6  # keys, positions, scores (read, then written)
    rows = [_row("h2o_accumulate (decode)", [lambda a=a: h2o_accumulate_triton(*a[:7], PAGE, SCALE, 0)
                                             for a in sets], mb, iters=iters, batch=batch, budget=budget)]
    # decode's path since the attention writes its logits: the update reads them (and the lse), not the keys; the
    # attention's extra cost is the pair of rows below (the same attention without and with the logits' stores)
    logit_sets = []
    for scores, q, k, pos, index, lengths, qpos, _ in sets:
        v = torch.randn_like(k)
        args = (q, k, v, pos, index, lengths, qpos, PAGE, SCALE, 0)
        _, attn_lse, logits = paged_attention_triton(*args, with_logits=True)
        logit_sets.append((scores, logits, attn_lse, index, lengths, args))
    mb_logits = batch * KV_HEADS * budget * (GROUP * 4 + 4 + 4) / 1e6  # the group's logits, scores (read, written)
    rows.append(_row("h2o_accumulate_logits (decode)", [lambda a=a: h2o_accumulate_logits_triton(*a[:5], PAGE)
                                                        for a in logit_sets], mb_logits, iters=iters, batch=batch,
                     budget=budget))
    mb_attn = batch * KV_HEADS * budget * (DIM * 4 + 4) / 1e6  # keys, values, positions
    variants = [("paged_attention (decode)", {})]
    variants += [("paged_attention + logits (decode)", {"with_logits": True, "config": cfg})
                 for cfg in attention_configs]
    for name, extra in variants:
        rows.append(_row(name, [lambda a=a, extra=extra: paged_attention_triton(*a[5], **extra) for a in logit_sets],
                         mb_attn, iters=iters, batch=batch, budget=budget, config=extra.get("config") or "default"))
    for cfg in configs:
        rows.append(_row("h2o_accumulate_lse (decode)", [lambda a=a, cfg=cfg: h2o_accumulate_lse_triton(
            *a, PAGE, SCALE, 0, mass_config=cfg) for a in sets], mb, iters=iters, batch=batch, budget=budget,
            config=cfg or "default"))
    return rows


def _h2o_prefill(copies: int, iters: int, configs: list, context: int, chunk: int = 2048) -> list[dict]:
    sets = []
    for k, pos, index, lengths in sequence_pool(1, context, copies):
        q, qpos = _queries(1, context - chunk, chunk)
        lse = attention_lse_triton(q, k, pos, index, lengths, qpos, PAGE, SCALE, 0)
        sets.append((torch.zeros(k.shape[:3], device="cuda"), q, k, pos, index, lengths, qpos, lse))
    mb = context * KV_HEADS * (DIM * 2 + 4 + 4) / 1e6 + chunk * KV_HEADS * GROUP * (DIM * 2 + 4) / 1e6
    flops = 2.0 * KV_HEADS * GROUP * chunk * (context - chunk / 2) * DIM  # causal: the chunk sees half itself
    name = f"h2o_accumulate_lse (prefill chunk {chunk} over {context})"
    rows = []
    for cfg in configs:
        rows.append(_row(name, [lambda a=a, c=cfg: h2o_accumulate_lse_triton(*a, PAGE, SCALE, 0, mass_config=c)
                                for a in sets], mb, flops, iters=iters, context=context, chunk=chunk,
                         config=cfg or "default"))
    rows.append(_row(f"attention lse pass (prefill chunk {chunk} over {context})",
                     [lambda a=a: attention_lse_triton(*a[1:7], PAGE, SCALE, 0) for a in sets], mb, flops,
                     iters=iters, context=context, chunk=chunk))
    return rows


def _snapkv(copies: int, iters: int, configs: list, context: int = 32768, window: int = 32) -> list[dict]:
    sets = []
    for k, pos, index, lengths in sequence_pool(1, context, copies):
        q, qpos = _queries(1, context - window, window)
        sets.append((q, k, pos, index, lengths, qpos))
    mb = context * KV_HEADS * (DIM * 2 + 4) / 1e6
    rows = []
    for lse_cfg, mass_cfg in configs:
        rows.append(_row(f"snapkv_scores (prefill, {window} window queries)", [
            lambda a=a, lc=lse_cfg, mc=mass_cfg: snapkv_scores_triton(*a, PAGE, SCALE, 0, lse_config=lc, mass_config=mc)
            for a in sets], mb, iters=iters, context=context, config=[lse_cfg, mass_cfg] if lse_cfg or mass_cfg
            else "default"))
    return rows


def _kvzip(copies: int, iters: int, configs: list, chunk: int = 2048, sink: int = 4, repeat: int = 2048 + 16,
           context: int = 32768) -> list[dict]:
    """One KVzip scoring call: a 2,048-token chunk of a 32K context with its sink, re-read by 2,064 repeat
    queries (prompt + the chunk) placed after the context; a slot-list view of sink + chunk + repeat."""
    n = sink + chunk + repeat
    sets = []
    for k, pos, _, _ in sequence_pool(1, context + repeat, copies):
        page_of = torch.argsort(torch.where(pos[:, 0, 0] >= 0, pos[:, 0, 0], 1 << 30))  # logical page -> pool page
        logical = torch.cat([torch.arange(sink), context // 3 + torch.arange(chunk),
                             context + torch.arange(repeat)]).to("cuda")
        slots = page_of[logical // PAGE] * PAGE + logical % PAGE
        index = slots[None, None, :].expand(1, KV_HEADS, n).to(torch.int32).contiguous()
        lengths = torch.full((1, KV_HEADS), n, device="cuda", dtype=torch.int32)
        q, qpos = _queries(1, context, repeat)
        sets.append((q, k, pos, index, lengths, qpos))
    mb = n * KV_HEADS * (DIM * 2 + 4) / 1e6
    flops = 2 * 2.0 * KV_HEADS * GROUP * repeat * (n - repeat / 2) * DIM  # two passes (lse, then max)
    rows = []
    for lse_cfg, mass_cfg in configs:
        rows.append(_row(f"kvzip_scores ({repeat} repeat queries over {n} slots)", [
            lambda a=a, lc=lse_cfg, mc=mass_cfg: kvzip_scores_triton(*a, 1, SCALE, 0, lse_config=lc, mass_config=mc)
            for a in sets], mb, flops, iters=iters, config=[lse_cfg, mass_cfg] if lse_cfg or mass_cfg
            else "default"))
    return rows


def _guarded(name: str, fn, *args) -> list[dict]:
    """Run one case; a failure becomes an error row instead of losing the other cases."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001
        return [{"kernel": name, "error": f"{type(err).__name__}: {err}"[:500]}]
    finally:
        torch.cuda.empty_cache()


def _decode_configs(sweep: bool) -> list:
    """H2O's decode accumulation: the default, and with ``sweep`` its tile / warp / stage alternatives."""
    if not sweep:
        return [None]
    return [None] + [{**MASS_DECODE_CONFIG, "block_n": bn, "num_warps": w, "num_stages": st}
                     for bn in (32, 64, 128, 256) for w in (2, 4, 8) for st in (1, 2, 3, 4)]


def _logits_configs(sweep: bool) -> tuple:
    """The decode attention that also writes its logits (H2O's update reads them): the default launch and, with
    ``sweep``, tiles / warps / stages / split targets (the logits' stores cost 13 us a layer at 32K x 16 on the H200
    with the plain attention's launch, ``results/profile_h2o_32k_b16_logits.txt``; compiled for sm_90 they add a
    layout conversion of the tile a loop step, ``sessions/sm90_attention_ir.py``; the sweep of 2026-12-04 set
    ``DECODE_LOGITS_CONFIGS``, ``results/kernels_mass_decode_logits_sweep_h200.jsonl``)."""
    if not sweep:
        return (None,)
    return (None,) + tuple({"block_n": bn, "num_warps": w, "num_stages": st, "target_programs": tp}
                           for bn in (32, 64, 128) for w in (2, 4) for st in (2, 3) for tp in (264, 528))


def mass_decode_rows(copies: int = 3, iters: int = 20, sweep: bool = False) -> list[dict]:
    """Only H2O's decode update (``kernels.py --only mass_decode``: #14's bandwidth target, 70 %), at batch 64 and at
    the engine's 32K x 16 point (batch 16, the 2,048-token budget)."""
    # the key pass (h2o_accumulate_lse) is off decode's path since the update reads the attention's logits: its
    # default launch only, the sweep is over the attention that stores them
    rows = _guarded("h2o decode", _h2o_decode, copies, iters, [None], 64, 2048, _logits_configs(sweep))
    return rows + _guarded("h2o decode b16", _h2o_decode, copies, iters, [None], 16, 2048, _logits_configs(sweep))


def mass_rows(copies: int = 3, iters: int = 20, sweep: bool = False) -> list[dict]:
    """Every attention-mass row (with ``sweep``, also the alternative launch configurations)."""
    decode, prefill, split = _decode_configs(sweep), [None], [(None, None)]
    if sweep:
        prefill += [{**MASS_PREFILL_CONFIG, "block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st,
                     "super": sup}
                    for sup in (1, 4) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for st in (2, 3)]
        prefill += [{**MASS_PREFILL_CONFIG, "skip": False}]
        split += [({**LSE_CONFIG, "block_n": bn, "target_programs": tp}, None) for bn in (64, 128)
                  for tp in (264, 528, 1056)]
        split += [(None, {**MASS_PREFILL_CONFIG, "block_m": 32, "block_n": bn, "num_warps": w})
                  for bn in (32, 64, 128) for w in (4, 8)]
    rows = []
    rows += _guarded("h2o decode", _h2o_decode, copies, iters, decode)
    rows += _guarded("h2o prefill 32K", _h2o_prefill, 2, iters, prefill, 32768)
    rows += _guarded("h2o prefill 4K", _h2o_prefill, copies, iters, prefill, 4096)
    # H2O's default prefill: 8192-token chunks over the kept budget (2048) plus the chunk
    rows += _guarded("h2o prefill 8K chunk", _h2o_prefill, 2, iters, prefill, 10240, 8192)
    rows += _guarded("snapkv", _snapkv, copies, iters, split)
    rows += _guarded("kvzip", _kvzip, copies, iters, split if not sweep else split[:1] + split[7:])
    return rows
