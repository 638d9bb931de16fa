"""CUDA-only checks of KIVI storage (skipped without a GPU): the Triton quantize-on-write and decode attention
against their torch references at the Llama-3.1-8B attention shape, and kivi and its compositions' decode compiled
and replayed as CUDA graphs equal to eager decode.

Tolerances: quantize-on-write is exact (same fp32 formulas, divisions rounded to nearest, casts to fp16 / bf16
rounded to nearest), so codes, scales and zeros must be equal. Decode attention in bf16 runs its dots on bf16
operands (the scaled query; keys dequantized in registers with one rounding; value codes, exact, against the
probabilities times each slot's value scale; the value zeros against the probabilities) with fp32 accumulation
against an fp32 reference: outputs of unit scale agree to 3e-2 (the dense bf16 kernel's own error is ~1e-2); fp16
the same.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEADS, GROUP_Q, DIM, PAGE = 8, 4, 128, 32


def _pages(num_pages, bits, scale_dtype, g):
    from sparsecompile.kernels.kivi_quant import empty_pages

    return empty_pages(num_pages, HEADS, PAGE, DIM, bits, 32, scale_dtype, "cuda")


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_quantize_triton_equals_reference(bits, scale_dtype):
    from sparsecompile.kernels.kivi_quant import kivi_quantize_reference, kivi_quantize_triton

    g = torch.Generator(device="cuda").manual_seed(bits)
    ref, tri = _pages(600, bits, scale_dtype, g), _pages(600, bits, scale_dtype, g)
    groups = 1024
    key = (torch.randn(groups, HEADS, 32, DIM, device="cuda", generator=g) * 4).to(torch.bfloat16)
    value = torch.randn(groups, HEADS, 32, DIM, device="cuda", generator=g).to(torch.bfloat16)
    dst = torch.randperm(600, device="cuda", generator=g)[:groups // 2].repeat(2)[:groups] * PAGE
    dst[groups // 2:] = -1  # half skipped
    kivi_quantize_reference(*ref, key, value, dst)
    kivi_quantize_triton(*tri, key, value, dst)
    for a, b in zip(ref, tri):
        assert torch.equal(a, b)


def _decode_case(bits, context, batch, scale_dtype, window):
    """The op's arguments over ``batch`` lists of ``context`` slots (the 8B attention shape, bf16; quantized up to
    the last 128-159 slots, pages in random order, holes in each list's first page), the block table and positions."""
    from sparsecompile.kernels.kivi_quant import kivi_quantize_triton

    g = torch.Generator(device="cuda").manual_seed(context + bits)
    per_seq = -(-context // PAGE)
    num_pages = batch * per_seq + 1
    pages = _pages(num_pages, bits, scale_dtype, g)
    quant = (context - 128) // 32 * 32
    table = torch.randperm(num_pages - 1, device="cuda", generator=g).view(batch, per_seq).to(torch.int32)
    index = table[:, None, :].expand(batch, HEADS, -1).contiguous()
    first = (table[:, : quant // PAGE + 1].long() * PAGE)  # group starts of the quantized prefix
    starts = (first[:, :, None] + torch.arange(0, PAGE, 32, device="cuda")).reshape(batch, -1)[:, : quant // 32]
    n = starts.numel()
    key = (torch.randn(n, HEADS, 32, DIM, device="cuda", generator=g) + torch.linspace(-3, 3, DIM, device="cuda"))
    kivi_quantize_triton(*pages, key.bfloat16(), torch.randn_like(key).bfloat16(), starts.reshape(-1))
    pos = torch.full((num_pages, HEADS, PAGE), -1, dtype=torch.int32, device="cuda")
    j = torch.arange(context, device="cuda")
    for b in range(batch):
        pos[table[b, j // PAGE].long(), :, j % PAGE] = j.to(torch.int32)[:, None]
        pos[table[b, 0].long(), :, 3:7] = -1  # holes
    ring = 160
    ring_k = torch.randn(batch + 1, HEADS, ring, DIM, device="cuda", generator=g).bfloat16()
    ring_v = torch.randn(batch + 1, HEADS, ring, DIM, device="cuda", generator=g).bfloat16()
    query = torch.randn(batch, HEADS * GROUP_Q, 1, DIM, device="cuda", generator=g).bfloat16()
    lengths = torch.full((batch, HEADS), context, device="cuda", dtype=torch.int32)
    args = (query, *pages, pos, ring_k, ring_v, torch.arange(batch, device="cuda"), index, lengths,
            torch.full((batch,), quant, device="cuda"), torch.full((batch, 1), context, device="cuda"),
            DIM ** -0.5, window)
    return args, table, pos


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("context,batch", [(4096, 4), (33000, 1)])
@pytest.mark.parametrize("scale_dtype,window", [(torch.float16, 0), (torch.bfloat16, 0), (torch.bfloat16, 1000)])
def test_decode_attention_triton_vs_reference(bits, context, batch, scale_dtype, window):
    """bf16 scales: the Gluon kernel's quantized part (``kivi_gluon.py``) beside the Triton kernel's
    residual; a sliding window masks whole splits of it (their log-sum-exp -inf), and holes (position -1) in
    the first page are skipped."""
    from sparsecompile.kernels.kivi_attention import kivi_decode_attention_triton
    from sparsecompile.kernels.kivi_gluon import gluon_supported
    from sparsecompile.kernels.kivi_reference import (
        kivi_decode_attention_logits_reference,
        kivi_decode_attention_reference,
    )

    args, table, pos = _decode_case(bits, context, batch, scale_dtype, window)
    query = args[0]
    want = kivi_decode_attention_reference(*args)
    gluon = gluon_supported(query, bits, 32, DIM, PAGE, GROUP_Q, scale_dtype)
    assert gluon == (scale_dtype == torch.bfloat16 and torch.cuda.get_device_capability() == (9, 0))
    for splits, config in ((None, None), (1, None), (None, {"num_warps": 2, "num_stages": 2})):
        got = kivi_decode_attention_triton(*args, num_splits=splits, config=config)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    if window == 0:  # kivi alone (dense_history: no empty slot, every quantized slot before the queries): the Gluon
        # kernel reads no positions, with the same result as with them
        full = pos.clone()
        for b in range(batch):
            full[table[b, 0].long(), :, 3:7] = torch.arange(3, 7, device="cuda", dtype=torch.int32)
        dense = (*args[:7], full, *args[8:])
        got = torch.ops.sparsecompile.kivi_decode_attention(*dense, True)
        assert torch.equal(got, kivi_decode_attention_triton(*dense))
        torch.testing.assert_close(got.float(), kivi_decode_attention_reference(*dense).float(), atol=3e-2, rtol=3e-2)
    if scale_dtype == torch.float16:  # the fp16 form of the in-register dequantization
        fp16 = kivi_decode_attention_triton(query.half(), *args[1:])
        torch.testing.assert_close(fp16.float(), want.float(), atol=3e-2, rtol=3e-2)
    # h2o+kivi's form: the logits of every slot and the log-sum-exp beside the output (the Gluon kernel's quantized
    # slots beside the residual split with bf16 scales, else the Triton kernel's splits; and its one-split launch);
    # logits of unit-scale dots in bf16 operands: 5e-2, the probabilities that H2O adds up: 1e-3 absolute
    _, lse_ref, logits_ref = kivi_decode_attention_logits_reference(*args)
    for splits in (None, 1):
        out, lse, logits = kivi_decode_attention_triton(*args, num_splits=splits, with_logits=True)
        torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse, lse_ref, atol=5e-2, rtol=1e-2)
        assert torch.equal(torch.isneginf(logits), torch.isneginf(logits_ref))
        seen = ~torch.isneginf(logits_ref)
        torch.testing.assert_close(logits[seen], logits_ref[seen], atol=5e-2, rtol=1e-2)
        torch.testing.assert_close((logits - lse).exp(), (logits_ref - lse_ref).exp(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("context,batch", [(4096, 4), (33000, 2)])
def test_decode_attention_over_a_selection_vs_reference(bits, context, batch):
    """Quest over KIVI pages (``quest+kivi``): the quantized splits (the Gluon kernel with bf16 scales, the Triton
    kernel with fp16 ones or when forced) over 64 pages a head chosen at random among each list's quantized ones,
    the ring's blocks over the residual; with and without positions (``dense_history``)."""
    from sparsecompile.kernels.kivi_attention import kivi_decode_attention_triton
    from sparsecompile.kernels.kivi_reference import kivi_decode_attention_reference

    for scale_dtype in (torch.bfloat16, torch.float16):
        args, table, pos = _decode_case(bits, context, batch, scale_dtype, 0)
        full = int(args[13][0]) // PAGE
        g = torch.Generator(device="cuda").manual_seed(bits)
        chosen = torch.rand(batch, HEADS, full, device="cuda", generator=g).argsort(-1)[..., :64].sort(-1).values
        pick = torch.gather(table[:, None, :].expand(-1, HEADS, -1), 2, chosen).to(torch.int32)
        count = torch.full((batch,), 64 * PAGE, device="cuda")
        want = kivi_decode_attention_reference(*args, quant_index=pick, quant_count=count)
        for splits in (None, 3):
            got = kivi_decode_attention_triton(*args, False, pick, count, num_splits=splits)
            torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
        dense = pos.clone()
        for b in range(batch):  # no holes: every quantized slot visible, as under quest+kivi
            dense[table[b, 0].long(), :, 3:7] = torch.arange(3, 7, device="cuda", dtype=torch.int32)
        whole = (*args[:7], dense, *args[8:])
        got = torch.ops.sparsecompile.kivi_decode_attention(*whole, True, pick, count)
        assert torch.equal(got, kivi_decode_attention_triton(*whole, False, pick, count))
        torch.testing.assert_close(got.float(), kivi_decode_attention_reference(
            *whole, quant_index=pick, quant_count=count).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("method,options", [("kivi", dict(bits=2, residual=32)),
                                            ("kivi", dict(bits=4, residual=0, scale_dtype="bfloat16")),
                                            ("snapkv+kivi", dict(budget=96, window=8, bits=2, residual=32)),
                                            # the window drops a 32-slot page a row after 32 decode tokens
                                            ("streamingllm+kivi", dict(budget=96, sinks=4, bits=2, residual=32)),
                                            # the prompts re-read in full precision, compacted, then quantized
                                            ("kvzip+kivi", dict(budget=96, chunk=64, bits=2, residual=32)),
                                            # a 32-slot key group a head leaves after 32 decode tokens; the step
                                            # writes its logits for H2O's scores
                                            ("h2o+kivi", dict(budget=96, recent=32, bits=2, residual=32)),
                                            # 2 of 3-5 quantized pages a head chosen every step (Quest's scores from
                                            # the key groups' ranges)
                                            ("quest+kivi", dict(budget=128, dense_layers=0, dense_below=0, bits=2,
                                                                residual=32))])
def test_kivi_decode_with_cuda_graphs_equals_eager(method, options):
    from tiny_models import left_padded_batch, tiny_config
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    import sparsecompile

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4,
                         head_dim=64)
    # fp32 weights and activations (K/V still quantized to 2 / 4 bits): bf16 GEMMs fused in the compiled step round
    # differently from the eager ones and flip near-tied greedy picks of a random model; fp32 keeps the comparison
    # about the graphs
    eager = AutoModelForCausalLM.from_config(config).to("cuda", torch.float32).eval()
    graphs = copy.deepcopy(eager)
    sparsecompile.optimize(eager, method, compile=False, **options)
    sparsecompile.optimize(graphs, method, compile=True, cuda_graphs=True, **options)
    ids, mask = left_padded_batch((150, 97, 120), seed=2)
    ids, mask = ids.cuda(), mask.cuda()
    want = eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    got = graphs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    differ = (got != want).any(0).nonzero()
    assert torch.equal(got, want), f"first differing position {differ[0].item()} of {got.shape[1]}"
    assert int(counters["inductor"]["cudagraph_skips"]) == 0
    assert sum(counters["graph_break"].values()) == 0
