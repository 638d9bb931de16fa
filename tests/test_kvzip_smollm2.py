"""KVzip and interval pruning on the embedded SmolLM2-135M (fp32, CPU): passkey retrieval.

Measured depth matrix (the Austen haystack, ~3K-token chat prompt, 12 greedy tokens; ratio 0.3 keeps 30 % of the
prompt's entries): see ``DEPTH_MATRIX``; the test re-runs the depths where KVzip retrieves and the unpatched model
does too. The agent test hides a passkey in an old tool result and prunes a *different* tool result to 0 and to
20 % of its tokens (KVzip scoring) on forks of one idle chain: the passkey is still retrieved.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from needle import _filler_paragraphs, passkey_prompt

import sparsecompile
from sparsecompile import LLM, SamplingParams
from sparsecompile.methods.kvzip import CONTINUE_TEXT, REPEAT_TEXT

pytestmark = pytest.mark.slow

PASSKEY = "68213"
# depth -> retrieved by (the unpatched model, kvzip global, kvzip uniform), ratio 0.3, measured on CPU in fp32
# (benchmarks/kvzip_passkey.py, benchmarks/results/kvzip_passkey_cpu.jsonl; SnapKV at 0.3 retrieves at all three);
# uniform selection (30 % in every layer and head) answers near misses ("67", "683", "6832"); global lets them differ
DEPTH_MATRIX = {0.2: (True, True, False), 0.5: (True, True, False), 0.8: (True, True, False)}


def _found(tokenizer, ids) -> bool:
    return PASSKEY in re.sub(r"\D", "", tokenizer.decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("depth", [0.2])
def test_kvzip_retrieves_a_passkey_at_ratio_0_3(smollm2, depth):
    model, tokenizer = smollm2
    model = copy.deepcopy(model)
    lead = {name: tokenizer.encode(text, add_special_tokens=False)
            for name, text in (("repeat_ids", REPEAT_TEXT), ("continue_ids", CONTINUE_TEXT))}
    sparsecompile.optimize(model, "kvzip", ratio=0.3, **lead)
    ids = passkey_prompt(tokenizer, PASSKEY, target_tokens=3000, depth=depth, source="austen")
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         return_dict_in_generate=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    assert _found(tokenizer, out.sequences[0, ids.shape[1]:])
    stats = sparsecompile.kv_stats(cache)
    n = ids.shape[1]
    # global selection: 30 layers x 3 heads x int(0.3 n) entries in all, then 11 decoded tokens per head
    assert sum(layer.resident_tokens for layer in stats.layers) <= 30 * 3 * (int(0.3 * n) + 11)
    cache.release()


def test_pruning_another_tool_result_keeps_an_old_passkey(smollm2):
    model, tokenizer = smollm2
    llm = LLM(copy.deepcopy(model), "snapkv", tokenizer=tokenizer, budget=8192, page_size=16, max_num_seqs=4)
    paragraphs = _filler_paragraphs("austen")
    needle = f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key."
    tool_a = "\n\n".join([*paragraphs[:4], needle, *paragraphs[4:8]])
    tool_b = "\n\n".join(paragraphs[20:30])

    def segment(text: str) -> list[int]:
        return tokenizer(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False).input_ids

    params = SamplingParams(temperature=0, max_tokens=8)
    history = tokenizer.apply_chat_template([{"role": "system", "content": "You read tool results and remember "
                                              "any pass key."}], tokenize=False)
    history = tokenizer(history, add_special_tokens=False).input_ids + segment(f"Tool result 1:\n{tool_a}")
    history += llm.generate([history], params, use_tqdm=False, chain_ids=["main"])[0].outputs[0].token_ids
    start = len(history)
    history += segment(f"Tool result 2:\n{tool_b}")
    end = len(history)
    history += llm.generate([history], params, use_tqdm=False, chain_ids=["main"])[0].outputs[0].token_ids
    llm.fork_chain("main", "drop")
    llm.fork_chain("main", "keep20")
    lo, hi = -(-start // 16) * 16, end // 16 * 16
    assert hi - lo > 500
    assert llm.prune("drop", [(lo, hi)], keep_tokens=0).removed_entries == 30 * 3 * (hi - lo)
    llm.prune("keep20", [(lo, hi)], keep_tokens=int(0.2 * (hi - lo)), policy="kvzip")
    question = history + segment("What is the pass key from tool result 1? Answer with the number only.")
    outs = llm.generate([question] * 3, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False,
                        chain_ids=["main", "drop", "keep20"])
    assert [o.metrics.compressed_history for o in outs] == [False, True, True]
    assert [_found(tokenizer, o.outputs[0].token_ids) for o in outs] == [True, True, True]
