"""Continuous batching is invisible in the tokens: requests arriving at random steps, some aborted mid-prompt or mid-
decode, on a pool small enough to preempt, each get the tokens they get alone on the engine.

Where that holds exactly: for every method that decides per row, including under a step budget that splits prompt
chunks (a method whose result depends on where chunks end is fed ``prefill_chunk_size`` chunks whatever the budget:
``PrefillMode.ALIGNED``, H2O and KIVI); and under preemption: dense methods re-prefill prompt + output, the others the
prompt alone, then replay the output as decode steps (``SparseMethod.recomputes_by_prefill``; before 2026-12-05,
prompt + output re-prefilled as one prompt gave Quest under its budget other tokens, which an eviction method also
compresses as a new prompt, and that prefill could need more than the whole pool). Fuzzed on 2026-12-04 (fifteenth
session) with 10 seeds for vanilla, snapkv, snapkv+kivi, quest, omnikv, pyramidkv, streamingllm, kvzip, h2o and
h2o+kivi on a large pool and vanilla, quest, omnikv and kivi on a preempting one: no difference (quest+kivi, 2026-12-05:
seeds 0-5 at both step budgets, preempting at 0, 1 and 5). With chunks split by
the step budget, ``kivi`` gave other tokens until it became ALIGNED (sixteenth session: a chunk reads the groups
earlier chunks left quantized)"""

from __future__ import annotations

import numpy as np
import pytest
from test_llm import DigitTokenizer
from tiny_models import tiny_pair

from sparsecompile import LLM, SamplingParams

CASES = {"vanilla": ({}, 40), "kivi": ({"residual": 8, "group_size": 4}, 40),
         "snapkv+kivi": ({"budget": 24, "window": 4, "residual": 8, "group_size": 4}, 200),
         "h2o+kivi": ({"budget": 24, "residual": 8, "group_size": 4}, 24),
         "snapkv": ({"budget": 24, "window": 4}, 24), "quest": ({"budget": 8, "dense_layers": 0, "dense_below": 0}, 40),
         # the residual (8-12 slots read) and 1-2 chosen pages of one group a step
         "quest+kivi": ({"budget": 16, "dense_layers": 0, "dense_below": 0, "residual": 8, "group_size": 4}, 40)}


def _engine(method: str, pages: int, seqs: int, budget: int = 64):
    _, model = tiny_pair()
    options, _ = CASES[method]
    return LLM(model, method, tokenizer=DigitTokenizer(), num_pages=pages, max_model_len=100, max_num_seqs=seqs,
               max_num_batched_tokens=budget, page_size=4, prefill_chunk_size=8, **options).llm_engine


def _finish(engine, outs: dict) -> None:
    for o in engine.step():
        if o.finished:
            outs[o.request_id] = o.outputs[0].token_ids


@pytest.mark.parametrize("method, seed, budget", [("vanilla", 0, 64), ("vanilla", 1, 64), ("kivi", 0, 64),
                                                  ("snapkv+kivi", 2, 64), ("h2o+kivi", 3, 64), ("kivi", 8, 11),
                                                  ("snapkv", 1, 64), ("quest", 0, 64), ("quest+kivi", 0, 64),
                                                  ("quest+kivi", 1, 11)])
def test_batched_requests_get_their_solo_tokens(method: str, seed: int, budget: int) -> None:
    """``budget`` 11: the step's decodes and chunks of 8 leave remainders that would split a chunk."""
    rng = np.random.default_rng(seed)
    requests = [(int(rng.integers(0, 12)), rng.integers(3, 90, int(rng.integers(4, 40))).tolist(),
                 int(rng.integers(1, 16)), int(rng.integers(1, 30)) if rng.random() < 0.3 else None)
                for _ in range(8)]  # (arrival step, prompt, max_tokens, abort after)
    engine = _engine(method, CASES[method][1], 4, budget)
    outs, aborted = {}, set()
    for step in range(400):
        for i, (at, prompt, new, abort) in enumerate(requests):
            if at == step:
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=new))
            if abort is not None and at + abort == step and f"r{i}" not in outs:
                engine.abort_request(f"r{i}")
                aborted.add(f"r{i}")
        _finish(engine, outs)
        if step > 12 and not engine.has_unfinished_requests():
            break
    assert len(outs) == len(requests) and aborted
    assert budget < 64 or CASES[method][1] > 40 or engine.stats().num_preemptions  # the small pools preempt
    for i, (_, prompt, new, _) in enumerate(requests):
        if f"r{i}" in aborted:
            continue
        alone = _engine(method, 200, 1, budget)
        alone.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=new))
        solo: dict = {}
        while alone.has_unfinished_requests():
            _finish(alone, solo)
        assert outs[f"r{i}"] == solo["x"], i
