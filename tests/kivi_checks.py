"""Checks shared by the ``<policy>+kivi`` tests: what a KIVI-stored ``(row, layer)`` holds, read back as floats."""

from __future__ import annotations

import torch

from sparsecompile.kernels.kivi_quant import dequantize_keys, dequantize_values, quantize_keys, quantize_values
from sparsecompile.kernels.kivi_reference import kivi_view_kv


def stored_kv(manager, row: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """K, V ``[kv_heads, count, D]`` (dequantized, then the residual), positions ``[kv_heads, count]`` and the
    quantized slot count of ``(row, layer)``, through the host tables."""
    st, lay = manager.storage, manager.layout
    count = int(manager.slot_counts(row)[layer])
    quantized = int(st.spec.quantized(count))
    index = torch.as_tensor(manager._host_table[row, layer])[None, None, :].expand(1, lay.num_kv_heads, -1)
    k, v, pos, _ = kivi_view_kv(*st.page_tensors(), manager.pos_pool, st.ring_k, st.ring_v,
                                torch.tensor([row * lay.num_layers + layer]), index,
                                torch.full((1, lay.num_kv_heads), count), torch.tensor([quantized]), count)
    return k[0], v[0], pos[0], quantized


def assert_quantized_once(dense, kivi, row: int, layer: int, bits: int, group: int) -> int:
    """``kivi``'s ``(row, layer)`` holds the entries ``dense`` (the policy alone, same prompt) kept, stored once from
    full precision: the same positions per head, codes that dequantize exactly to KIVI's quantization of ``dense``'s
    kept K/V group by group in slot order, and the residual's K/V bit for bit. Returns the quantized slots checked."""
    assert all(torch.equal(a, b) for a, b in zip(kivi.retained_positions(row, layer),
                                                  dense.retained_positions(row, layer), strict=True))
    count = kivi.slot_counts(row)[layer]
    assert count == dense.slot_counts(row)[layer]
    got_k, got_v, _, quantized = stored_kv(kivi, row, layer)
    slots, _ = dense.resident_slot_ids(layer, torch.tensor([row]), count)
    P = dense.layout.page_size
    k = dense.k_pool[slots[0] // P, :, slots[0] % P].transpose(0, 1)  # [kv_heads, count, D], slot order
    v = dense.v_pool[slots[0] // P, :, slots[0] % P].transpose(0, 1)
    scales = kivi.storage.spec.scale_dtype
    kc, ks, kz = quantize_keys(k[:, :quantized].unflatten(1, (quantized // group, group)), bits, scales)
    vc, vs, vz = quantize_values(v[:, :quantized], bits, scales, group)
    assert torch.equal(got_k[:, :quantized], dequantize_keys(kc, ks, kz).flatten(1, 2))
    assert torch.equal(got_v[:, :quantized], dequantize_values(vc, vs, vz))
    assert torch.equal(got_k[:, quantized:], k[:, quantized:].float())  # the residual, as computed
    assert torch.equal(got_v[:, quantized:], v[:, quantized:].float())
    return quantized
