"""KIVI quantization of KV pages: ``sparsecompile::kivi_quantize`` (quantize-on-write) and ``kivi_dequantize``.

Formulas (KIVI, Liu et al. 2024, https://arxiv.org/abs/2402.02750; reference jy-yuan/KIVI): asymmetric
round-to-nearest with ``2^bits`` levels. For a group ``x`` of numbers, ``zero = min(x)``,
``scale = (max(x) - min(x)) / (2^bits - 1)``, both stored in a 16-bit float (fp16 or bf16), and
``code = clamp(floor((x - zero) / scale + 1/2), 0, 2^bits - 1)`` computed with the *stored* (rounded) scale and
zero (code 0 when the scale is 0); dequantized ``x' = code * scale + zero`` in fp32.

* keys are quantized **per channel** over a group of ``group_size`` consecutive slots (one scale and zero per
  (group, channel));
* values **per token** over groups of ``group_size`` consecutive channels (one scale and zero per (token, group)).

Page layout (every tensor indexed by page first, like the dense pool, so page sharing and copy-on-write treat them
alike; ``P`` slots per page, a multiple of ``G = group_size``, so groups never straddle pages). A slot's ``D`` codes
take ``B = D * bits / 8`` bytes, channel ``c`` in byte ``c % B`` at bit ``(c // B) * bits``: the codes at one bit
offset of every byte are ``B`` consecutive channels (a decode kernel's channel chunk, never crossing a value group).

* ``kcode [num_pages, kv_heads, P, W]`` int32: each slot's bytes as ``W = B / 4`` little-endian words (keys are
  the MMA operand whose contraction runs over channels: a slot's bytes together);
* ``vcode [num_pages, kv_heads, P / G, B, G / 4]`` int32: per group of ``G`` slots, **byte-major**: byte ``j`` of
  the group's slots ``0 .. G-1`` together (``uint8`` view ``[.., B, G]``), because the values' MMA contracts over
  slots and takes each thread's consecutive slots in one load (:func:`pack_value_groups`);
* ``kscale, kzero [num_pages, kv_heads, P / G, D]``: one per key group and channel;
* ``vscale, vzero [num_pages, kv_heads, D / G, P]``: one per slot and channel group, a page's slots together per
  channel group (:func:`slot_major` gives the ``[.., P, D / G]`` view).

The rounding is half up (``floor(y + 1/2)``), the same in the torch reference and the Triton kernel.
"""

from __future__ import annotations

import torch

from .library import define_op
from .tiles import FP_FUSION

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


# ----------------------------------------------------------------------------------------------- formulas (torch)
def levels(bits: int) -> int:
    return (1 << bits) - 1


