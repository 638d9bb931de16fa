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
