"""Session probe (#20, 2026-12-05 twenty-first session): does the KIVI pool's layout cap the 2-bit decode kernel's
bandwidth? A read-only Triton kernel walks the same pages as the decode (lists of 32-slot groups at random pages,
a wave of programs, each a split of one list) and reads per (page, KV head), in three layouts:

* ``split``: the pool's seven blocks from seven tensors (2 bits: key codes 1,024 B, value codes 1,024 B, key scales,
  key zeros, value scales, value zeros 256 B each, positions 128 B), as the Gluon kernel reads them;
* ``meta``: the codes as now, the four metadata blocks as one 1,024-byte block, the positions apart;
* ``packed``: the same 3,200 bytes as one contiguous block a (page, head);
* ``dense``: ``vanilla``'s pages (keys and values 8 KiB each), the reference.

If ``packed`` reads at the dense rate and ``split`` well below it, the seven small blocks (each a separate DRAM
burst at a random page) are what holds the kernel at ~70 % of the bandwidth, and a per-group interleaved pool is the
next change; if both read alike, the kernel's instructions are.

    python benchmarks/sessions/kivi_layout_bw.py [--points 131072x4,32768x16]   # JSON lines
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bandwidth import time_graph  # noqa: E402

HEADS, GROUP = 8, 32
SPLIT = (256, 256, 64, 64, 64, 64, 32)  # int32 words a (page, head): codes, codes, scales / zeros x 4, positions
META = (256, 256, 256, 32)  # the four metadata blocks as one
PACKED = 800  # the same 3,200 bytes
DENSE = (2048, 2048)  # 8 KiB of keys and of values


@triton.jit
def _block(ptr, base, N: tl.constexpr):
    return tl.sum(tl.load(ptr + base * N + tl.arange(0, N)), 0)


@triton.jit
def _read_kernel(INDEX, S0, S1, S2, S3, S4, S5, S6, OUT, groups, per, splits, H: tl.constexpr, LAYOUT: tl.constexpr,
                 STAGES: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H
    h = pid % H
    lo = split * per
    hi = tl.minimum(lo + per, groups)
    acc = 0
    for g in tl.range(lo, hi, num_stages=STAGES):
        base = tl.load(INDEX + b * groups + g).to(tl.int64) * H + h
        if LAYOUT == 0:  # split
            acc += _block(S0, base, 256) + _block(S1, base, 256) + _block(S2, base, 64) + _block(S3, base, 64)
            acc += _block(S4, base, 64) + _block(S5, base, 64) + _block(S6, base, 32)
        elif LAYOUT == 3:  # meta
            acc += _block(S0, base, 256) + _block(S1, base, 256) + _block(S2, base, 256) + _block(S3, base, 32)
        elif LAYOUT == 1:  # packed: 512 + 256 + 32 words of one 800-word block
            p = S0 + base * 800
            acc += tl.sum(tl.load(p + tl.arange(0, 512)), 0) + tl.sum(tl.load(p + 512 + tl.arange(0, 256)), 0)
            acc += tl.sum(tl.load(p + 768 + tl.arange(0, 32)), 0)
        else:  # dense
            acc += _block(S0, base, 2048) + _block(S1, base, 2048)
    tl.store(OUT + pid * splits + split, acc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="131072x4,32768x16")
    parser.add_argument("--per-sm", default="4,8,12,16")
    parser.add_argument("--warps", default="1,2,4")
    parser.add_argument("--stages", default="1,3")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for point in args.points.split(","):
        context, batch = (int(x) for x in point.split("x"))
        groups = context // GROUP
        pages = batch * groups
        index = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, groups)
        layouts = {
            "split": [torch.randint(0, 1 << 30, (pages, HEADS, n), device="cuda", dtype=torch.int32) for n in SPLIT],
            "packed": [torch.randint(0, 1 << 30, (pages, HEADS, PACKED), device="cuda", dtype=torch.int32)],
            "dense": [torch.randint(0, 1 << 30, (pages, HEADS, n), device="cuda", dtype=torch.int32) for n in DENSE],
            "meta": [torch.randint(0, 1 << 30, (pages, HEADS, n), device="cuda", dtype=torch.int32) for n in META],
        }
        for code, (name, tensors) in enumerate(layouts.items()):
            nbytes = sum(t.numel() * 4 for t in tensors)
            ptrs = (tensors + [tensors[0]] * 7)[:7]
            for per_sm in (int(x) for x in args.per_sm.split(",")):
                lists = batch * HEADS
                splits = max(1, min(sms * per_sm // lists, groups))
                per = -(-groups // splits)
                out = torch.empty(lists * splits, device="cuda", dtype=torch.int32)
                for warps in (int(x) for x in args.warps.split(",")):
                    for stages in (int(x) for x in args.stages.split(",")):
                        run = functools.partial(_read_kernel[(lists, splits)], index, *ptrs, out, groups, per,
                                                splits, H=HEADS, LAYOUT=code, STAGES=stages, num_warps=warps)
                        try:
                            seconds = time_graph([run], 20)
                        except Exception as err:  # a config that does not compile or fit
                            print(json.dumps({"layout": name, "point": point, "per_sm": per_sm, "warps": warps,
                                              "stages": stages, "error": str(err)[:200]}), flush=True)
                            continue
                        print(json.dumps({"layout": name, "point": point, "per_sm": per_sm, "warps": warps,
                                          "stages": stages, "us": seconds * 1e6,
                                          "GBps": nbytes / seconds / 1e9}), flush=True)
            del tensors
        layouts.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
