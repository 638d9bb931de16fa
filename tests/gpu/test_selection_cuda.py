"""CUDA-only checks of the selection methods (skipped without a GPU): the Triton selection kernels against
their torch references at realistic sizes, and Quest / OmniKV decode compiled and replayed as CUDA graphs."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quest_and_omnikv_scores_triton_vs_reference(dtype):
    from sparsecompile.kernels.omnikv_scores import omnikv_scores_reference, omnikv_scores_triton
    from sparsecompile.kernels.quest_scores import quest_page_scores_reference, quest_page_scores_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    pool, heads, group, page, dim, batch, max_pages = 2048, 8, 4, 16, 128, 3, 512
    kmin = torch.randn(pool, heads, dim, device="cuda", generator=g).to(dtype)
    kmax = (kmin.float() + torch.rand(pool, heads, dim, device="cuda", generator=g)).to(dtype)
    query = torch.randn(batch, heads * group, dim, device="cuda", generator=g).to(dtype)
    pages = torch.randint(0, pool, (batch, max_pages), device="cuda", generator=g, dtype=torch.int32)
    num = torch.tensor([512, 300, 1], device="cuda")
    want = quest_page_scores_reference(query, kmin, kmax, pages, num)
    torch.testing.assert_close(quest_page_scores_triton(query, kmin, kmax, pages, num), want, atol=1e-2, rtol=1e-3)
    if dtype == torch.bfloat16:  # quest+kivi's bounds from KIVI key groups' zeros and scales (one and two a page),
        # computed in fp32 and rounded once to the metadata's dtype before the products: Quest's scores of those
        for groups in (1, 2):
            zero = torch.randn(pool, heads, groups, dim, device="cuda", generator=g).to(dtype)
            step = (torch.rand(pool, heads, groups, dim, device="cuda", generator=g) / 3).to(dtype)
            lo, hi = zero.amin(2), (zero.float() + 3 * step.float()).amax(2).to(dtype)
            torch.testing.assert_close(quest_page_scores_triton(query, zero, step, pages, num, levels=3),
                                       quest_page_scores_reference(query, lo, hi, pages, num), atol=1e-2, rtol=1e-3)
    k_pool = torch.randn(pool, heads, page, dim, device="cuda", generator=g).to(dtype)
    limit = torch.tensor([8000, 4000, 5], device="cuda")
    want = omnikv_scores_reference(query, k_pool, pages, limit)
    torch.testing.assert_close(omnikv_scores_triton(query, k_pool, pages, limit), want, atol=1e-2, rtol=1e-3)
    # The filter layers' fused form: the dense attention's per-slot max, reduced over KV heads, masked at the prompt
    # (OmniKV's _prompt_scores), at decode sizes with several splits per list. Tolerance as above.
    from sparsecompile.kernels.paged_attention import paged_attention_reference, paged_attention_triton
    from sparsecompile.methods.omnikv import _prompt_scores

    capacity = max_pages * page
    lengths = torch.tensor([8100, 4100, 40], device="cuda", dtype=torch.int32)[:, None].expand(-1, heads).contiguous()
    index = pages[:, None, :].expand(-1, heads, -1)
    pos_pool = torch.zeros(pool, heads, page, device="cuda", dtype=torch.int32)  # every slot visible
    v_pool = torch.randn_like(k_pool)
    qpos = torch.full((batch, 1), capacity, device="cuda")
    q4 = query[:, :, None, :]
    out, token_max = paged_attention_triton(q4, k_pool, v_pool, pos_pool, index, lengths, qpos, page, dim ** -0.5, 0,
                                            with_token_max=True)
    torch.testing.assert_close(_prompt_scores(token_max, limit.clamp(max=lengths[:, 0])),
                               omnikv_scores_reference(query, k_pool, pages, limit.clamp(max=lengths[:, 0])),
                               atol=1e-2, rtol=1e-3)
    assert token_max[2, :, 40:].isneginf().all()  # past the list
    torch.testing.assert_close(out.float(), paged_attention_reference(q4, k_pool, v_pool, pos_pool, index, lengths,
                                                                      qpos, page, dim ** -0.5, 0).float(),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("search", ["bisect", "bit", "byte"])
@pytest.mark.parametrize("n,k", [(512, 31), (8192, 2048), (8203, 128), (40000, 512)])
def test_topk_select_triton_vs_reference(n, k, search):
    from sparsecompile.kernels.topk_select import topk_select_reference, topk_select_triton

    g = torch.Generator(device="cuda").manual_seed(n)
    scores = torch.randn(3, 4, n, device="cuda", generator=g)
    scores[0, 0, :100] = 0.25  # ties at the threshold
    scores[1, :, -50:] = float("-inf")
    scores[2, 1, 7] = float("inf")
    counts = torch.randint(0, k + 1, (3, 4), device="cuda", generator=g)
    counts[0, 0] = k
    assert torch.equal(topk_select_triton(scores, counts, k, search=search),
                       topk_select_reference(scores, counts, k))


@pytest.mark.parametrize("long_search", ["torch", "radix"])
@pytest.mark.parametrize("n,k,chunk", [(131236, 2048, 4096), (40000, 512, 1024), (8208, 128, 1024)])
def test_long_row_topk_select_vs_reference(n, k, chunk, long_search):
    """OmniKV's prompt-long rows (128K x 4: four rows of 131,236 scores, k 2,048), both long-row selects; ties
    across chunks, -inf tails, a forced entry, counts below the width and zero."""
    module = importlib.import_module("sparsecompile.kernels.topk_select")  # (the package exports the op by that name)

    g = torch.Generator(device="cuda").manual_seed(n)
    scores = torch.randn(4, 2, n, device="cuda", generator=g)
    scores[0, 0] = torch.randint(0, 50, (n,), device="cuda", generator=g).float()  # ties spread over every chunk
    scores[1, :, -5000:] = float("-inf")
    scores[2, 1, 7] = float("inf")
    counts = torch.full((4, 2), k, device="cuda")
    counts[3] = torch.tensor([0, k // 3])
    want = module.topk_select_reference(scores, counts, k)
    if long_search == "radix":
        got = module.topk_select_radix(scores, counts, k, chunk=chunk)
    else:
        got = module.topk_select_triton(scores, counts, k, max_tile=16384, long_search="torch")
    assert torch.equal(got, want)


@pytest.mark.parametrize("method,options,graphs", [
    ("quest", dict(budget=64, dense_layers=1, dense_below=0), 1),
    ("quest", dict(budget=64, dense_layers=1, dense_below=390), 2),  # 357 prompt tokens: dense, then selecting
    ("omnikv", dict(budget=48, filter_layers="1", dense_below=0), 1),
])
def test_selection_decode_with_cuda_graphs_equals_eager(method, options, graphs):
    from tiny_models import left_padded_batch, tiny_config
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    import sparsecompile

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to("cuda").eval()
    graphed = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to("cuda").eval()
    graphed.load_state_dict(eager.state_dict())
    ids, mask = (t.cuda() for t in left_padded_batch((140, 97, 120)))
    sparsecompile.optimize(eager, method, page_size=16, compile=False, **options)
    sparsecompile.optimize(graphed, method, page_size=16, compile=True, cuda_graphs=True, **options)
    want = eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    for _ in range(2):  # the second call replays the captured graphs
        got = graphed.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        assert torch.equal(got, want)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == graphs  # one per decode variant the steps ran
    assert sum(counters["graph_break"].values()) == 0


def test_omnikv_long_prompt_radix_select_equals_torch_select(monkeypatch):
    """A prompt past one program's tile (16,384 scores): OmniKV's filter layer selects through the long-row path;
    the radix select, compiled and replayed in CUDA graphs, gives the greedy tokens of the torch path run eagerly."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    import sparsecompile
    module = importlib.import_module("sparsecompile.kernels.topk_select")  # (the package exports the op by that name)

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4,
                         max_position_embeddings=32768)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to("cuda").eval()
    graphed = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to("cuda").eval()
    graphed.load_state_dict(eager.state_dict())
    ids = torch.randint(3, config.vocab_size, (2, 17000), device="cuda")
    options = dict(budget=512, filter_layers="1", dense_below=0)
    sparsecompile.optimize(eager, "omnikv", page_size=16, compile=False, **options)
    sparsecompile.optimize(graphed, "omnikv", page_size=16, compile=True, cuda_graphs=True, **options)
    monkeypatch.setattr(module, "LONG_SEARCH", "torch")
    want = eager.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
    monkeypatch.setattr(module, "LONG_SEARCH", "radix")
    for _ in range(2):  # the second call replays the captured graphs
        assert torch.equal(graphed.generate(input_ids=ids, max_new_tokens=16, do_sample=False), want)