def _quantize(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, bits: int,
              scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of fp32 ``x`` against (broadcastable) group minima / maxima; returns (codes int32, scale, zero)."""
    scale = ((mx - mn) / levels(bits)).to(scale_dtype)
    zero = mn.to(scale_dtype)
    s, z = scale.float(), zero.float()
    q = torch.where(s > 0, torch.floor((x - z) / torch.where(s > 0, s, 1.0) + 0.5), 0.0)
    return q.clamp(0, levels(bits)).to(torch.int32), scale, zero


def quantize_keys(key: torch.Tensor, bits: int, scale_dtype: torch.dtype):
    """``key [..., G, D]`` (one group of G slots) -> codes ``[..., G, D]``, scale and zero ``[..., D]``."""
    k = key.float()
    codes, scale, zero = _quantize(k, k.amin(-2, keepdim=True), k.amax(-2, keepdim=True), bits, scale_dtype)
    return codes, scale.squeeze(-2), zero.squeeze(-2)


def quantize_values(value: torch.Tensor, bits: int, scale_dtype: torch.dtype, group: int):
    """``value [..., D]`` -> codes ``[..., D]``, scale and zero ``[..., D / group]`` (per token, channel groups)."""
    v = value.float().unflatten(-1, (value.shape[-1] // group, group))
    codes, scale, zero = _quantize(v, v.amin(-1, keepdim=True), v.amax(-1, keepdim=True), bits, scale_dtype)
    return codes.flatten(-2), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes ``[..., G, D]``, scale / zero ``[..., D]`` -> fp32 ``[..., G, D]``."""
    return codes.float() * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes ``[..., D]``, scale / zero ``[..., D / g]`` -> fp32 ``[..., D]``."""
    group = codes.shape[-1] // scale.shape[-1]
    c = codes.float().unflatten(-1, (scale.shape[-1], group))
    return (c * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` codes in ``[0, 2^bits)`` -> ``[..., D * bits / 32]`` int32 (module docstring's byte layout)."""
    per_byte = 8 // bits
    c = codes.long().unflatten(-1, (per_byte, codes.shape[-1] // per_byte))  # [..., k, B]: channel k * B + j
    shifts = torch.arange(per_byte, device=codes.device)[:, None] * bits
    return (c << shifts).sum(-2).to(torch.uint8).contiguous().view(torch.int32)


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[..., W]`` int32 -> ``[..., W * 32 / bits]`` int32 codes."""
    per_byte = 8 // bits
    b = words.contiguous().view(torch.uint8).to(torch.int32)  # [..., B]
    shifts = torch.arange(per_byte, device=words.device, dtype=torch.int32)[:, None] * bits
    return ((b.unsqueeze(-2) >> shifts) & levels(bits)).flatten(-2)


def page_shapes(num_pages: int, heads: int, page: int, dim: int, bits: int,
                group: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of ``kcode, vcode, kscale, kzero, vscale, vzero`` (module docstring; codes int32, the rest in the scale
    dtype)."""
    nbytes = dim * bits // 8
    return ((num_pages, heads, page, nbytes // 4), (num_pages, heads, page // group, nbytes, group // 4),
            (num_pages, heads, page // group, dim), (num_pages, heads, page // group, dim),
            (num_pages, heads, dim // group, page), (num_pages, heads, dim // group, page))


def empty_pages(num_pages: int, heads: int, page: int, dim: int, bits: int, group: int, scale_dtype: torch.dtype,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Zeroed page tensors (:func:`page_shapes`)."""
    shapes = page_shapes(num_pages, heads, page, dim, bits, group)
    return tuple(torch.zeros(sh, dtype=torch.int32 if i < 2 else scale_dtype, device=device)
                 for i, sh in enumerate(shapes))


def pack_value_groups(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Value codes of whole groups ``[..., G, D]`` -> the byte-major words of ``vcode`` ``[..., B, G / 4]``."""
    if codes.numel() == 0:  # (no dtype view of an empty tensor's strides)
        return codes.new_zeros((*codes.shape[:-2], codes.shape[-1] * bits // 8, codes.shape[-2] // 4))
    return pack_codes(codes, bits).view(torch.uint8).transpose(-1, -2).contiguous().view(torch.int32)


def unpack_value_groups(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_value_groups` over pages: ``vcode`` words ``[..., P / G, B, G / 4]`` -> codes
    ``[..., P, D]`` in slot order."""
    b = words.contiguous().view(torch.uint8).transpose(-1, -2)  # [..., P / G, G, B]
    return unpack_codes(b.flatten(-3, -2).contiguous().view(torch.int32), bits)


def slot_major(meta: torch.Tensor) -> torch.Tensor:
    """``vscale`` / ``vzero`` ``[.., D / G, P]`` as the ``[.., P, D / G]`` view (reads and writes go to the pool)."""
    return meta.transpose(-1, -2)


def storage_bits(kcode: torch.Tensor, head_dim: int) -> int:
    return kcode.shape[-1] * 32 // head_dim


# ----------------------------------------------------------------------------------------------- quantize-on-write
def kivi_quantize_reference(kcode: torch.Tensor, vcode: torch.Tensor, kscale: torch.Tensor, kzero: torch.Tensor,
                            vscale: torch.Tensor, vzero: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            dst: torch.Tensor) -> None:
    """Quantize whole key groups into pages (torch reference).

    Args:
        kcode ... vzero: the page tensors (module docstring), written in place.
        key, value: ``[M, kv_heads, G, D]`` the groups to store (any float dtype; math in fp32).
        dst: ``[M]`` int64 global slot of each group's first slot (``page * P + offset``, offset a multiple of G);
            -1 skips the group.
    """
    m, heads, group, dim = key.shape
    if m == 0:
        return
    bits = storage_bits(kcode, dim)
    page_size = kcode.shape[2]
    keep = dst >= 0
    d = dst[keep]
    page, off = d // page_size, d % page_size
    kc, ks, kz = quantize_keys(key[keep], bits, kscale.dtype)
    vc, vs, vz = quantize_values(value[keep], bits, vscale.dtype, group)
    slots = off[:, None] + torch.arange(group, device=dst.device)  # [n, G]
    rows = page[:, None].expand_as(slots)
    kcode[rows, :, slots] = pack_codes(kc, bits).transpose(1, 2)  # [n, G, H, W]
    vcode[page, :, off // group] = pack_value_groups(vc, bits)  # [n, H, B, G / 4]
    slot_major(vscale)[rows, :, slots] = vs.transpose(1, 2)
    slot_major(vzero)[rows, :, slots] = vz.transpose(1, 2)
    kscale[page, :, off // group] = ks
    kzero[page, :, off // group] = kz


if triton is not None:

    @triton.jit
    def _round_codes(x, mn, mx, LEVELS: tl.constexpr, SCALE_TY: tl.constexpr):
        """fp32 ``x`` with broadcastable group min / max -> (codes int32, scale, zero) in ``SCALE_TY``."""
        span = mx - mn
        scale = tl.math.div_rn(span, tl.zeros_like(span) + LEVELS).to(SCALE_TY)  # rounded division, as torch's
        zero = mn.to(SCALE_TY)
        s = scale.to(tl.float32)
        z = zero.to(tl.float32)
        y = tl.math.div_rn(x - z, tl.where(s > 0.0, s, 1.0))
        q = tl.where(s > 0.0, tl.floor(y + 0.5), 0.0)
        q = tl.minimum(tl.maximum(q, 0.0), LEVELS)
        return q.to(tl.int32), scale, zero

    @triton.jit
    def _pack_bytes(codes, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
        """``[ROWS, D]`` codes -> ``[ROWS, B]`` bytes (as int32; ``B = D * BITS / 8``): channel ``k * B + j`` at bit
        ``k * BITS`` of byte ``j`` (the module docstring's byte layout)."""
        PER_BYTE: tl.constexpr = 8 // BITS
        B: tl.constexpr = D * BITS // 8
        c = tl.reshape(codes, (ROWS, PER_BYTE, B))
        return tl.sum(c << (tl.arange(0, PER_BYTE) * BITS)[None, :, None], axis=1)

    @triton.jit
    def _pack(codes, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
        """``[ROWS, D]`` codes -> ``[ROWS, D * BITS / 32]`` int32 words, the bytes of :func:`_pack_bytes`
        little-endian."""
        W: tl.constexpr = D * BITS // 32
        b = tl.reshape(_pack_bytes(codes, ROWS, D, BITS), (ROWS, W, 4))
        return tl.sum(b << (tl.arange(0, 4) * 8)[None, None, :], axis=2)

    @triton.jit
    def _quantize_kernel(KC, VC, KS, KZ, VS, VZ, K, V, DST, stride_km, stride_kh, stride_kt, stride_vm, stride_vh,
                         stride_vt, KV_HEADS: tl.constexpr, PAGE: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                         BITS: tl.constexpr, SCALE_TY: tl.constexpr):
        """One program: one group of G slots of one KV head."""
        m = tl.program_id(0)
        h = tl.program_id(1)
        dst = tl.load(DST + m)
        if dst >= 0:
            W: tl.constexpr = D * BITS // 32
            LEVELS: tl.constexpr = (1 << BITS) - 1
            page = dst // PAGE
            off = dst % PAGE
            t = tl.arange(0, G)
            d = tl.arange(0, D)
            k = tl.load(K + m * stride_km + h * stride_kh + t[:, None] * stride_kt + d[None, :]).to(tl.float32)
            v = tl.load(V + m * stride_vm + h * stride_vh + t[:, None] * stride_vt + d[None, :]).to(tl.float32)
            slot = (page * KV_HEADS + h) * PAGE + off + t  # [G] rows of the [pages, heads, P] layout
            w = tl.arange(0, W)
            # keys: per channel over the group's slots
            kq, ks, kz = _round_codes(k, tl.min(k, axis=0)[None, :], tl.max(k, axis=0)[None, :], LEVELS, SCALE_TY)
            tl.store(KC + slot[:, None] * W + w[None, :], _pack(kq, G, D, BITS))
            grp = (page * KV_HEADS + h) * (PAGE // G) + off // G
            tl.store(KS + grp * D + d, tl.reshape(ks, (D,)))
            tl.store(KZ + grp * D + d, tl.reshape(kz, (D,)))
            # values: per token over groups of G channels
            v3 = tl.reshape(v, (G, D // G, G))
            vq, vs, vz = _round_codes(v3, tl.min(v3, axis=2)[:, :, None], tl.max(v3, axis=2)[:, :, None], LEVELS,
                                      SCALE_TY)
            B: tl.constexpr = D * BITS // 8
            j = tl.arange(0, B)  # VC: bytes, the group's block [B, G] byte-major
            tl.store(VC + grp * (B * G) + j[None, :] * G + t[:, None],
                     _pack_bytes(tl.reshape(vq, (G, D)), G, D, BITS).to(tl.uint8))
            gi = tl.arange(0, D // G)  # VS / VZ [pages, heads, D / G, P]
            meta = ((page * KV_HEADS + h) * (D // G) + gi[None, :]) * PAGE + off + t[:, None]
            tl.store(VS + meta, tl.reshape(vs, (G, D // G)))
            tl.store(VZ + meta, tl.reshape(vz, (G, D // G)))


def _scale_type(dtype: torch.dtype):
    return tl.float16 if dtype == torch.float16 else tl.bfloat16


def triton_supported(group: int, head_dim: int) -> bool:
    """The Triton kernels tile whole groups and head dims: both powers of two, at least 16."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0
    return pow2(group) and pow2(head_dim)


def kivi_quantize_triton(kcode, vcode, kscale, kzero, vscale, vzero, key, value, dst) -> None:
    m, heads, group, dim = key.shape
    if m == 0:
        return
    if not triton_supported(group, dim):
        return kivi_quantize_reference(kcode, vcode, kscale, kzero, vscale, vzero, key, value, dst)
    if key.stride(3) != 1:
        key = key.contiguous()
    if value.stride(3) != 1:
        value = value.contiguous()
    _quantize_kernel[(m, heads)](
        kcode, vcode.view(torch.uint8), kscale, kzero, vscale, vzero, key, value, dst.contiguous(),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        KV_HEADS=heads, PAGE=kcode.shape[2], G=group, D=dim, BITS=storage_bits(kcode, dim),
        SCALE_TY=_scale_type(kscale.dtype), num_warps=4,
        **FP_FUSION,
    )


def _fake_quantize(kcode, vcode, kscale, kzero, vscale, vzero, key, value, dst) -> None:
    return None


kivi_quantize = define_op(
    "kivi_quantize(Tensor(a!) kcode, Tensor(b!) vcode, Tensor(c!) kscale, Tensor(d!) kzero, Tensor(e!) vscale, "
    "Tensor(f!) vzero, Tensor key, Tensor value, Tensor dst) -> ()",
    cpu=kivi_quantize_reference,
    cuda=kivi_quantize_triton if triton is not None else None,
    fake=_fake_quantize,
)


# ----------------------------------------------------------------------------------------------- dequantize
def kivi_dequantize_reference(kcode: torch.Tensor, vcode: torch.Tensor, kscale: torch.Tensor, kzero: torch.Tensor,
                              vscale: torch.Tensor, vzero: torch.Tensor, pages: torch.Tensor,
                              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole pages back to floats: ``pages`` (any shape ``S``, int) -> key, value ``[*S, kv_heads, P, D]``.

    Used to build the temporary full-precision buffer that prefill attention reads (and by the decode reference);
    torch ops on every device (gathers and a multiply-add: not on a hot decode path).
    """
    dim = kscale.shape[-1]
    bits = storage_bits(kcode, dim)
    group = kcode.shape[2] // kscale.shape[2]
    p = pages.long()
    kc = unpack_codes(kcode[p], bits)  # [*S, H, P, D]
    vc = unpack_value_groups(vcode[p], bits)
    k = dequantize_keys(kc.unflatten(-2, (kscale.shape[2], group)), kscale[p], kzero[p]).flatten(-3, -2)
    v = dequantize_values(vc, slot_major(vscale)[p], slot_major(vzero)[p])
    return k.to(dtype), v.to(dtype)


def _fake_dequantize(kcode, vcode, kscale, kzero, vscale, vzero, pages, dtype):
    shape = (*pages.shape, kcode.shape[1], kcode.shape[2], kscale.shape[-1])
    return kcode.new_empty(shape, dtype=dtype), kcode.new_empty(shape, dtype=dtype)


kivi_dequantize = define_op(
    "kivi_dequantize(Tensor kcode, Tensor vcode, Tensor kscale, Tensor kzero, Tensor vscale, Tensor vzero, "
    "Tensor pages, ScalarType dtype) -> (Tensor key, Tensor value)",
    cpu=kivi_dequantize_reference,
    cuda=kivi_dequantize_reference,
    fake=_fake_dequantize,
)
