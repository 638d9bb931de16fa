"""Diagnose Triton-vs-reference differences of paged attention on CUDA (kept as a debugging aid)."""

from __future__ import annotations

import torch

from sparsecompile.kernels.paged_attention import paged_attention_reference, paged_attention_triton


def main() -> None:
    torch.manual_seed(0)
    pages, page, batch, heads, group, dim, entries, block = 512, 16, 3, 8, 4, 128, 96, 16
    k = torch.randn(pages, heads, page, dim, device="cuda")
    v = torch.randn_like(k)
    pos = torch.arange(pages * page, dtype=torch.int32, device="cuda").view(pages, 1, page)
    pos = pos.expand(-1, heads, -1).contiguous()
    index = torch.randint(0, pages * page // block, (batch, heads, entries), dtype=torch.int32, device="cuda")
    lengths = torch.randint(1, entries * block + 1, (batch, heads), dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads * group, 1, dim, device="cuda")
    qpos = torch.randint(0, pages * page, (batch, 1), device="cuda")
    args = (pos, index, lengths, qpos, block, dim ** -0.5)
    for window in (0, 300):
        cpu = paged_attention_reference(q.cpu(), k.cpu(), v.cpu(), *(a.cpu() if torch.is_tensor(a) else a
                                                                       for a in args), window)
        ref32 = paged_attention_reference(q, k, v, *args, window).cpu()
        print(f"window={window} ref_cuda_fp32 vs cpu: {(ref32 - cpu).abs().max().item():.3g}")
        for dtype in (torch.float32, torch.bfloat16):
            qq, kk, vv = q.to(dtype), k.to(dtype), v.to(dtype)
            ref = paged_attention_reference(qq, kk, vv, *args, window).float().cpu()
            print(f"  {dtype} ref_cuda vs cpu: {(ref - cpu).abs().max().item():.3g}")
            for splits in (None, 1, 4):
                for stages in (2, 3):
                    got = paged_attention_triton(qq, kk, vv, *args, window, num_splits=splits,
                                                 config={"num_stages": stages}).float().cpu()
                    bad = ((got - cpu).abs() > 0.05).any(-1)
                    print(f"  {dtype} splits={splits} stages={stages}: max {(got - cpu).abs().max().item():.3g} "
                          f"bad rows {bad.nonzero().tolist()[:6]}")


if __name__ == "__main__":
    main()
