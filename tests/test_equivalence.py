"""Token-for-token equality with the unpatched model (greedy and seeded sampling)."""

from __future__ import annotations

import pytest
import torch
from method_matrix import DENSE_EQUIVALENT
from tiny_models import ARCHITECTURES, left_padded_batch, tiny_config, tiny_pair
from transformers import LlamaForCausalLM

import sparsecompile
from sparsecompile.models.hf_patch import patched_model

GREEDY = dict(max_new_tokens=16, do_sample=False)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_vanilla_greedy_left_padded_batch(model_type):
    reference, model = tiny_pair(model_type)
    ids, mask = left_padded_batch()
    want = reference.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    sparsecompile.optimize(model, "vanilla", page_size=4, prefill_chunk_size=4)
    got = model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, want)


@pytest.mark.parametrize("method", sorted(DENSE_EQUIVALENT))
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_methods_keeping_everything_equal_dense(method, model_type):
    reference, model = tiny_pair(model_type, seed=3)
    ids, mask = left_padded_batch((11, 6, 8), seed=5)
    want = reference.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    sparsecompile.optimize(model, method, page_size=4, prefill_chunk_size=5, **DENSE_EQUIVALENT[method])
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **GREEDY), want)


def test_seeded_sampling_equal():
    reference, model = tiny_pair("llama", seed=2)
    ids, mask = left_padded_batch()
    sampling = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=20, top_p=0.95)
    torch.manual_seed(123)
    want = reference.generate(input_ids=ids, attention_mask=mask, **sampling)
    sparsecompile.optimize(model, page_size=4)
    torch.manual_seed(123)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **sampling), want)


def test_forward_logits_and_continuation():
    """Direct forward calls: full logits, then a continuation through the returned cache."""
    reference, model = tiny_pair("qwen2", seed=4)
    ids = torch.randint(3, 96, (2, 10))
    sparsecompile.optimize(model, page_size=4, prefill_chunk_size=3)
    want = reference(ids).logits
    out = model(ids)
    torch.testing.assert_close(out.logits, want, atol=1e-5, rtol=1e-5)
    cache = out.cache if "cache" in out else out.past_key_values
    nxt = torch.randint(3, 96, (2, 4))
    got = model(nxt, **{patched_model(model).cache_name: cache}).logits
    torch.testing.assert_close(got, reference(torch.cat([ids, nxt], 1)).logits[:, -4:], atol=1e-5, rtol=1e-5)
    cache.release()


def test_generate_returns_usable_cache_and_releases_pages():
    _, model = tiny_pair("llama")
    ids, mask = left_padded_batch()
    sparsecompile.optimize(model, page_size=4)
    model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    manager = patched_model(model).controller.manager
    assert manager.allocator.num_free == manager.num_pages  # released after generate
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    assert manager.allocator.num_used > 0
    cache.release()
    assert manager.allocator.num_free == manager.num_pages


class _RawSdpaLlama(LlamaForCausalLM):
    """A causal LM that refuses ``set_attn_implementation`` (as Falcon did before transformers 5.25): its attention
    stays HF's SDPA, which only the SDPA-rewrite fallback reaches."""

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return False


def test_sdpa_rewrite_fallback_for_a_model_that_ignores_set_attn_implementation():
    from sparsecompile.kernels.dense_attention import CALLS
    from sparsecompile.models.hf_patch import SdpaFallback, patch_of

    config = tiny_config("llama")
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference, model = _RawSdpaLlama(config).eval(), _RawSdpaLlama(config).eval()
    model.load_state_dict(reference.state_dict())
    ids, mask = left_padded_batch((9, 6, 4))
    want = reference.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    sparsecompile.optimize(model, "vanilla", compile=False)
    assert isinstance(patch_of(model), SdpaFallback)
    before = CALLS[0]
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **GREEDY), want)
    assert CALLS[0] - before == 2 * GREEDY["max_new_tokens"]  # every layer, every forward, through our op


def test_falcon_vanilla_equals_the_unpatched_model_on_its_path():
    """Falcon ignores ``set_attn_implementation`` before transformers 5.25 (the SDPA-rewrite fallback) and takes
    sparsecompile's attention from 5.25 on: the same tokens either way, every attention call through our ops."""
    from transformers import AutoModelForCausalLM, FalconConfig

    from sparsecompile.kernels.dense_attention import CALLS

    config = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                  new_decoder_architecture=True, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(FalconConfig(**config)).eval()
    model = AutoModelForCausalLM.from_config(FalconConfig(**config)).eval()
    model.load_state_dict(reference.state_dict())
    ids, mask = left_padded_batch((9, 6, 4))
    want = reference.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    sparsecompile.optimize(model, "vanilla", compile=False)
    fallback = not type(model)._can_set_attn_implementation()

    def calls() -> int:
        return CALLS[0] if fallback else patched_model(model).controller.attention_calls

    before = calls()
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **GREEDY), want)
    assert calls() - before == 2 * GREEDY["max_new_tokens"]  # every layer, every forward
