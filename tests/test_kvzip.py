"""``kvzip``: its reconstruction scores equal an independent computation of KVzip's formula (kvpress ``KVzipPress``:
the model re-reads each context chunk after a repeat prompt, through HF's own forward and DynamicCache here), its
kept sets are those scores' top-k, it is token for token vanilla when the budget holds everything, and it runs
through ``generate()`` and ``LLM`` alike."""

from __future__ import annotations

import math

import pytest
import torch
from test_llm import DigitTokenizer, prompts_of
from tiny_models import tiny_pair
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import sparsecompile
from sparsecompile import LLM, SamplingParams
from sparsecompile.methods.kvzip import KVzipRuntime
from sparsecompile.models.hf_patch import cache_argument_name

REPEAT, CONTINUE = [7, 8, 9], [10, 11]
OPTIONS = dict(chunk=16, lead_in=3, sinks=2, repeat_ids=REPEAT, continue_ids=CONTINUE, page_size=4,
               prefill_chunk_size=16)


def reference_scores(model, context: list[int], chunk: int, lead_in: int, sinks: int) -> torch.Tensor:
    """``[layers, kv_heads, n]`` KVzip scores of every context entry (first ``sinks`` positions: +inf), computed with
    the unpatched model: for each chunk, its lead-in + tokens run after the context in a DynamicCache; per layer the
    chunk's repeat queries (RoPE applied) attend over [sinks, the chunk's keys, their own keys] (causal among
    themselves); an entry scores its maximum probability over its KV group's heads and the queries."""
    config = model.config
    layers, kv_heads, q_heads = config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads
    n, dim = len(context), config.hidden_size // q_heads
    out = torch.zeros(layers, kv_heads, n)
    out[..., :sinks] = math.inf
    with torch.no_grad():
        cache = DynamicCache(config=config)
        name = cache_argument_name(model)  # past_key_values is deprecated in transformers 5.25, gone in 5.40
        model(input_ids=torch.tensor([context]), use_cache=True, **{name: cache})
        for j, lo in enumerate(range(0, n, chunk)):
            hi = min(n, lo + chunk)
            lead = REPEAT if j == 0 else CONTINUE + context[lo - lead_in:lo]
            ids = torch.tensor([lead + context[lo:hi]])
            q_len = ids.shape[1]
            result = model(input_ids=ids, use_cache=True, output_hidden_states=True, **{name: cache})
            positions = torch.arange(n, n + q_len)[None]
            for layer in range(layers):
                block = model.model.layers[layer]
                x = block.input_layernorm(result.hidden_states[layer])
                q = block.self_attn.q_proj(x).view(1, q_len, q_heads, dim).transpose(1, 2)
                cos, sin = model.model.rotary_emb(x, positions)
                q, _ = apply_rotary_pos_emb(q, q, cos, sin)
                keys = cache.layers[layer].keys  # [1, kv_heads, n + q_len, dim]
                sink = min(sinks, lo)
                sub = torch.cat([keys[:, :, :sink], keys[:, :, lo:hi], keys[:, :, n:]], dim=2)
                q = q.view(1, kv_heads, q_heads // kv_heads, q_len, dim)
                logits = (q @ sub[:, :, None].transpose(-1, -2)).float() / math.sqrt(dim)
                causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
                logits[..., -q_len:] = logits[..., -q_len:].masked_fill(~causal, -math.inf)
                probs = logits.softmax(-1)[..., sink:sink + hi - lo]
                out[layer, :, lo:hi] = probs.amax(dim=(2, 3))[0]
            cache.crop(-q_len)
    out[..., :sinks] = math.inf
    return out


def _captured_scores(monkeypatch) -> list[torch.Tensor]:
    """Capture each layer's ``kvzip_score`` slot metadata of the scored row right before KVzip evicts."""
    seen: list[torch.Tensor] = []
    original = KVzipRuntime.scoring_done

    def spy(self, manager, rows):
        row = rows[0]
        from sparsecompile.methods.interval_scoring import resident_layout

        for layer in range(self.model.num_layers):
            count = int(manager.slot_count_array([row])[0, layer])
            rows_t = torch.tensor([row])
            _, slots, _ = resident_layout(manager, layer, rows_t, torch.tensor([count]), count)
            meta = manager.slot_metadata["kvzip_score"]
            P = manager.layout.page_size
            head = torch.arange(slots.shape[1])[None, :, None]
            seen.append(meta[slots // P, head, slots % P][0].clone())
        original(self, manager, rows)

    monkeypatch.setattr(KVzipRuntime, "scoring_done", spy)
    return seen


def test_scores_equal_the_formula_and_kept_sets_are_their_top_k(monkeypatch):
    reference, model = tiny_pair()
    sparsecompile.optimize(model, "kvzip", budget=12, selection="uniform", **OPTIONS)
    seen = _captured_scores(monkeypatch)
    context = prompts_of([37], seed=3)[0]
    ids = torch.tensor([context])
    out = model(input_ids=ids, logits_to_keep=1)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    want = reference_scores(reference, context, chunk=16, lead_in=3, sinks=2)
    got = torch.stack(seen)
    torch.testing.assert_close(got[..., 2:], want[..., 2:], rtol=1e-4, atol=1e-6)
    for layer in range(2):
        for head, kept in enumerate(sparsecompile.retained_positions(cache, layer)[0]):
            ranked = want[layer, head].sort(descending=True, stable=True)
            assert kept.tolist() == sorted(ranked.indices[:12].tolist())
            assert ranked.values[11] > ranked.values[12]  # separated scores: the top-k is unambiguous
    cache.release()


def test_global_selection_keeps_the_best_entries_of_the_whole_model(monkeypatch):
    reference, model = tiny_pair()
    sparsecompile.optimize(model, "kvzip", budget=12, **OPTIONS)
    seen = _captured_scores(monkeypatch)
    context = prompts_of([37], seed=3)[0]
    out = model(input_ids=torch.tensor([context]), logits_to_keep=1)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    scores = torch.stack(seen)  # [layers, kv_heads, n]
    scores[..., :2] = math.inf  # the sinks
    threshold = scores.flatten().sort(descending=True).values[2 * 2 * 12 - 1]
    kept = [[p.tolist() for p in sparsecompile.retained_positions(cache, layer)[0]] for layer in range(2)]
    assert sum(len(h) for layer in kept for h in layer) == 2 * 2 * 12
    for layer in range(2):
        for head in range(2):
            assert kept[layer][head] == (scores[layer, head] >= threshold).nonzero().flatten().tolist()
    assert len({len(h) for layer in kept for h in layer}) > 1  # heads and layers keep different numbers
    cache.release()


@pytest.mark.parametrize("selection", ["global", "uniform"])
def test_generate_and_llm_agree_and_a_fitting_budget_is_vanilla(selection):
    reference, model = tiny_pair()
    _, served = tiny_pair()
    sparsecompile.optimize(model, "kvzip", budget=20, selection=selection, **OPTIONS)
    prompts = prompts_of([37, 12, 29], seed=6)
    params = SamplingParams(temperature=0, max_tokens=6)
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        want.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist())
    llm = LLM(served, "kvzip", tokenizer=DigitTokenizer(), budget=20, selection=selection, max_num_seqs=4,
              max_num_batched_tokens=24, **OPTIONS)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    short = prompts[1]  # 12 tokens + 6 generated: never over the budget, never re-read
    ids = torch.tensor([short])
    assert want[1] == reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                         do_sample=False, pad_token_id=0)[0, 12:].tolist()
    stats = llm.llm_engine.stats()
    assert stats.free_pages == stats.total_pages


@pytest.mark.parametrize("method,extra", [("kvzip", {}), ("kvzip+kivi", dict(bits=4, residual=64, group_size=16))])
def test_a_model_whose_every_layer_slides_keeps_everything(method, extra):
    """Sliding-window layers are kept whole; when every layer slides (Mistral v0.1) there is nothing to score and the
    prompt runs as vanilla (it crashed on an empty selection, found by a random batch-invariance run)."""
    reference, model = tiny_pair("mistral", sliding_window=9)
    sparsecompile.optimize(model, method, budget=8, **OPTIONS, **extra)
    ids = torch.randint(3, 95, (1, 30), generator=torch.Generator().manual_seed(4))
    want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False),
                       want)


