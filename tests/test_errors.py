"""Bad input gets a clear error at the API boundary, and leaves nothing allocated."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_pair
from transformers import DynamicCache

import sparsecompile
from sparsecompile import MethodConfigError, UnsupportedModelError
from sparsecompile.models.hf_patch import patch_of, patched_model


def test_unknown_method():
    _, model = tiny_pair()
    with pytest.raises(MethodConfigError, match="unknown method 'snapkvv'.*available methods: .*vanilla"):
        sparsecompile.optimize(model, "snapkvv")


def test_unknown_option_lists_valid_ones():
    _, model = tiny_pair()
    with pytest.raises(MethodConfigError, match="unknown option.*bugdet.*valid options: .*page_size"):
        sparsecompile.optimize(model, "vanilla", bugdet=10)


@pytest.mark.parametrize("options,match", [({"page_size": 3}, "power of two"), ({"prefill_chunk_size": -1}, ">= 0"),
                                           ({"compile": "yes"}, "True, False or 'auto'"),
                                           ({"num_pages": 0}, "positive")])
def test_out_of_range_engine_options(options, match):
    _, model = tiny_pair()
    with pytest.raises(MethodConfigError, match=match):
        sparsecompile.optimize(model, **options)


def test_prompt_over_max_length():
    _, model = tiny_pair(max_position_embeddings=32)
    sparsecompile.optimize(model)
    ids = torch.randint(3, 96, (1, 40))
    with pytest.raises(ValueError, match="exceeds the model's maximum length 32"):
        model.generate(input_ids=ids, max_new_tokens=2)
    manager = patched_model(model).controller.manager
    assert manager is None or manager.allocator.num_free == manager.num_pages


def test_foreign_cache_refused():
    _, model = tiny_pair()
    sparsecompile.optimize(model)
    ids = torch.randint(3, 96, (1, 5))
    with pytest.raises(TypeError, match="manages the KV cache itself; got a DynamicCache"):
        model.generate(input_ids=ids, max_new_tokens=2, past_key_values=DynamicCache())


def test_another_models_cache_is_refused_before_it_reads_this_pool():
    """A SparseCache names rows of its own model's pool: passed to another patched model whose row 0 is live (here a
    cache of its own, held), it would have continued that other sequence's KV."""
    _, first = tiny_pair(seed=1)
    _, second = tiny_pair(seed=2)
    sparsecompile.optimize(first)
    sparsecompile.optimize(second)
    ids = torch.randint(3, 96, (1, 5))
    theirs = first.generate(ids, max_new_tokens=2, return_dict_in_generate=True)
    ours = second.generate(ids, max_new_tokens=2, return_dict_in_generate=True)  # row 0 of second's pool
    foreign = theirs["cache"] if "cache" in theirs else theirs["past_key_values"]
    name = patched_model(second).cache_name
    longer = torch.cat([theirs.sequences, ids], 1)
    with pytest.raises(ValueError, match="holds another model's sequences"):
        second.generate(longer, max_new_tokens=2, **{name: foreign})
    with pytest.raises(ValueError, match="holds another model's sequences"):
        second(longer[:, -1:], **{name: foreign})
    for out in (theirs, ours):
        (out["cache"] if "cache" in out else out["past_key_values"]).release()


def test_beam_search_refused():
    _, model = tiny_pair()
    sparsecompile.optimize(model)
    with pytest.raises(ValueError, match="beam search"):
        model.generate(input_ids=torch.randint(3, 96, (1, 5)), max_new_tokens=2, num_beams=2)


def test_unsupported_models_refused():
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    gemma2 = AutoModelForCausalLM.from_config(tiny_config("gemma3_text", attn_logit_softcapping=50.0))
    with pytest.raises(UnsupportedModelError, match="softcapping"):
        sparsecompile.optimize(gemma2)


def test_a_config_that_misdescribes_the_kv_heads_is_named_and_the_model_restored():
    """The pool is sized from the config: a model whose attention makes other K/V shapes (a config edited after
    loading, a model that ignores ``num_key_value_heads``) gets the mismatch named, not an indexing error."""
    reference, model = tiny_pair("llama")
    model.config.num_key_value_heads = 1  # the model was built with 2
    with pytest.raises(RuntimeError, match="2 heads x 16 dims, but the model's config describes 1 x 16"):
        sparsecompile.optimize(model)
    assert patch_of(model) is None
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False),
                       reference.generate(ids, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("overrides,match", [
    (dict(global_head_dim=32), r"layers differ in head_dim \(\[16, 32\]\)"),  # wider full-attention heads
    (dict(global_head_dim=16, num_hidden_layers=4, num_kv_shared_layers=2,
          layer_types=["sliding_attention", "full_attention"] * 2), "last 2 layers reuse earlier layers' K/V"),
], ids=["per-layer head_dim", "kv sharing"])
def test_gemma4_per_layer_shapes_and_kv_sharing_are_refused(overrides, match):
    """Gemma 4 (transformers' heterogeneous per-layer configs): the pool has one K/V shape for every layer, and
    KV-shared layers would be stored and compressed as layers of their own (a crash with eviction methods)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "gemma4_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no Gemma 4")
    options = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=6)
    config = AutoConfig.for_model("gemma4_text", **{**options, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match=match):
        sparsecompile.optimize(model, method="snapkv", budget=64)
    assert patch_of(model) is None


def test_restore_gives_the_model_back():
    reference, model = tiny_pair()
    ids = torch.randint(3, 96, (1, 6))
    sparsecompile.optimize(model)
    out = model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    name = patched_model(model).cache_name
    sparsecompile.restore(model)
    assert patch_of(model) is None
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=4, do_sample=False),
                       reference.generate(input_ids=ids, max_new_tokens=4, do_sample=False))
    # a cache of the patched model, passed to the restored one: named, not a shape error in its attention
    with pytest.raises(RuntimeError, match="works only with the sparsecompile-patched model it came from"):
        model.generate(input_ids=torch.cat([out.sequences, ids], 1), max_new_tokens=2, **{name: cache})
