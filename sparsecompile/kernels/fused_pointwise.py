"""``sparsecompile::rms_norm`` and ``sparsecompile::silu_mul``: a transformer layer's per-token pointwise work, one
kernel each.

Run op by op, as an eager forward runs them, these are a prefill's largest cost after the GEMMs and attention. A
Llama-style RMSNorm is seven kernels (cast to fp32, square, mean, add, rsqrt, multiply, cast back, weight) that move
about 36 bytes per bf16 element (by arithmetic); the MLP's ``silu(gate) * up`` is two, through an intermediate of the
MLP's width. On the H200 at 32K tokens of the Llama-3.1-8B shape the eager pointwise kernels took about 0.25 s of the
forward's 1.36 s of kernel time (``results/profile_prefill_sparsecompile_vanilla_32768_b1_c0_h200_profile.txt``:
``aten::mul`` 104 ms, shared with RoPE, ``copy_`` 39, ``add`` 29, ``silu`` 17, ``pow`` 16, ``mean`` 9, RoPE's ``cat``
25 and ``neg`` 7). Fused, the norm reads and writes each element once (4 bytes) and SiLU-and-multiply reads two and
writes one; the 32K prefill went from 1.382 to 1.299 s (``results/prefill_h200_fused.jsonl``).

Both reproduce the unfused formulas' roundings: the normalised row is rounded to the input's dtype before the
weight multiplies it (as HF's ``weight * hidden.to(input_dtype)``), and ``silu(gate)`` to the gate's dtype before
``up`` multiplies it (as ``act_fn(gate) * up``). Only the order of the mean's sum differs from torch's.
"""

from __future__ import annotations

import torch

from .library import define_op
from .tiles import FP_FUSION

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux-only dependency
    triton = None


def rms_norm_reference(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference, HF's ``LlamaRMSNorm``: ``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``, computed in fp32.

    Args:
        hidden: ``[..., hidden]``.
        weight: ``[hidden]``.
    Returns:
        ``[..., hidden]`` in ``torch.result_type(weight, hidden)``.
    """
    x = hidden.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(hidden.dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``silu(gate) * up`` (both ``[..., width]``, one dtype)."""
    return torch.nn.functional.silu(gate) * up


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(hidden, weight, out, stride_h, stride_o, cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        mask = c < cols
        x = tl.load(hidden + row * stride_h + c, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(weight + c, mask=mask, other=0.0).to(tl.float32)
        variance = tl.sum(x * x, axis=0) / cols
        y = (x * tl.rsqrt(variance + eps)).to(hidden.dtype.element_ty).to(tl.float32)  # HF's cast before the weight
        tl.store(out + row * stride_o + c, (w * y).to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gate, up, out, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        g = tl.load(gate + i, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up + i, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype.element_ty).to(tl.float32)  # silu's own rounding, as unfused
        tl.store(out + i, (act * u).to(out.dtype.element_ty), mask=mask)


def _rows(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` as ``[rows, hidden]`` with a dense last dimension (a view when it can be)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_triton(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One program per row (a row of up to 8K channels fits in registers: 8 warps hold 32 fp32 values a thread)."""
    rows = _rows(hidden)
    out = torch.empty(hidden.shape, dtype=torch.result_type(weight, hidden), device=hidden.device)
    if rows.shape[0] == 0:
        return out
    cols = rows.shape[1]
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, rows.stride(0), cols, cols, eps, BLOCK=block,
                                       num_warps=min(max(block // 512, 1), 16))
    return out


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    if n:
        block = 2048
        _silu_mul_kernel[(triton.cdiv(n, block),)](gate.contiguous(), up.contiguous(), out, n, BLOCK=block,
                                                   num_warps=8, **FP_FUSION)
    return out


def _rms_norm_fake(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty(hidden.shape, dtype=torch.result_type(weight, hidden), device=hidden.device)


def _silu_mul_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


def _check_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul takes gate and up of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")


def _silu_mul_cpu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check_silu_mul(gate, up)
    return silu_mul_reference(gate, up)


def _silu_mul_cuda(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check_silu_mul(gate, up)
    return silu_mul_triton(gate, up)


rms_norm = define_op(
    "rms_norm(Tensor hidden, Tensor weight, float eps) -> Tensor",
    cpu=rms_norm_reference,
    cuda=rms_norm_triton if triton is not None else None,
    fake=_rms_norm_fake,
)

silu_mul = define_op(
    "silu_mul(Tensor gate, Tensor up) -> Tensor",
    cpu=_silu_mul_cpu,
    cuda=_silu_mul_cuda if triton is not None else None,
    fake=_silu_mul_fake,
)