def test_a_prompt_after_an_uneven_compaction_reads_only_kept_entries():
    """Global selection keeps different numbers of entries per head, so a shorter head's last slots are empty. A later
    prompt on the row (a conversation's next turn, here on a fork) must not read them: its prefill logits equal
    feeding the same tokens one decode step at a time. Before, the row was not marked as holed and the prefill's
    dense fast path read the empty slots' stale K/V (found by a random chain run: two conversations batched gave
    other tokens than each alone); a fork did not inherit the mark either."""
    _, model = tiny_pair()
    sparsecompile.optimize(model, "kvzip", budget=12, **OPTIONS)
    context = torch.randint(3, 95, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = sparsecompile.compress(model, context)
    kept = [[len(p) for p in layer[0]] for layer in (sparsecompile.retained_positions(cache, i) for i in range(2))]
    assert any(len(set(heads)) > 1 for heads in kept), kept  # uneven heads: empty slots
    fork = cache.fork()
    more = torch.randint(3, 95, (1, 6), generator=torch.Generator().manual_seed(4))
    name = cache_argument_name(model)
    prefilled = model(more, **{name: fork}).logits[0]
    stepped = torch.cat([model(more[:, i:i + 1], **{name: cache}).logits[0] for i in range(6)])
    torch.testing.assert_close(prefilled, stepped, atol=1e-5, rtol=1e-5)
    fork.release()
    cache.release()
