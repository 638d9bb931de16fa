"""KIVI on the embedded SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, fp32 on CPU).

Measured (greedy): on the quickstart prompt (37 tokens) KIVI 4-bit with residual 32 gives vanilla's 39 tokens
exactly (the first 32 slots are quantized once the cache holds 64); with residual 0 it diverges at token 6, where
vanilla's top-2 logit margin is 0.29 (KL to vanilla 0.001-0.01 per step at 4 bits, 0.1-0.2 at 2 bits). In the
~3K-token passkey prompt KIVI 2-bit (default residual 128) and snapkv+kivi (budget 512, 2 bits) answer at depths
0.2 / 0.5 / 0.8, like the unpatched model and SnapKV (tests/test_passkey_smollm2.py), while holding 19.2 MB and
8.1 MB of K/V against vanilla's 139.1 MB and SnapKV's 23.7 MB; quest+kivi (budget 512, 2 bits, 499 slots a KV head
read in a sparse layer) answers at all three holding 19.2 MB.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from needle import passkey_prompt

import sparsecompile

pytestmark = pytest.mark.slow

PASSKEY, BUDGET, NEW = "68213", 512, 12
LAYERS, KV_HEADS, DIM = 30, 3, 64


def _kivi_bytes(count: int, bits: int = 2, group: int = 32, residual: int = 128) -> int:
    """Independent formula: per KV head, quantized slots cost their codes (K + V, ``bits`` each per channel) and
    their value scale + zero per channel group (fp16), each key group a scale + zero per channel (fp16), and the
    residual slots their K + V in fp32."""
    q = max(0, (count - residual) // group * group)
    per_head = q * (2 * DIM * bits / 8 + 2 * 2 * DIM / group) + q / group * 2 * 2 * DIM + (count - q) * 2 * DIM * 4
    return int(LAYERS * KV_HEADS * per_head)


def test_kivi4_quickstart_greedy_equals_vanilla(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "Write one sentence about the ocean."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    want = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    kivi = sparsecompile.optimize(copy.deepcopy(model), "kivi", bits=4, residual=32)
    out = kivi.generate(**inputs, max_new_tokens=32, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    count = out.sequences.shape[1] - 1  # the last token was sampled, not written
    assert count > 64  # so the first 32 slots are quantized
    assert sparsecompile.kv_stats(cache).resident_bytes == _kivi_bytes(count, bits=4, residual=32)
    cache.release()


OPTIONS = {"kivi": {}, "snapkv+kivi": dict(budget=BUDGET),
           # selecting at every length (the default reads a 3K-token batch densely); Quest alone, with its 16-slot
           # pages, answers 6821 at depth 0.2 (benchmarks/results/quest_kivi_passkey_cpu.jsonl)
           "quest+kivi": dict(budget=BUDGET, dense_below=0)}


@pytest.mark.parametrize("method,depth", [("kivi", 0.2), ("kivi", 0.8), ("snapkv+kivi", 0.2), ("snapkv+kivi", 0.8),
                                          ("quest+kivi", 0.2)])
def test_kivi2_passkey(smollm2, method, depth):
    model, tokenizer = smollm2
    ids = passkey_prompt(tokenizer, PASSKEY, target_tokens=3000, depth=depth, source="austen")
    options = dict(bits=2, **OPTIONS[method])
    patched = sparsecompile.optimize(copy.deepcopy(model), method, **options)
    out = patched.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                           return_dict_in_generate=True)
    text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    assert PASSKEY in re.sub(r"\D", "", text)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    stats = sparsecompile.kv_stats(cache)
    generated = out.sequences.shape[1] - ids.shape[1]  # the last one was sampled, not written
    count = (BUDGET if method == "snapkv+kivi" else ids.shape[1]) + generated - 1
    assert stats.resident_bytes == _kivi_bytes(count)
    assert stats.allocated_pages == LAYERS * -(-count // 32)  # pages of 32 slots; evicted ones were freed
    if method == "quest+kivi":  # Quest's first two layers read everything, the others at most the budget
        assert all(layer.tokens_read <= BUDGET * KV_HEADS for layer in stats.layers[2:])
    cache.release()
