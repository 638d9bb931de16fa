"""CUDA-only (skipped without a GPU): the serving engine's mixed step (decode tokens and prompt chunks in one
forward, Triton kernels for both parts) next to CUDA-graph decode steps gives the tokens of the unmixed engine
(fp32), and a step that decodes and prefills runs one forward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_mixed_step import forwards_per_step, record_forwards  # noqa: E402
from tiny_models import tiny_pair  # noqa: E402

from sparsecompile import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ENGINE = dict(page_size=16, prefill_chunk_size=64, compile=True, cuda_graphs=True, max_num_seqs=4,
              max_num_batched_tokens=160, cuda_graph_sizes=[1, 2, 4])


class Digits:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"{t} " for t in ids)


@pytest.mark.parametrize("method,options", [
    ("vanilla", {}), ("h2o", {"budget": 48}), ("quest", {"budget": 64, "dense_layers": 0, "dense_below": 0}),
    ("snapkv+kivi", {"budget": 64, "window": 8, "residual": 16, "group_size": 16}),
])
def test_mixed_steps_equal_separate_forwards_on_cuda(method, options):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (150, 23, 97, 61, 130, 12, 77, 40)]
    params = SamplingParams(temperature=0, max_tokens=16)
    tokens, forwards = [], []
    for mixed in (True, False):
        _, model = tiny_pair()
        llm = LLM(model.cuda(), method, tokenizer=Digits(), enable_mixed_chunk=mixed, **ENGINE, **options)
        record = record_forwards(llm)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        forwards.append(forwards_per_step(record))
    assert tokens[0] == tokens[1]
    mixed, separate = forwards
    assert any("mixed" in s for s in mixed) and not any({"decode", "prefill"} <= s for s in mixed)
    assert any({"decode", "prefill"} <= s for s in separate) and not any("mixed" in s for s in separate)


@pytest.mark.parametrize("method,options,compile_prefill", [
    ("vanilla", {}, False), ("vanilla", {}, True),
    ("quest", {"budget": 64, "dense_layers": 0, "dense_below": 0}, False),
    ("omnikv", {"budget": 64, "filter_layers": "0", "dense_below": 0}, False),
])
def test_replayed_mixed_steps_equal_eager_ones_on_cuda(method, options, compile_prefill):
    """Mixed steps recorded as CUDA graphs (``runtime/mixed_graphs.py``, on by default for the methods that allow
    it) give the tokens of mixed steps run op by op (fp32), with and without the compiled decoder layers inside the
    graph, selection methods selecting in the decode part; steps really replayed, and every page came back."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (150, 23, 97, 61, 130, 12, 77, 40, 64, 64,
                                                                          64, 64, 33, 33, 33)]
    params = SamplingParams(temperature=0, max_tokens=16)
    tokens, replayed = [], []
    for graphs in (True, False):
        _, model = tiny_pair()
        llm = LLM(model.cuda(), method, tokenizer=Digits(), mixed_cuda_graphs=graphs,
                  compile_prefill=compile_prefill, **ENGINE, **options)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        engine = llm.llm_engine
        assert engine.replays_mixed_steps == graphs
        replayed.append(engine.controller.mixed_replays.replayed if graphs else 0)
        stats = engine.stats()
        assert stats.free_pages == stats.total_pages
    assert tokens[0] == tokens[1]
    assert replayed[0] > 0
