"""``sparsecompile::rms_norm`` and ``sparsecompile::silu_mul``: the references equal HF's modules' formulas, the
Triton kernels (interpreter on CPU) equal the references at toy sizes, and opcheck."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from sparsecompile.kernels.fused_pointwise import (
    rms_norm,
    rms_norm_reference,
    rms_norm_triton,
    silu_mul,
    silu_mul_reference,
    silu_mul_triton,
)
from sparsecompile.kernels.library import triton_available


def test_rms_norm_reference_is_llama_rmsnorm_bit_for_bit():
    norm = LlamaRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24))
    for dtype in (torch.float32, torch.bfloat16):
        norm.to(dtype)
        x = torch.randn(3, 5, 24).to(dtype)
        assert torch.equal(rms_norm_reference(x, norm.weight, 1e-5), norm(x))


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cols", [64, 40])  # a power of two, and a row the block masks
def test_rms_norm_triton_equals_reference(dtype, cols):
    g = torch.Generator().manual_seed(cols)
    x = (torch.randn(2, 7, cols, generator=g) * 3).to(dtype)
    weight = torch.randn(cols, generator=g).to(dtype)
    got = rms_norm_triton(x, weight, 1e-6)
    want = rms_norm_reference(x, weight, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-6 if dtype == torch.float32 else 2e-3  # fp16: the normalised row's rounding may differ by one ulp
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # a strided input (a slice of a wider buffer) and an fp32 weight under a half input (promotes to fp32)
    wide = torch.randn(5, cols + 8, generator=g).to(dtype)[:, :cols]
    torch.testing.assert_close(rms_norm_triton(wide, weight.float(), 1e-6),
                               rms_norm_reference(wide, weight.float(), 1e-6), atol=tol, rtol=tol)


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_triton_equals_reference(dtype):
    g = torch.Generator().manual_seed(1)
    gate = (torch.randn(3, 2100, generator=g) * 4).to(dtype)  # 6,300 elements: the last block is partial
    up = torch.randn(3, 2100, generator=g).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(silu_mul_triton(gate, up), silu_mul_reference(gate, up), atol=tol, rtol=tol)


def test_ops_opcheck_and_bad_input():
    x = torch.randn(2, 3, 16)
    torch.library.opcheck(torch.ops.sparsecompile.rms_norm.default, (x, torch.randn(16), 1e-6))
    torch.library.opcheck(torch.ops.sparsecompile.silu_mul.default, (torch.randn(4, 8), torch.randn(4, 8)))
    assert torch.equal(rms_norm(x, torch.ones(16), 1e-6), rms_norm_reference(x, torch.ones(16), 1e-6))
    with pytest.raises(ValueError, match="one shape and dtype"):
        silu_mul(torch.randn(4, 8), torch.randn(4, 9))
