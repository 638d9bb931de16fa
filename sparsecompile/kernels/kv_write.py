"""``sparsecompile::kv_write``: scatter new keys, values and their logical positions into the paged pool.

Pool layout (shared by every op): ``k_pool, v_pool [num_pages, kv_heads, page_size, head_dim]`` and
``pos_pool [num_pages, kv_heads, page_size]`` (int32 logical position, -1 = empty slot). A *global
slot id* ``g`` names ``(page = g // page_size, offset = g % page_size)``; every KV head of a token
is written at the same slot id, while later eviction may give each head its own positions.
"""

from __future__ import annotations

import torch

from .library import define_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux-only dependency
    triton = None


def kv_write_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
    """Torch reference.

    Args:
        k_pool, v_pool: ``[num_pages, kv_heads, page_size, head_dim]``, written in place.
        pos_pool: ``[num_pages, kv_heads, page_size]`` int32, written in place.
        key, value: ``[batch, kv_heads, tokens, head_dim]`` (any strides).
        slots: ``[batch, tokens]`` int64 global slot ids; ``-1`` skips the token (padding).
        positions: ``[batch, tokens]`` int64 logical positions.
    """
    page_size = k_pool.shape[2]
    keep = slots >= 0
    slot = slots[keep]
    page, offset = slot // page_size, slot % page_size
    # key[b, :, t] for kept (b, t) -> [n, kv_heads, head_dim]
    k_rows = key.permute(0, 2, 1, 3)[keep]
    v_rows = value.permute(0, 2, 1, 3)[keep]
    k_pool[page, :, offset] = k_rows.to(k_pool.dtype)
    v_pool[page, :, offset] = v_rows.to(v_pool.dtype)
    pos_pool[page, :, offset] = positions[keep].to(pos_pool.dtype)[:, None]


if triton is not None:

    @triton.jit
    def _kv_write_kernel(k_pool, v_pool, pos_pool, key, value, slots, positions,
                         stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                         tokens, kv_heads: tl.constexpr, page_size: tl.constexpr, head_dim: tl.constexpr,
                         BLOCK_D: tl.constexpr):
        row = tl.program_id(0)  # b * tokens + t
        head = tl.program_id(1)
        b = row // tokens
        t = row % tokens
        slot = tl.load(slots + row)
        if slot >= 0:
            page = slot // page_size
            offset = slot % page_size
            d = tl.arange(0, BLOCK_D)
            dmask = d < head_dim
            dst = ((page * kv_heads + head) * page_size + offset) * head_dim
            k = tl.load(key + b * stride_kb + head * stride_kh + t * stride_kt + d, mask=dmask)
            v = tl.load(value + b * stride_vb + head * stride_vh + t * stride_vt + d, mask=dmask)
            tl.store(k_pool + dst + d, k.to(k_pool.dtype.element_ty), mask=dmask)
            tl.store(v_pool + dst + d, v.to(v_pool.dtype.element_ty), mask=dmask)
            pos = tl.load(positions + row)
            tl.store(pos_pool + (page * kv_heads + head) * page_size + offset, pos.to(tl.int32))


def kv_write_triton(k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
    """Triton launch with the semantics of :func:`kv_write_reference` (the last dim of key/value must be dense)."""
    batch, kv_heads, tokens, head_dim = key.shape
    if key.stride(3) != 1:
        key = key.contiguous()
    if value.stride(3) != 1:
        value = value.contiguous()
    slots = slots.contiguous()
    positions = positions.contiguous()
    grid = (batch * tokens, kv_heads)
    _kv_write_kernel[grid](
        k_pool, v_pool, pos_pool, key, value, slots, positions,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        tokens, kv_heads, k_pool.shape[2], head_dim, triton.next_power_of_2(head_dim),
    )


def _fake(k_pool, v_pool, pos_pool, key, value, slots, positions) -> None:
    return None


kv_write = define_op(
    "kv_write(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor(c!) pos_pool, Tensor key, Tensor value, "
    "Tensor slots, Tensor positions) -> ()",
    cpu=kv_write_reference,
    cuda=kv_write_triton if triton is not None else None,
    fake=_fake,
)
