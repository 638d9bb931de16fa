"""CUDA-only (skipped without a GPU): every implementation of ``paged_prefill_attention`` against the fp32 torch
reference at Llama-3.1-8B attention sizes (8 KV heads, head_dim 128, page 16, bf16), on prefill steps laid out as
the engine lays them out (tests/prefill_cases.py).

Tolerance (bf16): outputs within 1e-2 absolute + 1e-2 relative of the fp32 reference (bf16 rounding of the output
and of the softmax weights before P @ V); log-sum-exp within 2e-3 (the logits see the same bf16 inputs, fp32
accumulation); queries that see nothing: exactly -inf and zeros."""

from __future__ import annotations

import pytest
import torch
from prefill_cases import prefill_case, slot_view

from sparsecompile.kernels import prefill_attention as pa

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPE = dict(kv_heads=8, group=4, head_dim=128, page=16, dtype=torch.bfloat16, device="cuda")
CASES = {
    "chunk_padded": dict(prefix=[3000, 1200], new=[517, 300]),  # chunk ends off the pages, left padding
    "whole_prompt": dict(prefix=[0], new=[2100]),
    "chunk_exact": dict(prefix=[3500, 3500], new=[700, 700]),  # the sdpa variant gathers here
    "window": dict(prefix=[3000], new=[600], window=1024),
    "evicted": dict(prefix=[2000, 1500], new=[400, 400], evict=True, holes=0.03),
    "group8": dict(prefix=[1000], new=[333], kv_heads=4, group=8),
}
VARIANTS = ["triton", "sdpa", "flex"]


def _check(got, want, atol=1e-2, rtol=1e-2):
    (out, lse), (out_w, lse_w) = got, want
    assert out.shape == out_w.shape and out.dtype == out_w.dtype and out.is_contiguous()
    assert lse.shape == lse_w.shape and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), out_w.float(), atol=atol, rtol=rtol)
    dead = lse_w.isneginf()
    assert torch.equal(lse.isneginf(), dead)
    torch.testing.assert_close(lse[~dead], lse_w[~dead], atol=2e-3, rtol=1e-5)
    assert not out.transpose(1, 2)[dead].any()


def _run(variant: str, case: dict):
    fn = {"triton": pa.prefill_attention_triton, "sdpa": pa.prefill_attention_sdpa,
          "flex": pa.prefill_attention_flex}[variant]
    return fn(**case)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_reference(name, variant):
    case = prefill_case(**{**SHAPE, **CASES[name]}, seed=sorted(CASES).index(name))
    _check(_run(variant, case), pa.prefill_attention_reference(**case))


@pytest.mark.parametrize("variant", ["triton", "flex"])
def test_slot_view(variant):
    case = slot_view(prefill_case(**{**SHAPE, **CASES["evicted"]}, seed=3))
    _check(_run(variant, case), pa.prefill_attention_reference(**case))


def test_fp32_triton():
    case = prefill_case(**{**SHAPE, "dtype": torch.float32, **CASES["chunk_padded"]}, seed=4)
    _check(pa.prefill_attention_triton(**case), pa.prefill_attention_reference(**case), atol=1e-4, rtol=1e-4)


def test_sdpa_variant_decides_on_the_device():
    exact = prefill_case(**{**SHAPE, **CASES["chunk_exact"]}, seed=5)
    verdict = pa.sdpa_applicable(exact["index"], exact["lengths"], exact["pos_pool"], exact["num_new"], 700, 16)
    assert verdict.tolist() == [1, 4200]
    for name in ("chunk_padded", "evicted"):
        case = prefill_case(**{**SHAPE, **CASES[name]}, seed=6)
        queries = case["query"].shape[2]
        assert pa.sdpa_applicable(case["index"], case["lengths"], case["pos_pool"], case["num_new"], queries,
                                  16)[0] == 0
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # with the length vouched for by the caller nothing syncs
    try:
        got = pa.prefill_attention_sdpa(**exact, known_length=4200)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    _check(got, pa.prefill_attention_reference(**exact))


@pytest.mark.parametrize("impl", VARIANTS)
def test_op_dispatches_on_cuda_impl_and_compiles(impl, monkeypatch):
    monkeypatch.setattr(pa, "CUDA_IMPL", impl)
    case = prefill_case(**{**SHAPE, **CASES["chunk_padded"]}, seed=7)
    want = pa.prefill_attention_reference(**case)
    _check(pa.paged_prefill_attention(**case), want)
    args = list(case.values())
    compiled = torch.compile(lambda *a: pa.paged_prefill_attention(*a), fullgraph=True)
    _check(compiled(*args), want)


def test_triton_and_flex_do_not_sync():
    case = prefill_case(**{**SHAPE, **CASES["evicted"]}, seed=8)
    pa.prefill_attention_triton(**case)  # compile first
    pa.prefill_attention_flex(**case)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pa.prefill_attention_triton(**case)
        pa.prefill_attention_flex(**case)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("name,want_lse", [("whole_prompt", False), ("whole_prompt", True), ("chunk_exact", True)])
def test_op_dispatch_with_host_vouched_lengths(name, want_lse, split, monkeypatch):
    """The op's CUDA dispatch with ``known_length`` and the step's own K/V (what the controller passes for dense
    steps): cuDNN SDPA for a whole prompt without lse; otherwise gather + flash, or with ``SPLIT`` cuDNN's causal
    attention over the own K/V merged with its unmasked attention over the older slots; the same results as the
    reference."""
    monkeypatch.setattr(pa, "SPLIT", split)
    case = prefill_case(**{**SHAPE, **CASES[name]}, seed=5)
    known = int(case["lengths"].max())
    new = case["query"].shape[2]
    extra = {name: pa.gather_view(case[pool], case["index"], case["block_size"], known)[:, :, known - new:]
             for name, pool in (("key", "k_pool"), ("value", "v_pool"))}
    got = pa.paged_prefill_attention(**case, known_length=known, want_lse=want_lse, **extra)
    want = pa.prefill_attention_reference(**case)
    if want_lse:
        _check(got, want)
    else:
        torch.testing.assert_close(got[0].float(), want[0].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", ["whole_prompt", "chunk_exact"])
def test_split_variant_matches_reference(name):
    """``prefill_attention_split`` itself (cuDNN with its log-sum-exp), whatever ``SPLIT`` says."""
    case = prefill_case(**{**SHAPE, **CASES[name]}, seed=6)
    known = int(case["lengths"].max())
    new = case["query"].shape[2]
    key, value = (pa.gather_view(case[pool], case["index"], case["block_size"], known)[:, :, known - new:]
                  for pool in ("k_pool", "v_pool"))
    assert pa.split_applicable(case["query"])  # the H200
    got = pa.prefill_attention_split(case["query"], case["k_pool"], case["v_pool"], case["index"],
                                     case["block_size"], case["scale"], known, key, value)
    _check(got, pa.prefill_attention_reference(**case))
