"""KIVI ops: the quantization formulas against an independent scalar implementation, the Triton kernels against the
torch references at toy sizes (TRITON_INTERPRET=1 on CPU, fp32: the interpreter's bf16 dot is wrong), the decode
attention against dense attention over the dequantized floats, and torch.library.opcheck on every op."""

from __future__ import annotations

import math

import pytest
import torch

from sparsecompile.kernels import kivi_quant as kq
from sparsecompile.kernels.kivi_attention import (
    kivi_decode_attention_reference,
    kivi_decode_attention_triton,
    kivi_view_kv,
)
from sparsecompile.kernels.library import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def naive_quantize(xs: list[float], bits: int, scale_dtype: torch.dtype) -> tuple[list[int], float, float]:
    """One group, element by element: zero = min, scale = (max - min) / (2^b - 1) stored in ``scale_dtype``,
    code = clamp(floor((x - zero) / scale + 1/2)) against the stored values; returns (codes, scale, zero)."""
    top = 2**bits - 1
    lo, hi = min(xs), max(xs)
    scale = torch.tensor((hi - lo) / top, dtype=torch.float32).to(scale_dtype).item()
    zero = torch.tensor(lo, dtype=torch.float32).to(scale_dtype).item()
    codes = []
    for x in xs:
        if scale == 0:
            codes.append(0)
            continue
        y = torch.tensor(x - zero, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
        codes.append(int(min(max(math.floor(y.item() + 0.5), 0), top)))
    return codes, scale, zero


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_quantize_formulas_match_scalar_implementation(bits, scale_dtype):
    g = torch.Generator().manual_seed(bits)
    group, dim = 8, 16
    key = torch.randn(group, dim, generator=g) * torch.linspace(0.1, 5, dim)  # channels of different ranges
    key[:, 3] = 0.7  # a constant channel: scale 0
    value = torch.randn(group, dim, generator=g)
    codes, scale, zero = kq.quantize_keys(key, bits, scale_dtype)
    for c in range(dim):  # per channel, over the group's slots
        want, s, z = naive_quantize(key[:, c].tolist(), bits, scale_dtype)
        assert codes[:, c].tolist() == want and scale[c].item() == s and zero[c].item() == z
    back = kq.dequantize_keys(codes, scale, zero)
    assert torch.allclose(back[:, 3], torch.full((group,), zero[3].item()))
    assert ((back - key).abs() <= scale.float() / 2 + 1e-2 * scale.float() + 1e-3).all()
    vcodes, vscale, vzero = kq.quantize_values(value, bits, scale_dtype, group)
    for t in range(group):  # per token, over groups of `group` channels
        for j in range(dim // group):
            want, s, z = naive_quantize(value[t, j * group:(j + 1) * group].tolist(), bits, scale_dtype)
            assert vcodes[t, j * group:(j + 1) * group].tolist() == want
            assert vscale[t, j].item() == s and vzero[t, j].item() == z
    got = kq.dequantize_values(vcodes, vscale, vzero)
    want = vcodes.float().view(group, -1, group) * vscale.float()[..., None] + vzero.float()[..., None]
    assert torch.equal(got, want.view(group, dim))


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_roundtrip(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.int32)
    words = kq.pack_codes(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, 5, 64 * bits // 32)
    assert torch.equal(kq.unpack_codes(words, bits), codes)
    # channel c sits in word c // (32 / bits) at bit (c % (32 / bits)) * bits
    c = 37
    per = 32 // bits
    assert int((words[1, 2, c // per].item() >> ((c % per) * bits)) & (2**bits - 1)) == codes[1, 2, c].item()


def make_pages(num_pages=6, heads=2, page=16, group=8, dim=16, bits=2, dtype=torch.float16):
    words = dim * bits // 32
    return (torch.zeros(num_pages, heads, page, words, dtype=torch.int32),
            torch.zeros(num_pages, heads, page, words, dtype=torch.int32),
            torch.zeros(num_pages, heads, page // group, dim, dtype=dtype),
            torch.zeros(num_pages, heads, page // group, dim, dtype=dtype),
            torch.zeros(num_pages, heads, page, dim // group, dtype=dtype),
            torch.zeros(num_pages, heads, page, dim // group, dtype=dtype))


def stored(pages, heads=2, page=16, group=8, bits=2):
    """Write three groups (one skipped) and return the inputs."""
    g = torch.Generator().manual_seed(7)
    key = torch.randn(3, heads, group, pages[2].shape[-1], generator=g) * 3
    value = torch.randn(3, heads, group, pages[2].shape[-1], generator=g)
    dst = torch.tensor([2 * page + group, -1, 4 * page])  # page 2 second group, skipped, page 4 first group
    return key, value, dst


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_reference_stores_the_formulas(bits):
    pages = make_pages(bits=bits)
    key, value, dst = stored(pages, bits=bits)
    kq.kivi_quantize_reference(*pages, key, value, dst)
    kcode, vcode, kscale, kzero, vscale, vzero = pages
    codes, scale, zero = kq.quantize_keys(key[0], bits, torch.float16)  # [H, G, D]
    assert torch.equal(kq.unpack_codes(kcode[2, :, 8:16], bits), codes)
    assert torch.equal(kscale[2, :, 1], scale) and torch.equal(kzero[2, :, 1], zero)
    vcodes, vs, vz = kq.quantize_values(value[2], bits, torch.float16, 8)
    assert torch.equal(kq.unpack_codes(vcode[4, :, :8], bits), vcodes)
    assert torch.equal(vscale[4, :, :8], vs) and torch.equal(vzero[4, :, :8], vz)
    assert not kcode[[0, 1, 3, 5]].any() and not kcode[2, :, :8].any()  # nothing else written
    k, v = kq.kivi_dequantize_reference(*pages, torch.tensor([2, 4]), torch.float32)
    assert torch.equal(k[0, :, 8:16], kq.dequantize_keys(codes, scale, zero))
    assert torch.equal(v[1, :, :8], kq.dequantize_values(vcodes, vs, vz))


@needs_triton
@pytest.mark.parametrize("bits", [2, 4])
def test_triton_quantize_matches_reference(bits):
    ref, tri = make_pages(bits=bits), make_pages(bits=bits)
    key, value, dst = stored(ref, bits=bits)
    kq.kivi_quantize_reference(*ref, key, value, dst)
    kq.kivi_quantize_triton(*tri, key, value, dst)
    for a, b in zip(ref, tri):
        assert torch.equal(a, b)


def decode_case(bits=2, dtype=torch.float32, window=0, seed=0):
    """Two sequences, 2 KV heads x 2 query heads each, page 16, group 8, ring 24: quantized prefix + residual."""
    g = torch.Generator().manual_seed(seed)
    heads, page, group, dim, ring = 2, 16, 8, 16, 24
    pages = make_pages(num_pages=9, heads=heads, page=page, group=group, dim=dim, bits=bits)
    lengths = torch.tensor([[53, 53], [20, 20]])
    quantized = torch.tensor([32, 0])
    index = torch.tensor([[[3, 0, 7, 5], [3, 0, 7, 5]], [[1, 8, 0, 0], [1, 8, 0, 0]]], dtype=torch.int32)
    for p in (3, 0):  # row 0's quantized prefix: pages 3 and 0
        for start in range(0, page, group):
            key = torch.randn(1, heads, group, dim, generator=g) + torch.linspace(-2, 2, dim)
            value = torch.randn(1, heads, group, dim, generator=g)
            kq.kivi_quantize_reference(*pages, key, value, torch.tensor([p * page + start]))
    pos_pool = torch.full((9, heads, page), -1, dtype=torch.int32)
    for b in range(2):
        for j in range(int(lengths[b, 0])):
            pos_pool[index[b, 0, j // page], :, j % page] = j
    pos_pool[0, 1, 4] = -1  # an emptied slot (a hole) in the quantized prefix of head 1
    ring_k = torch.randn(5, heads, ring, dim, generator=g).to(dtype)
    ring_v = torch.randn(5, heads, ring, dim, generator=g).to(dtype)
    query = torch.randn(2, 2 * heads, 1, dim, generator=g).to(dtype)
    q_positions = torch.tensor([[53], [20]])
    return (query, *pages, pos_pool, ring_k, ring_v, torch.tensor([3, 1]), index, lengths, quantized, q_positions,
            0.25, window)


@pytest.mark.parametrize("window", [0, 12])
def test_decode_reference_equals_dense_attention_over_dequantized_floats(window):
    args = decode_case(window=window)
    query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, rows, index, lengths, quant, qpos = \
        args[:15]
    got = kivi_decode_attention_reference(*args)
    for b in range(2):
        n = int(lengths[b, 0])
        for h in range(2):
            keys, values = [], []
            for j in range(n):
                page = int(index[b, h, j // 16])
                if j < int(quant[b]):
                    k, v = kq.kivi_dequantize_reference(kcode, vcode, kscale, kzero, vscale, vzero,
                                                        torch.tensor([page]), torch.float32)
                    keys.append(k[0, h, j % 16])
                    values.append(v[0, h, j % 16])
                else:
                    keys.append(ring_k[rows[b], h, j % 24].float())
                    values.append(ring_v[rows[b], h, j % 24].float())
            pos = torch.stack([pos_pool[index[b, h, j // 16], h, j % 16] for j in range(n)]).long()
            ok = (pos >= 0) & (pos <= qpos[b, 0]) & ((pos > qpos[b, 0] - window) if window else True)
            k, v = torch.stack(keys)[ok], torch.stack(values)[ok]
            for g in range(2):
                q = query[b, 2 * h + g, 0].float()
                want = torch.softmax(k @ q * 0.25, 0) @ v
                torch.testing.assert_close(got[b, 0, 2 * h + g].float(), want, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_matches_reference(bits, splits):
    args = decode_case(bits=bits, window=12 if splits == 3 else 0, seed=bits)
    want = kivi_decode_attention_reference(*args)
    got = kivi_decode_attention_triton(*args, num_splits=splits, config={"block_f": 16})
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_view_kv_shapes_and_ring_rows():
    args = decode_case()
    k, v, pos, valid = kivi_view_kv(*args[1:14], span=53)
    assert k.shape == (2, 2, 53, 16) and pos.shape == (2, 2, 53) and valid[1, 0].sum() == 20
    assert torch.equal(k[1, 1, 5], args[8][1, 1, 5].float())  # row 1 reads ring row 1 at slot 5 % 24
    assert (pos[1, :, 20:] == -1).all()


def test_opcheck_kivi_ops():
    pages = make_pages()
    key, value, dst = stored(pages)
    torch.library.opcheck(torch.ops.sparsecompile.kivi_quantize.default, (*pages, key, value, dst))
    torch.library.opcheck(torch.ops.sparsecompile.kivi_dequantize.default,
                          (*pages, torch.tensor([[2, 4]]), torch.float32))
    torch.library.opcheck(torch.ops.sparsecompile.kivi_decode_attention.default, decode_case())
