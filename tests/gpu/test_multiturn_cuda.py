"""CUDA-only (skipped without a GPU): multi-turn reuse with compiled, CUDA-graph decode and the Triton scoring
kernels: chain continuations equal generate() continued from its cache, prefix hits equal misses, KVzip keeps the
sets its CPU run keeps, and pruning frees pages and continues."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_chain_cache import generate_turns  # noqa: E402
from tiny_models import tiny_pair  # noqa: E402

import sparsecompile  # noqa: E402
from sparsecompile import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

T = 6
ENGINE = dict(page_size=16, prefill_chunk_size=64, compile=True, cuda_graphs=True)


class Digits:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"{t} " for t in ids)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def _cuda_pair():
    reference, candidate = tiny_pair()
    return reference.cuda(), candidate.cuda()


@pytest.mark.parametrize("method,options", [("snapkv", {"budget": 96, "window": 8}), ("h2o", {"budget": 96}),
                                            ("kvzip", {"budget": 96, "chunk": 64})])
def test_chain_continuation_with_cuda_graph_decode_equals_generate(method, options):
    reference, candidate = _cuda_pair()
    sparsecompile.optimize(reference, method, **ENGINE, **options)
    parts = _prompts([150, 90, 70], seed=1)
    want = generate_turns(reference, parts, device="cuda", new_tokens=T)
    llm = LLM(candidate, method, tokenizer=Digits(), max_num_seqs=4, cuda_graph_sizes=[4], **ENGINE, **options)
    got, prompt = [], []
    for part in parts:
        prompt = prompt + (got[-1] if got else []) + part
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=T), use_tqdm=False, chain_ids=["c"])
        got.append(out[0].outputs[0].token_ids)
    assert got == want
    assert llm.llm_engine.stats().reuse.chain_hits == 2


@pytest.mark.parametrize("method,options", [("vanilla", {}),
                                            ("quest", {"budget": 64, "dense_layers": 0, "dense_below": 0})])
def test_prefix_hits_equal_misses_on_cuda(method, options):
    _, model = _cuda_pair()
    _, plain_model = _cuda_pair()
    params = SamplingParams(temperature=0, max_tokens=T)
    llm = LLM(model, method, tokenizer=Digits(), enable_prefix_caching=True, max_num_seqs=4, cuda_graph_sizes=[4],
              **ENGINE, **options)
    plain = LLM(plain_model, method, tokenizer=Digits(), max_num_seqs=4, cuda_graph_sizes=[4], **ENGINE, **options)
    base = _prompts([200], seed=2)[0]
    prompts = [base + tail for tail in _prompts([5, 40, 90], seed=3)]
    llm.generate([base], params, use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain.generate(
        prompts, params, use_tqdm=False)]
    assert all(o.metrics.num_cached_tokens == 192 for o in outs)


def test_kvzip_keeps_the_cpu_sets_and_prune_frees_pages_on_cuda():
    _, model = tiny_pair()
    cpu = copy.deepcopy(model)
    options = dict(budget=48, chunk=64, selection="uniform", page_size=16, prefill_chunk_size=64)
    sparsecompile.optimize(cpu, "kvzip", **options)
    gpu = sparsecompile.optimize(copy.deepcopy(model).cuda(), "kvzip", **options)
    ids = torch.tensor(_prompts([180], seed=4))
    kept = []
    for m, device in ((cpu, "cpu"), (gpu, "cuda")):
        out = m(input_ids=ids.to(device), logits_to_keep=1)
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        kept.append([[p.tolist() for p in sparsecompile.retained_positions(cache, layer)[0]] for layer in range(2)])
        cache.release()
    assert kept[0] == kept[1]
    _, served = _cuda_pair()
    llm = LLM(served, "snapkv", tokenizer=Digits(), budget=1024, max_num_seqs=4, cuda_graph_sizes=[4], **ENGINE)
    prompt = _prompts([300], seed=5)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=T), use_tqdm=False, chain_ids=["p"])[0]
    free = llm.llm_engine.stats().free_pages
    result = llm.prune("p", [(32, 256)], keep_tokens=40, policy="kvzip")
    assert result.removed_entries == 2 * 2 * (224 - 40) and llm.llm_engine.stats().free_pages > free
    cont = llm.generate([prompt + out.outputs[0].token_ids + [5] * 20], SamplingParams(temperature=0, max_tokens=T),
                        use_tqdm=False, chain_ids=["p"])[0]
    assert cont.metrics.chain_hit and cont.metrics.compressed_history
