"""Microbenchmarks of the KIVI ops on CUDA: quantized decode attention and quantize-on-write.

Run through ``benchmarks/kernels.py --only kivi [--sweep] [--quick]``. Shapes: the Llama-3.1-8B attention (8 KV
heads, 32 query heads, head_dim 128), KIVI pages of 32 slots, group 32, residual 128 (its ring holds 160 slots),
bf16 scales (``scale_dtype="auto"`` of a bf16 model), bf16 residual. Decode rows read every resident slot of every
sequence; the bytes a call must read are
the codes (``2 * 128 * bits / 8`` per slot), the value scales and zeros (16 B per slot), the key scales and zeros
(512 B per group), the positions (4 B per slot), the residual (512 B per slot) and the page table, and the row
reports them against the bandwidth measured in the same run. Times are medians of CUDA-graph replays cycling
several input copies (so reads do not come from L2).
"""

from __future__ import annotations

import json

import torch
from bandwidth import time_graph

from sparsecompile.kernels.kivi_attention import kivi_decode_attention_triton
from sparsecompile.kernels.kivi_quant import kivi_quantize_triton, page_shapes
from sparsecompile.kernels.kivi_triton import KIVI_DECODE_CONFIG

KV_HEADS, GROUP_Q, DIM, PAGE, G, RESIDUAL = 8, 4, 128, 32, 32, 128
RING = RESIDUAL + G
SCALES = torch.bfloat16  # the "auto" scale dtype of a bf16 model


def _pages(num_pages: int, bits: int) -> tuple[torch.Tensor, ...]:
    shapes = page_shapes(num_pages, KV_HEADS, PAGE, DIM, bits, G)
    codes = [torch.randint(-(2**31), 2**31 - 1, sh, dtype=torch.int32, device="cuda") for sh in shapes[:2]]
    return (*codes, *(torch.rand(sh, device="cuda").to(SCALES) for sh in shapes[2:]))


def decode_bytes(batch: int, context: int, bits: int) -> float:
    """Bytes one decode call reads (see module docstring)."""
    quant = (context - RESIDUAL) // G * G
    per_head = (quant * (2 * DIM * bits // 8 + 2 * 2 * DIM // G) + quant // G * 2 * 2 * DIM
                + (context - quant) * 2 * DIM * 2 + context * 4 + -(-context // PAGE) * 4)
    return batch * KV_HEADS * per_head


def decode_inputs(batch: int, context: int, bits: int, copies: int) -> list[tuple]:
    per_seq = -(-context // PAGE)
    quant = (context - RESIDUAL) // G * G
    sets = []
    for _ in range(copies):
        num_pages = batch * per_seq + 1
        pages = _pages(num_pages, bits)
        pos = torch.arange(PAGE, device="cuda", dtype=torch.int32).repeat(num_pages, KV_HEADS, 1)
        table = torch.randperm(num_pages - 1, device="cuda", dtype=torch.int32).view(batch, per_seq)
        index = table[:, None, :].expand(batch, KV_HEADS, -1).contiguous()
        ring_k = torch.randn(batch, KV_HEADS, RING, DIM, device="cuda", dtype=torch.bfloat16)
        ring_v = torch.randn_like(ring_k)
        query = torch.randn(batch, KV_HEADS * GROUP_Q, 1, DIM, device="cuda", dtype=torch.bfloat16)
        lengths = torch.full((batch, KV_HEADS), context, device="cuda", dtype=torch.int32)
        sets.append((query, *pages, pos, ring_k, ring_v, torch.arange(batch, device="cuda"), index, lengths,
                     torch.full((batch,), quant, device="cuda"), torch.full((batch, 1), 10**6, device="cuda"),
                     DIM ** -0.5, 0))
    return sets


def kivi_rows(copies: int = 3, iters: int = 20, sweep: bool = False) -> list[dict]:
    """Decode attention at 32K and 128K (2 and 4 bits), and the quantize-on-write op for one decode commit (a
    group per sequence) and one 2048-token prefill commit."""
    rows = []
    configs = [None, {}]  # the default (on an H200 at 2 bits the Gluon kernel), the Triton kernel alone
    if sweep:
        configs += [{"block_f": 32, "num_warps": w, "num_stages": st, "programs_per_sm": n}
                    for w in (1, 2) for st in (2, 3) for n in (4, 8, 16, 32)]
    for bits in (2, 4):
        for batch, context in ((1, 32768), (16, 32768), (1, 131072), (4, 131072)):
            info = {"kernel": f"kivi_decode_attention {bits}-bit", "batch": batch, "context": context,
                    "MB_read": decode_bytes(batch, context, bits) / 1e6}
            try:
                sets = decode_inputs(batch, context, bits, copies)
            except Exception as err:
                rows.append({**info, "error": f"{type(err).__name__}: {err}"[:300]})
                continue
            best = None
            swept = bits == 2  # the sweep times 2-bit shapes; 4-bit rows take the default
            for config in configs if swept else configs[:2]:
                try:
                    seconds = time_graph([lambda a=a, c=config: kivi_decode_attention_triton(*a, config=c)
                                          for a in sets], iters)
                except Exception as err:  # a configuration the compiler rejects
                    print(json.dumps({"config": config, "error": str(err)[:200]}))
                    continue
                row = {**info, "config": config or ("default" if config is None else "triton"), "us": seconds * 1e6,
                       "GBps": info["MB_read"] * 1e6 / seconds / 1e9}
                if config is None or config == {}:
                    rows.append(row)
                if config is None or sweep:  # every swept configuration in the log, the default and best in rows
                    print(json.dumps(row))
                if best is None or row["GBps"] > best["GBps"]:
                    best = row
            if sweep and best is not None:
                rows.append({**best, "best_of_sweep": True, "default_config": KIVI_DECODE_CONFIG})
                print(json.dumps(rows[-1]))
            del sets
            torch.cuda.empty_cache()
    # h2o+kivi's decode: a budget-sized list (2,048 + one group), the attention alone and writing its logits
    for batch in (1, 16, 64):
        context = 2048 + G
        sets = decode_inputs(batch, context, 2, copies)
        for logits in (False, True):
            seconds = time_graph([lambda a=a, w=logits: kivi_decode_attention_triton(*a, with_logits=w)
                                  for a in sets], iters)
            rows.append({"kernel": "kivi_decode_attention 2-bit" + (" with logits" if logits else ""),
                         "batch": batch, "context": context, "MB_read": decode_bytes(batch, context, 2) / 1e6,
                         "us": seconds * 1e6})
            print(json.dumps(rows[-1]))
        del sets
    for groups, label in ((64 * 1, "decode commit, 64 sequences x 1 group"),
                          (2048 // G, "prefill commit, 2048 tokens")):
        try:
            pages = _pages(groups + 1, 2)
            key = torch.randn(groups, KV_HEADS, G, DIM, device="cuda", dtype=torch.bfloat16)
            value = torch.randn_like(key)
            dst = torch.arange(groups, device="cuda") * PAGE
            args = (*pages, key, value, dst)
            seconds = time_graph([lambda a=args: kivi_quantize_triton(*a)], iters)
            mb = 2 * key.numel() * 2 / 1e6
            rows.append({"kernel": f"kivi_quantize 2-bit, {label}", "us": seconds * 1e6, "MB_read": mb,
                         "GBps": mb * 1e6 / seconds / 1e9})
        except Exception as err:
            rows.append({"kernel": f"kivi_quantize {label}", "error": f"{type(err).__name__}: {err}"[:300]})
    return rows
