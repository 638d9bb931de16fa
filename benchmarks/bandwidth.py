"""HBM read bandwidth of this GPU, measured three ways in the calling process.

The roofline of a decode step is ``bytes it must read / bandwidth``; we take the best of a large
device-to-device copy (counting only the bytes read, as the decode step only reads), a large sum
reduction, and dense SDPA decode (cuDNN / flash), so that the ceiling is a measured one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def time_graph(fns, iters: int = 20) -> float:
    """Median seconds per call of the closures ``fns`` (each over its own buffers, so reads do not come
    from L2), captured once in a CUDA graph and replayed (launch gaps removed)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def measure_read_bandwidth(gib: float = 4.0) -> dict[str, float]:
    """GB/s read by a copy, a reduction and dense SDPA decode; ``best`` is the roofline bandwidth."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = time_graph([lambda: dst.copy_(src)])
    reduce_s = time_graph([lambda: src.sum(dtype=torch.float32)])
    # dense decode over a 32K context, batch 16, GQA 32/8, head_dim 128: 2.15 GB of K/V
    batch, heads, kv_heads, ctx, dim = 16, 32, 8, 32768, 128
    q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, ctx, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sdpa_s = time_graph([lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)])
    result = {
        "copy_read_GBps": src.numel() * 2 / copy_s / 1e9,
        "reduce_GBps": src.numel() * 2 / reduce_s / 1e9,
        "sdpa_decode_GBps": 2 * k.numel() * 2 / sdpa_s / 1e9,
    }
    result["best_GBps"] = max(result.values())
    return result


if __name__ == "__main__":
    print(measure_read_bandwidth())
