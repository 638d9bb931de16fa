"""``sparsecompile::paged_prefill_attention``: the torch reference against naive float64 math (output and
log-sum-exp), the Triton kernel (interpreter on CPU) and the gather-based variants against the reference on
prefill steps laid out as the engine lays them out (tests/prefill_cases.py), and opcheck."""

from __future__ import annotations

import warnings

import pytest
import torch
from prefill_cases import prefill_case, slot_view

from sparsecompile.kernels import paged_prefill_attention
from sparsecompile.kernels.library import triton_available
from sparsecompile.kernels.prefill_attention import (
    prefill_attention_dense,
    prefill_attention_flex,
    prefill_attention_reference,
    prefill_attention_sdpa,
    prefill_attention_split,
    sdpa_applicable,
)

TOY = dict(block_m=16, block_n=8)  # interpreter-sized tiles: several query and key tiles per list


def _naive(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, num_new, block_size, scale, sliding_window):
    """Loop-by-loop attention and log-sum-exp over the view, in float64."""
    batch, q_heads, queries, dim = query.shape
    kv_heads, page = k_pool.shape[1], k_pool.shape[2]
    group = q_heads // kv_heads
    out = torch.zeros(batch, queries, q_heads, dim, dtype=torch.float64)
    lse = torch.full((batch, q_heads, queries), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for qh in range(q_heads):
            h = qh // group
            for t in range(queries):
                q_p, logits, vals = int(q_positions[b, t]), [], []
                for j in range(int(lengths[b, h])):
                    slot = int(index[b, h, j // block_size]) * block_size + j % block_size
                    p = int(pos_pool[slot // page, h, slot % page])
                    if p < 0 or p > q_p or (sliding_window > 0 and p <= q_p - sliding_window):
                        continue
                    logits.append(float(query[b, qh, t].double() @ k_pool[slot // page, h, slot % page].double())
                                  * scale)
                    vals.append(v_pool[slot // page, h, slot % page].double())
                if logits:
                    s = torch.tensor(logits, dtype=torch.float64)
                    out[b, t, qh] = torch.softmax(s, 0) @ torch.stack(vals)
                    lse[b, qh, t] = torch.logsumexp(s, 0)
    return out, lse


def _assert_matches(got, want, atol=1e-5, rtol=1e-5):
    (out, lse), (out_w, lse_w) = got, want
    assert out.shape == out_w.shape and out.is_contiguous() and out.dtype == out_w.dtype
    assert lse.shape == lse_w.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), out_w.float(), atol=atol, rtol=rtol)
    assert torch.equal(lse.isneginf(), lse_w.isneginf())  # exactly the queries that see nothing
    torch.testing.assert_close(lse.nan_to_num(neginf=0.0), lse_w.float().nan_to_num(neginf=0.0), atol=1e-4, rtol=1e-5)


CASES = {
    # chunk boundaries off the pages, batch 2 with left padding (row 1: 4 padding queries)
    "padded": dict(prefix=[13, 10], new=[7, 4]),  # row 1: a query tile mixes padding and real queries
    "window": dict(prefix=[13, 6], new=[7, 3], window=5),
    "evicted": dict(prefix=[14, 9], new=[5, 5], evict=True, holes=0.25),  # per-head positions, random order, holes
    "whole_prompt": dict(prefix=[0, 0], new=[9, 6]),
    "group1": dict(prefix=[11, 11], new=[6, 6], group=1, page=8),
    "group8": dict(prefix=[10, 3], new=[4, 4], group=8, evict=True),
}


@pytest.mark.parametrize("name", ["padded", "window", "evicted"])
@pytest.mark.parametrize("slots", [False, True])
def test_reference_matches_naive(name, slots):
    case = prefill_case(**CASES[name], seed=1)
    case = slot_view(case) if slots else case
    got = paged_prefill_attention(**case)
    out, lse = _naive(**case)
    _assert_matches(got, (out.float(), lse.float()))
    padding = case["q_positions"] < 0
    assert torch.isneginf(got[1].transpose(1, 2)[padding]).all() and not got[0][padding].any()  # -inf, zeros


triton_only = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@triton_only
@pytest.mark.parametrize("name,dtype,view", [
    ("padded", torch.float32, "page"), ("window", torch.float32, "page"), ("evicted", torch.float32, "page"),
    ("whole_prompt", torch.float32, "page"), ("group1", torch.float32, "page"), ("group8", torch.bfloat16, "page"),
    ("evicted", torch.bfloat16, "page"), ("padded", torch.float32, "slots"), ("window", torch.float32, "narrow"),
])
def test_triton_matches_reference(name, dtype, view):
    from sparsecompile.kernels.prefill_attention import prefill_attention_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = prefill_case(**CASES[name], dtype=dtype, device=device, seed=2)
    config = dict(TOY)
    if view == "slots":
        case = slot_view(case)
    elif view == "narrow":
        config["block_n"] = 2  # key tiles narrower than a page: the per-slot path on a page view
    want = prefill_attention_reference(**case)
    got = prefill_attention_triton(**case, config=config)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the output's rounding and p's rounding before P @ V
    _assert_matches(got, want, atol=tol, rtol=tol)


def test_sdpa_variant_gathers_when_exact_and_falls_back_otherwise():
    exact = prefill_case([13, 13], [7, 7], seed=3)
    verdict = sdpa_applicable(exact["index"], exact["lengths"], exact["pos_pool"], exact["num_new"], 7, 4)
    assert verdict.tolist() == [1, 20]
    _assert_matches(prefill_attention_sdpa(**exact), prefill_attention_reference(**exact))
    _assert_matches(prefill_attention_sdpa(**exact, known_length=20), prefill_attention_reference(**exact))
    for kwargs in (dict(prefix=[13, 6], new=[7, 7]), dict(prefix=[13, 13], new=[7, 5]),
                   dict(prefix=[13, 13], new=[7, 7], holes=0.3)):
        case = prefill_case(**kwargs, seed=4)
        assert sdpa_applicable(case["index"], case["lengths"], case["pos_pool"], case["num_new"], 7, 4)[0] == 0
        _assert_matches(prefill_attention_sdpa(**case), prefill_attention_reference(**case))


@pytest.mark.parametrize("name,slots", [("padded", False), ("evicted", False), ("window", True)])
def test_flex_variant_matches_reference(name, slots):
    case = prefill_case(**CASES[name], seed=5)
    case = slot_view(case) if slots else case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is not compiled
        got = prefill_attention_flex(**case)
    _assert_matches(got, prefill_attention_reference(**case))


def test_dense_helper_is_causal_attention_over_the_steps_own_keys():
    case = prefill_case([0, 0], [9, 9], seed=6)
    page, index = case["block_size"], case["index"]
    slots = (index.long().repeat_interleave(page, -1) * page + torch.arange(index.shape[-1] * page) % page)[..., :9]
    head = torch.arange(2)[None, :, None]
    key = case["k_pool"][slots // page, head, slots % page]
    value = case["v_pool"][slots // page, head, slots % page]
    _assert_matches(prefill_attention_dense(case["query"], key, value, case["scale"]),
                    prefill_attention_reference(**case))


@pytest.mark.parametrize("prefix,new", [([0, 0], [9, 9]), ([13, 13], [7, 7]), ([5], [12])])
def test_split_variant_merges_own_and_prefix_attention(prefix, new):
    """cuDNN's split (here the CPU flash kernel stands in for it): causal over the step's own K/V, unmasked over the
    older slots, merged by log-sum-exps, equals the reference, with and without a prefix (also a prefix shorter
    than the chunk and off the page boundary); the own part comes from the given K/V, not from the pool."""
    case = prefill_case(prefix, new, seed=9)
    length = prefix[0] + new[0]
    key = gather_view_of(case, "k_pool", length)[:, :, prefix[0]:]
    value = gather_view_of(case, "v_pool", length)[:, :, prefix[0]:]
    args = (case["query"], case["k_pool"], case["v_pool"], case["index"], case["block_size"], case["scale"], length)
    _assert_matches(prefill_attention_split(*args, key, value), prefill_attention_reference(**case))
    out, _ = prefill_attention_split(*args, torch.randn_like(key), value)
    assert not torch.allclose(out, prefill_attention_reference(**case)[0])


def test_opcheck():
    case = prefill_case([13, 6], [7, 3], evict=True, seed=7)
    torch.library.opcheck(torch.ops.sparsecompile.paged_prefill_attention.default, tuple(case.values()))


def test_cpu_op_takes_the_flash_kernel_on_host_vouched_steps():
    """The CPU op's fast path (``known_length`` vouched by the host): a chunk after a prefix reads the gathered view,
    a whole prompt its own K/V; both equal the reference, and the reference still answers unvouched steps."""
    chunk = prefill_case([13, 13], [7, 7], seed=6)
    _assert_matches(paged_prefill_attention(**chunk, known_length=20), prefill_attention_reference(**chunk))
    whole = prefill_case([0, 0], [9, 9], seed=7)
    key = gather_view_of(whole, "k_pool", 9)
    value = gather_view_of(whole, "v_pool", 9)
    _assert_matches(paged_prefill_attention(**whole, known_length=9, key=key, value=value),
                    prefill_attention_reference(**whole))
    garbage = torch.randn_like(key)  # proves the whole-prompt path reads the given K/V, not the pool
    out, _ = paged_prefill_attention(**whole, known_length=9, key=garbage, value=value)
    assert not torch.allclose(out, prefill_attention_reference(**whole)[0])
    padded = prefill_case([13, 6], [7, 7], seed=8)
    _assert_matches(paged_prefill_attention(**padded), prefill_attention_reference(**padded))


def gather_view_of(case: dict, pool: str, n: int) -> torch.Tensor:
    from sparsecompile.kernels.prefill_attention import gather_view

    return gather_view(case[pool], case["index"], case["block_size"], n)


def test_a_failing_split_path_falls_back_to_gather_and_flash_once(monkeypatch, sparsecompile_log):
    """The CUDA dispatch (called here on CPU tensors) with cuDNN's split raising, as a build without a plan for the
    shape would: the step still equals the reference through gather + flash, one warning, and the split is not
    tried again in the process."""
    from sparsecompile.kernels import prefill_attention as pa

    calls = []

    def refuse(*args):
        calls.append(1)
        raise RuntimeError("cuDNN Frontend error: no valid execution plans")

    monkeypatch.setattr(pa, "_SPLIT_BROKEN", [])
    monkeypatch.setattr(pa, "SPLIT", True)
    monkeypatch.setattr(pa, "_sdpa_with_lse", refuse)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    case = prefill_case([13, 13], [7, 7], seed=6)
    case.update({name: case[name].bfloat16() for name in ("query", "k_pool", "v_pool")})  # the split's dtypes
    key = gather_view_of(case, "k_pool", 20)[:, :, 13:]
    value = gather_view_of(case, "v_pool", 20)[:, :, 13:]
    args = [case[name] for name in ("query", "k_pool", "v_pool", "pos_pool", "index", "lengths", "q_positions",
                                    "num_new", "block_size", "scale", "sliding_window")]
    for _ in range(2):
        _assert_matches(pa._cuda(*args, 20, True, key, value), prefill_attention_reference(**case), 2e-2, 2e-2)
    assert len(calls) == 1 and "gather + flash" in sparsecompile_log.text
