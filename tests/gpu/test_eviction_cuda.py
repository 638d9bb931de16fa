"""CUDA-only (skipped without a GPU): eviction methods' compiled decode replayed as CUDA graphs equals eager,
with one graph, no graph break and no cudagraph skip (the H2O / StreamingLLM eviction runs inside the graph)."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("method,options,dtype", [
    ("h2o", {"budget": 16, "recent": 4}, torch.bfloat16),
    ("h2o", {"budget": 16, "interval": 4}, torch.float32),
    ("streamingllm", {"budget": 16}, torch.bfloat16),
    ("snapkv", {"budget": 16, "window": 4}, torch.float32),
    ("pyramidkv", {"budget": 16, "window": 2, "beta": 2}, torch.float32),
])
def test_eviction_cuda_graph_decode_equals_eager(method, options, dtype):
    from tiny_models import left_padded_batch, tiny_config
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    import sparsecompile

    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3)
    base = AutoModelForCausalLM.from_config(config).eval()
    ids, mask = (t.cuda() for t in left_padded_batch((40, 23, 31)))
    outputs, kept = [], []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = copy.deepcopy(base).to("cuda", dtype)
        sparsecompile.optimize(model, method, page_size=16, prefill_chunk_size=16, compile=compiled,
                               cuda_graphs=compiled, **options)
        for _ in range(2):  # the second call replays the captured graphs
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                 return_dict_in_generate=True)
            cache = out["cache"] if "cache" in out else out["past_key_values"]
            kept.append([[p.tolist() for p in heads] for heads in sparsecompile.retained_positions(cache, 2)])
            cache.release()
            outputs.append(out.sequences)
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["graph_break"].values()) == 0
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert all(k == kept[0] for k in kept)
    assert all(torch.equal(o, outputs[0]) for o in outputs)


def test_decode_eviction_ops_at_real_sizes_equal_their_references():
    """``evict_lowest`` at the 8B shape's decode eviction (8 KV heads, pages of 32, H2O's budget 2048 + 1 slots, 4
    rows: two evicting, one under its budget, one empty) against its torch reference, H2O's scores and StreamingLLM's
    positions with 4 sinks: exact (it compares and copies)."""
    from sparsecompile.kernels.evict_lowest import evict_lowest_reference, evict_lowest_triton

    torch.manual_seed(0)
    heads, page, dim, batch, width = 8, 32, 128, 4, 2080
    pages = batch * width // page + 1
    scores = torch.rand(pages, heads, page, device="cuda").mul_(8).floor_()  # ties
    pos = torch.randperm(pages * heads * page, device="cuda").reshape(pages, heads, page).to(torch.int32)
    table = torch.randperm(pages - 1, device="cuda")[:batch * (width // page)].reshape(batch, -1).to(torch.int32)
    counts = torch.tensor([2049, 2049, 1500, 0], device="cuda", dtype=torch.int32)
    budget = torch.tensor([2048, 2048, 2048, 2048], device="cuda")
    recent = torch.tensor([1024, 0, 16, 8], device="cuda")
    kv = [torch.randn(pages, heads, page, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for values, first, window in ((3, 0, recent), (2, 4, recent * 0)):
        pools = [t.clone() for t in (*kv, pos, scores)]
        want = [p.clone() for p in pools]
        evict_lowest_reference(want, values, table, counts, budget, window, first, width)
        evict_lowest_triton(pools, values, table, counts, budget, window, first, width)
        assert all(torch.equal(a, b) for a, b in zip(pools, want))
        assert not torch.equal(pools[0], kv[0])
