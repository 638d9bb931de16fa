"""KIVI ops: the quantization formulas against an independent scalar implementation, the Triton kernels against the
torch references at toy sizes (TRITON_INTERPRET=1 on CPU, fp32: the interpreter's bf16 dot is wrong), the decode
attention against dense attention over the dequantized floats, and torch.library.opcheck on every op."""

from __future__ import annotations

import math

import pytest
import torch

from sparsecompile.kernels import kivi_quant as kq
from sparsecompile.kernels.kivi_attention import kivi_decode_attention_triton
from sparsecompile.kernels.kivi_reference import (
    kivi_decode_attention_logits_reference,
    kivi_decode_attention_reference,
    kivi_view_kv,
)
from sparsecompile.kernels.kivi_triton import fast_path_supported, wave_splits
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
    # channel c sits in byte c % B (B = 64 * bits / 8 bytes a slot) at bit (c // B) * bits; byte j in word j // 4
    # at bit (j % 4) * 8
    nbytes = 64 * bits // 8
    for c in (0, 5, 37, 63):
        j, shift = c % nbytes, (c // nbytes) * bits
        word = int(words[1, 2, j // 4].item()) & 0xFFFFFFFF
        assert (word >> ((j % 4) * 8 + shift)) & (2**bits - 1) == codes[1, 2, c].item()


# Toy sizes the Triton kernels accept (the decode kernel's chunks: 16 channels, over one (2-bit) or two (4-bit)
# 16-byte blocks): page 32, group 16, dim 64.
PAGE, GROUP, DIM, HEADS, RING = 32, 16, 64, 2, 48


def make_pages(num_pages=10, bits=2, dtype=torch.float16):
    return kq.empty_pages(num_pages, HEADS, PAGE, DIM, bits, GROUP, dtype)


def stored(seed=7):
    """Three groups to write (the second skipped): page 2's second group, page 4's first."""
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(3, HEADS, GROUP, DIM, generator=g) * 3 + torch.linspace(-4, 4, DIM)
    value = torch.randn(3, HEADS, GROUP, DIM, generator=g)
    key[0, 1, :, 5] = 1.25  # a constant channel: scale 0
    return key, value, torch.tensor([2 * PAGE + GROUP, -1, 4 * PAGE])


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_reference_stores_the_formulas(bits):
    pages = make_pages(bits=bits)
    key, value, dst = stored()
    kq.kivi_quantize_reference(*pages, key, value, dst)
    kcode, vcode, kscale, kzero, vscale, vzero = pages
    codes, scale, zero = kq.quantize_keys(key[0], bits, torch.float16)  # [H, G, D]
    assert torch.equal(kq.unpack_codes(kcode[2, :, GROUP:2 * GROUP], bits), codes)
    assert torch.equal(kscale[2, :, 1], scale) and torch.equal(kzero[2, :, 1], zero)
    vcodes, vs, vz = kq.quantize_values(value[2], bits, torch.float16, GROUP)
    assert torch.equal(kq.unpack_value_groups(vcode[4], bits)[:, :GROUP], vcodes)  # byte-major groups
    assert torch.equal(vcode[4, :, 0].view(torch.uint8), kq.pack_codes(vcodes, bits).view(torch.uint8).mT)
    vs_, vz_ = kq.slot_major(vscale), kq.slot_major(vzero)
    assert torch.equal(vs_[4, :, :GROUP], vs) and torch.equal(vz_[4, :, :GROUP], vz)
    written = torch.zeros(kcode.shape[:3], dtype=torch.bool)
    written[2, :, GROUP:2 * GROUP] = written[4, :, :GROUP] = True
    assert not kcode[~written].any() and not vs_[~written].any()  # nothing else written
    assert not vcode[~written[:, :, ::GROUP]].any()
    k, v = kq.kivi_dequantize_reference(*pages, torch.tensor([2, 4]), torch.float32)
    assert torch.equal(k[0, :, GROUP:2 * GROUP], kq.dequantize_keys(codes, scale, zero))
    assert torch.equal(v[1, :, :GROUP], kq.dequantize_values(vcodes, vs, vz))


@pytest.mark.parametrize("bits", [2, 4])
def test_value_groups_are_byte_major(bits):
    """``vcode``'s layout, which the Gluon and Triton decode kernels read: byte ``j`` of a group's slots together,
    channel ``k * B + j`` at bit ``k * bits`` of byte ``j``; unpacking pages gives the codes back in slot order."""
    codes = torch.randint(0, 2 ** bits, (3, HEADS, GROUP, DIM))
    nbytes = DIM * bits // 8
    words = kq.pack_value_groups(codes, bits)
    assert words.shape == (3, HEADS, nbytes, GROUP // 4) and words.dtype == torch.int32
    byte = words.view(torch.uint8).long()  # [.., B, G]
    for k in range(8 // bits):
        assert torch.equal((byte >> (k * bits)) & (2 ** bits - 1), codes[..., k * nbytes:(k + 1) * nbytes].mT)
    assert torch.equal(kq.unpack_value_groups(words[:, :, None], bits), codes)  # pages of one group
    shapes = kq.page_shapes(5, HEADS, PAGE, DIM, bits, GROUP)  # every page tensor indexed by page first, same bytes
    assert [sh[0] for sh in shapes] == [5] * 6
    assert math.prod(shapes[0]) == math.prod(shapes[1]) and math.prod(shapes[4]) == 5 * HEADS * PAGE * DIM // GROUP


@needs_triton
@pytest.mark.parametrize("bits", [2, 4])
def test_triton_quantize_matches_reference(bits):
    # fp16 scales: the interpreter casts to bf16 by truncation, the GPU (and torch) round to nearest
    # (bf16 scales: tests/gpu/test_kivi_cuda.py)
    scale_dtype = torch.float16
    ref, tri = make_pages(bits=bits, dtype=scale_dtype), make_pages(bits=bits, dtype=scale_dtype)
    key, value, dst = stored(bits)
    kq.kivi_quantize_reference(*ref, key, value, dst)
    kq.kivi_quantize_triton(*tri, key, value, dst)
    for a, b in zip(ref, tri):
        assert torch.equal(a, b)


def decode_case(bits=2, dtype=torch.float32, window=0, seed=0, long=150):
    """Two sequences, 2 KV heads x 2 query heads each: ``long`` slots (up to 112 quantized over pages 3, 0 and half
    of 7, the rest in ring row 3) and 40 slots all in ring row 1; a hole in head 1's quantized prefix."""
    g = torch.Generator().manual_seed(seed)
    pages = make_pages(bits=bits)
    lengths = torch.tensor([[long, long], [40, 40]])
    quantized = torch.tensor([min(112, (long - 1) // GROUP * GROUP), 0])
    index = torch.tensor([[[3, 0, 7, 5, 2]] * 2, [[1, 8, 0, 0, 0]] * 2], dtype=torch.int32)
    for p, start in ((3, 0), (3, GROUP), (0, 0), (0, GROUP), (7, 0)):
        key = torch.randn(1, HEADS, GROUP, DIM, generator=g) + torch.linspace(-2, 2, DIM)
        value = torch.randn(1, HEADS, GROUP, DIM, generator=g)
        kq.kivi_quantize_reference(*pages, key, value, torch.tensor([p * PAGE + start]))
    pos_pool = torch.full((10, HEADS, PAGE), -1, dtype=torch.int32)
    for b in range(2):
        for j in range(int(lengths[b, 0])):
            pos_pool[index[b, 0, j // PAGE], :, j % PAGE] = j
    pos_pool[0, 1, 4] = -1  # an emptied slot (a hole) in the quantized prefix of head 1
    ring_k = torch.randn(5, HEADS, RING, DIM, generator=g).to(dtype)
    ring_v = torch.randn(5, HEADS, RING, DIM, generator=g).to(dtype)
    query = torch.randn(2, 2 * HEADS, 1, DIM, generator=g).to(dtype)
    q_positions = torch.tensor([[long], [40]])
    return (query, *pages, pos_pool, ring_k, ring_v, torch.tensor([3, 1]), index, lengths, quantized, q_positions,
            0.25, window)


@pytest.mark.parametrize("window", [0, 60])
def test_decode_reference_equals_dense_attention_over_dequantized_floats(window):
    args = decode_case(window=window)
    query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, rows, index, lengths, quant, qpos = \
        args[:15]
    got = kivi_decode_attention_reference(*args)
    deq_k, deq_v = kq.kivi_dequantize_reference(kcode, vcode, kscale, kzero, vscale, vzero, torch.arange(10),
                                                torch.float32)  # every page, [pages, H, P, D]
    for b in range(2):
        n = int(lengths[b, 0])
        j = torch.arange(n)
        for h in range(2):
            pages = index[b, h, j // PAGE].long()
            quantized = (j < quant[b])[:, None]
            k = torch.where(quantized, deq_k[pages, h, j % PAGE], ring_k[rows[b], h, j % RING].float())
            v = torch.where(quantized, deq_v[pages, h, j % PAGE], ring_v[rows[b], h, j % RING].float())
            pos = pos_pool[pages, h, j % PAGE].long()
            ok = (pos >= 0) & (pos <= qpos[b, 0]) & ((pos > qpos[b, 0] - window) if window else True)
            for g in range(2):
                q = query[b, 2 * h + g, 0].float()
                want = torch.softmax(k[ok] @ q * 0.25, 0) @ v[ok]
                torch.testing.assert_close(got[b, 0, 2 * h + g].float(), want, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("bits,splits", [(2, 3), (4, 1), (2, 2)])
def test_triton_decode_matches_reference(bits, splits):
    args = decode_case(bits=bits, window=60 if splits == 3 else 0, seed=bits)
    assert fast_path_supported(GROUP, DIM, bits)  # the Triton kernel runs, not its fallback
    want = kivi_decode_attention_reference(*args)
    got = kivi_decode_attention_triton(*args, num_splits=splits, config={"block_f": 16})
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("bits,splits,rsplits", [(2, 2, 4), (4, 1, 3)])
def test_triton_decode_with_the_ring_a_program_a_block_matches_reference(bits, splits, rsplits):
    """The Gluon launch's arrangement on the Triton kernel: ``splits`` splits of the quantized slots, then the ring's
    blocks a program each, in a second launch from split ``splits`` on (as beside the Gluon kernel). Blocks of 16
    slots: sequence 0's 38 or 18 residual slots over three or two of them, sequence 1's 40 over three; the rest
    empty."""
    for long in (150, 130):  # 38 / 18 slots in the ring (112 quantized): partial last blocks of 6 and 2
        args = decode_case(bits=bits, window=60 if splits == 2 else 0, seed=bits, long=long)
        want = kivi_decode_attention_reference(*args)
        got = kivi_decode_attention_triton(*args, num_splits=splits, config={"block_f": 16}, residual_splits=rsplits)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    args = decode_case(bits=bits, seed=bits)
    got = kivi_decode_attention_triton(*args, num_splits=splits, config={"block_f": 16}, residual_splits=rsplits,
                                       with_logits=True)  # output, log-sum-exp and logits
    for g, w in zip(got, kivi_decode_attention_logits_reference(*args)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [0, 60])
def test_logits_reference_gives_each_slots_probability(window):
    """The logits op (H2O over KIVI): the same output as the attention; ``exp(logits - lse)`` is, per query head and
    view position, the softmax probability of the dequantized key (0 where unseen: past the list, the emptied slot,
    outside the window), and the probabilities sum to one."""
    args = decode_case(window=window)
    query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, rows, index, lengths, quant, qpos = \
        args[:15]
    out, lse, logits = kivi_decode_attention_logits_reference(*args)
    torch.testing.assert_close(out, kivi_decode_attention_reference(*args), atol=1e-6, rtol=1e-6)
    span = index.shape[2] * PAGE
    assert logits.shape == (2, 2 * HEADS, span) and lse.shape == (2, 2 * HEADS, 1)
    k, _, pos, valid = kivi_view_kv(*args[1:14], span=span)
    for b in range(2):
        for qh in range(2 * HEADS):
            h, q = qh // 2, query[b, qh, 0].float()
            ok = valid[b, h] & (pos[b, h] >= 0) & (pos[b, h] <= qpos[b, 0])
            if window:
                ok &= pos[b, h] > qpos[b, 0] - window
            want = torch.where(ok, torch.softmax(torch.where(ok, k[b, h] @ q * 0.25, -math.inf), 0), 0.0)
            torch.testing.assert_close((logits[b, qh] - lse[b, qh]).exp(), want, atol=1e-6, rtol=1e-5)
            assert torch.isneginf(logits[b, qh][~ok]).all()


@needs_triton
@pytest.mark.parametrize("bits,splits", [(2, 3), (4, 1)])
def test_triton_logits_match_reference(bits, splits):
    """The kernel's logits and log-sum-exp (one split: written by the kernel; three: by the combine) against the
    reference, -inf at the same places."""
    args = decode_case(bits=bits, window=60 if splits == 3 else 0, seed=bits)
    want = kivi_decode_attention_logits_reference(*args)
    got = kivi_decode_attention_triton(*args, num_splits=splits, config={"block_f": 16}, with_logits=True)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
    assert torch.equal(torch.isneginf(got[2]), torch.isneginf(want[2]))


def test_wave_splits_fill_one_wave_from_below():
    """The launch's split count (an H200's 132 SMs off CUDA): one wave of 8 programs an SM, rounded down, each split at
    least ``min_slots`` long, never zero."""
    cpu = torch.device("cpu")
    assert wave_splits(8, 32768, 128, 8, cpu) == 132  # 32K x 1: 1,056 programs
    assert wave_splits(128, 32768, 128, 8, cpu) == 8  # 32K x 16: 1,024, not 9 x 128 = 1,152 (a wave and a tail)
    assert wave_splits(32, 131072, 128, 8, cpu) == 33  # 128K x 4
    assert wave_splits(8, 1000, 128, 8, cpu) == 8  # short lists: capped by the slots
    assert wave_splits(2048, 131072, 128, 8, cpu) == 1  # more lists than a wave


def test_reference_over_the_whole_capacity_is_sync_free_and_equal():
    """The CUDA fallback (shapes the Triton kernel does not take) rebuilds every slot of the view's capacity rather
    than reading the longest list's length on the host, which a CUDA graph capture forbids: same result."""
    args = decode_case()
    capacity = args[11].shape[2] * PAGE
    torch.testing.assert_close(kivi_decode_attention_reference(*args, span=capacity),
                               kivi_decode_attention_reference(*args), atol=1e-6, rtol=1e-6)
    assert not fast_path_supported(GROUP, 32, 2)  # e.g. head dim 32 at 2 bits: 8-channel chunks, below tl.dot's 16


def test_view_kv_shapes_and_ring_rows():
    args = decode_case()
    k, v, pos, valid = kivi_view_kv(*args[1:14], span=150)
    assert k.shape == (2, HEADS, 150, DIM) and pos.shape == (2, HEADS, 150) and valid[1, 0].sum() == 40
    assert torch.equal(k[1, 1, 5], args[8][1, 1, 5].float())  # row 1 reads ring row 1 at slot 5 % RING
    assert torch.equal(k[0, 0, 130], args[8][3, 0, 130 % RING].float())  # row 0: ring row 3
    assert (pos[1, :, 40:] == -1).all()


def test_opcheck_kivi_ops():
    pages = make_pages()
    key, value, dst = stored()
    torch.library.opcheck(torch.ops.sparsecompile.kivi_quantize.default, (*pages, key, value, dst))
    torch.library.opcheck(torch.ops.sparsecompile.kivi_dequantize.default,
                          (*pages, torch.tensor([[2, 4]]), torch.float32))
    torch.library.opcheck(torch.ops.sparsecompile.kivi_decode_attention.default, decode_case(long=40))
    torch.library.opcheck(torch.ops.sparsecompile.kivi_decode_attention.default, (*decode_case(long=40), True))
    torch.library.opcheck(torch.ops.sparsecompile.kivi_decode_attention_logits.default, decode_case(long=40))
    torch.library.opcheck(torch.ops.sparsecompile.kivi_decode_attention.default,
                          (*decode_case(long=150), False, *selection_case()))


def selection_case():
    """A selection over ``decode_case()``'s quantized slots: sequence 0 reads one of its two full pages per head (row-
    local 1 = pool page 0 in head 0, row-local 0 = page 3 in head 1) and its boundary page 7's quantized group, 48
    slots; sequence 1 has nothing quantized."""
    return torch.tensor([[[0, 7], [3, 7]], [[0, 0], [0, 0]]], dtype=torch.int32), torch.tensor([48, 0])


@pytest.mark.parametrize("window", [0, 60])
def test_selected_reference_equals_attention_over_the_chosen_pages_and_the_residual(window):
    """Quest over KIVI pages: the op reads the selection's slots in place of the quantized ones, then the residual;
    checked against softmax attention over exactly those dequantized slots, built slot by slot. Selecting every
    quantized slot gives the op without a selection."""
    args = decode_case(window=window)
    query, kcode, vcode, kscale, kzero, vscale, vzero, pos_pool, ring_k, ring_v, rows, index, lengths, quant, qpos = \
        args[:15]
    pick, count = selection_case()
    got = kivi_decode_attention_reference(*args, quant_index=pick, quant_count=count)
    deq_k, deq_v = kq.kivi_dequantize_reference(kcode, vcode, kscale, kzero, vscale, vzero, torch.arange(10),
                                                torch.float32)
    for b in range(2):
        for h in range(2):
            slots = [(int(pick[b, h, j // PAGE]), j % PAGE) for j in range(int(count[b]))]
            k = [deq_k[p, h, o] for p, o in slots]
            v = [deq_v[p, h, o] for p, o in slots]
            pos = [int(pos_pool[p, h, o]) for p, o in slots]
            for j in range(int(quant[b]), int(lengths[b, h])):  # the residual, from the ring
                k.append(ring_k[rows[b], h, j % RING].float())
                v.append(ring_v[rows[b], h, j % RING].float())
                pos.append(int(pos_pool[index[b, h, j // PAGE], h, j % PAGE]))
            pos_t = torch.tensor(pos)
            ok = (pos_t >= 0) & (pos_t <= qpos[b, 0]) & ((pos_t > qpos[b, 0] - window) if window else True)
            k, v = torch.stack(k)[ok], torch.stack(v)[ok]
            for g in range(2):
                want = torch.softmax(k @ query[b, 2 * h + g, 0].float() * 0.25, 0) @ v
                torch.testing.assert_close(got[b, 0, 2 * h + g].float(), want, atol=1e-5, rtol=1e-5)
    everything = index[..., :4], quant  # pages 3, 0, 7 (and 5, past the count): every quantized slot
    torch.testing.assert_close(kivi_decode_attention_reference(*args, quant_index=everything[0],
                                                               quant_count=everything[1]),
                               kivi_decode_attention_reference(*args), atol=1e-6, rtol=1e-6)


@needs_triton
@pytest.mark.parametrize("bits,splits", [(2, 2), (4, 1)])
def test_triton_decode_over_a_selection_matches_reference(bits, splits):
    """The quantized splits launched on the selection's pages, the ring's blocks on the list's residual."""
    args = decode_case(bits=bits, window=60 if splits == 2 else 0, seed=bits)
    pick, count = selection_case()
    want = kivi_decode_attention_reference(*args, quant_index=pick, quant_count=count)
    got = kivi_decode_attention_triton(*args, False, pick, count, num_splits=splits, config={"block_f": 16})
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="logits of a selection"):
        kivi_decode_attention_triton(*args, False, pick, count, with_logits=True)
