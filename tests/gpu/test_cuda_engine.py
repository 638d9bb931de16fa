"""CUDA-only checks (skipped without a GPU): Triton kernels against their torch references in bf16 and
fp32, and the compiled decode step replayed as a CUDA graph inside generate()."""

from __future__ import annotations

import pytest
import torch

from sparsecompile.models.hf_patch import patched_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# bf16 tolerances: outputs are bf16-rounded (8 bits of mantissa), accumulations are fp32.
BF16 = dict(atol=2e-2, rtol=2e-2)
FP32 = dict(atol=2e-5, rtol=2e-5)


def _pool(pages, heads, page, dim, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(pages, heads, page, dim, generator=g, device="cuda").to(dtype)
    v = torch.randn(pages, heads, page, dim, generator=g, device="cuda").to(dtype)
    pos = torch.arange(pages * page, device="cuda", dtype=torch.int32).view(pages, 1, page).expand(-1, heads, -1)
    return k, v, pos.contiguous()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, BF16), (torch.float32, FP32)])
@pytest.mark.parametrize("queries,block", [(1, 16), (1, 1), (37, 16), (5, 1)])
@pytest.mark.parametrize("heads,group,dim", [(8, 4, 128), (3, 3, 64)])
def test_paged_attention_triton_vs_reference(dtype, tol, queries, block, heads, group, dim):
    from sparsecompile.kernels.paged_attention import paged_attention_reference, paged_attention_triton

    pages, page, batch = 512, 16, 3
    k, v, pos = _pool(pages, heads, page, dim, dtype, seed=queries + block)
    entries = 96 if block == 16 else 700
    index = torch.randint(0, pages * page // block, (batch, heads, entries), device="cuda", dtype=torch.int32)
    lengths = torch.randint(1, entries * block + 1, (batch, heads), device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads * group, queries, dim, device="cuda").to(dtype)
    qpos = torch.randint(0, pages * page, (batch, queries), device="cuda")
    for window in (0, 300):
        # the reference computes in fp32: run it on the same (rounded) inputs
        want = paged_attention_reference(q, k, v, pos, index, lengths, qpos, block, dim ** -0.5, window)
        got = paged_attention_triton(q, k, v, pos, index, lengths, qpos, block, dim ** -0.5, window)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        for splits in (1, 3):  # the split-KV merge must not change the result
            again = paged_attention_triton(q, k, v, pos, index, lengths, qpos, block, dim ** -0.5, window,
                                           num_splits=splits)
            torch.testing.assert_close(again.float(), want.float(), **tol)


def test_kv_write_triton_vs_reference():
    from sparsecompile.kernels.kv_write import kv_write_reference, kv_write_triton

    k, v, pos = _pool(64, 8, 16, 128, torch.bfloat16, seed=1)
    key = torch.randn(4, 8, 9, 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(4, 8, 9, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda")[:36].view(4, 9)
    slots[1, :3] = -1
    positions = torch.arange(36, device="cuda").view(4, 9)
    a = [t.clone() for t in (k, v, pos)]
    b = [t.clone() for t in (k, v, pos)]
    kv_write_reference(*a, key, value, slots, positions)
    kv_write_triton(*b, key, value, slots, positions)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_with_cuda_graph_decode(dtype):
    import copy

    from tiny_models import left_padded_batch, tiny_config
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    import sparsecompile

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to("cuda", dtype).eval()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to("cuda", dtype).eval()
    model.load_state_dict(reference.state_dict())
    ids, mask = (t.cuda() for t in left_padded_batch((40, 23, 31)))
    want = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    sparsecompile.optimize(model, "vanilla", page_size=16, compile=True, cuda_graphs=True)
    for _ in range(2):  # the second call replays the captured graphs
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:  # bf16: Triton vs SDPA rounding can flip a near-tie; require a long common prefix
            agree = (got[:, ids.shape[1]:] == want[:, ids.shape[1]:]).float().mean().item()
            assert agree > 0.8, agree
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    # q/k/v and gate/up ran as one GEMM each (as_strided views of the shared buffers, under CUDA graphs)
    assert patched_model(model).controller.decode_backend.fused_groups == 2 * 3


@pytest.mark.parametrize("method,options", [("vanilla", {}), ("h2o", {"budget": 32}), ("quest", {"budget": 32,
                                                                                              "dense_layers": 1,
                                                                                              "dense_below": 0})])
def test_pool_growth_keeps_one_decode_graph(method, options):
    """A longer prompt than any before grows the pool and widens the block table: the compiled decode step is not
    recompiled (the page dimension is dynamic) and its CUDA-graph replays stay equal to eager decoding (fp32)."""
    import copy

    from tiny_models import left_padded_batch, tiny_config
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    import sparsecompile

    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3)
    base = AutoModelForCausalLM.from_config(config).eval()
    prompts = [left_padded_batch(lengths, seed=i) for i, lengths in enumerate([(40, 23), (300, 170), (460, 90)])]
    outputs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = copy.deepcopy(base).to("cuda", torch.float32)
        sparsecompile.optimize(model, method, page_size=16, compile=compiled, cuda_graphs=compiled, **options)
        pages = []
        for ids, mask in prompts:
            outputs.append(model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12,
                                          do_sample=False))
            pages.append(patched_model(model).controller.manager.num_pages)
        assert pages[0] < pages[1] < pages[2], pages  # the pool grew twice
    eager, graphs = outputs[:3], outputs[3:]
    assert all(torch.equal(a, b) for a, b in zip(eager, graphs))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    assert counters["inductor"]["cudagraph_skips"] == 0
