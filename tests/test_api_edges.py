"""The Python API's edges: models we cannot place, things that are not models, option aliases (vLLM / kvpress),
the ``patched`` context manager, Hugging Face model ids."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config, tiny_pair
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import sparsecompile
from sparsecompile import MethodConfigError, UnsupportedModelError
from sparsecompile.models.hf_patch import patch_of, patched_model


# ------------------------------------------------------------------------------------------------ placement
def test_weights_on_the_meta_device_are_refused():
    from accelerate import init_empty_weights

    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(tiny_config())
    with pytest.raises(UnsupportedModelError, match="meta device.*init_empty_weights"):
        sparsecompile.optimize(empty)
    assert patch_of(empty) is None


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload"])
def test_accelerate_offload_is_refused(offload, tmp_path):
    import accelerate

    _, model = tiny_pair()
    if offload == "cpu_offload":
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        accelerate.disk_offload(model, offload_dir=str(tmp_path), execution_device=torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match="accelerate offloads them"):
        sparsecompile.optimize(model)
    assert patch_of(model) is None


@pytest.mark.parametrize("device_map,match", [
    ({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"},
     "device_map offloads weights \\(model.layers.1, model.norm, lm_head on cpu\\)"),
    ({"model": "cpu", "lm_head": "disk"}, "lm_head on disk"),
    ({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "lm_head": 1},
     "spreads the layers over 2 devices \\(cuda:0, cuda:1\\).*tensor parallelism.*tensor_parallel_size"),
])
def test_device_maps_we_cannot_place_are_refused(device_map, match):
    reference, model = tiny_pair()
    model.hf_device_map = device_map
    with pytest.raises(UnsupportedModelError, match=match):
        sparsecompile.optimize(model)
    assert patch_of(model) is None
    ids = torch.randint(3, 95, (1, 5))
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=3), reference.generate(input_ids=ids,
                                                                                          max_new_tokens=3))


def test_a_single_device_map_is_accepted():
    _, model = tiny_pair()
    model.hf_device_map = {"": "cpu"}
    sparsecompile.optimize(model)
    assert patch_of(model) is not None


def test_one_weight_left_on_the_meta_device_is_refused():
    _, model = tiny_pair()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().to("meta"))
    with pytest.raises(UnsupportedModelError, match="1 weights are on the meta device \\(e.g. lm_head.weight\\)"):
        sparsecompile.optimize(model)


# ------------------------------------------------------------------------------------------------ not a model
@pytest.mark.parametrize("target,error,match", [
    ("HuggingFaceTB/SmolLM2-135M", TypeError, "takes a loaded model, got the str 'HuggingFaceTB/SmolLM2-135M'.*"
                                              "sparsecompile.LLM"),
    (LlamaForCausalLM, TypeError, "got the class LlamaForCausalLM: instantiate it"),
    (torch.nn.Linear(2, 2), UnsupportedModelError, "Linear is not an HF causal LM"),
    (42, TypeError, "got a int"),
])
def test_optimize_refuses_what_is_not_a_causal_lm(target, error, match):
    with pytest.raises(error, match=match):
        sparsecompile.optimize(target)


def test_base_model_without_head_is_refused():
    _, model = tiny_pair()
    with pytest.raises(UnsupportedModelError, match="LlamaModel is not"):
        sparsecompile.optimize(model.model)


def test_string_page_size_says_to_pass_the_number():
    _, model = tiny_pair()
    with pytest.raises(MethodConfigError, match="page_size must be a positive power of two.*the string '16' "
                                                "\\(pass the number 16, not a string\\)"):
        sparsecompile.optimize(model, page_size="16")


# ------------------------------------------------------------------------------------------------ aliases
def _kept_tokens(model, prompt_len: int) -> list[int]:
    ids = torch.randint(3, 95, (1, prompt_len), generator=torch.Generator().manual_seed(3))
    out = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    kept = [len(p) for p in sparsecompile.retained_positions(cache, 0)[0]]
    positions = [p.tolist() for p in sparsecompile.retained_positions(cache, 1)[0]]
    cache.release()
    return kept, positions


def test_compression_ratio_is_kvpress_fraction_removed():
    _, by_ratio = tiny_pair()
    _, by_compression = tiny_pair()
    sparsecompile.optimize(by_ratio, "snapkv", ratio=1 - 0.7, window=4, kernel=3, page_size=4)
    sparsecompile.optimize(by_compression, "snapkv", compression_ratio=0.7, window=4, kernel=3, page_size=4)
    kept, positions = _kept_tokens(by_compression, 40)
    assert kept == [int(40 * (1 - 0.7))] * 2  # kvpress: n_kept = int(q_len * (1 - compression_ratio))
    assert (kept, positions) == _kept_tokens(by_ratio, 40)


@pytest.mark.parametrize("options,match", [
    ({"compression_ratio": 0.5, "budget": 8}, "'compression_ratio' .* cannot be given with 'budget'"),
    ({"compression_ratio": 0.5, "ratio": 0.5}, "cannot be given with 'ratio'"),
    ({"compression_ratio": 1.0}, "compression_ratio .* must be in \\[0, 1\\)"),
    ({"block_size": 8, "page_size": 8}, "'block_size' \\(vLLM's name for page_size\\) cannot be given with"),
])
def test_alias_conflicts(options, match):
    _, model = tiny_pair()
    with pytest.raises(MethodConfigError, match=match):
        sparsecompile.optimize(model, "snapkv", **options)


def test_compression_ratio_only_for_eviction_methods():
    _, model = tiny_pair()
    with pytest.raises(MethodConfigError, match="applies to the eviction methods \\(h2o, h2o\\+kivi, kvzip, "
                                                "kvzip\\+kivi, pyramidkv, pyramidkv\\+kivi, snapkv, snapkv\\+kivi, "
                                                "streamingllm, streamingllm\\+kivi\\), "
                                                "not to 'quest'"):
        sparsecompile.optimize(model, "quest", compression_ratio=0.5)
    sparsecompile.optimize(model, "streamingllm", compression_ratio=0.5, block_size=8)
    assert patched_model(model).controller.layout.page_size == 8


# ------------------------------------------------------------------------------------------------ patched()
def test_patched_context_manager_restores_on_exit_and_on_error():
    reference, model = tiny_pair()
    ids = torch.randint(3, 95, (1, 30), generator=torch.Generator().manual_seed(5))
    want = reference.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    with sparsecompile.patched(model, method="snapkv", budget=8, window=4, page_size=4) as inside:
        assert inside is model and patched_model(model).controller.runtime.name == "snapkv"
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert patch_of(model) is None and "forward" not in model.__dict__
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=4, do_sample=False), want)
    with pytest.raises(RuntimeError, match="inside"):
        with sparsecompile.patched(model, method="streamingllm", compression_ratio=0.5):
            raise RuntimeError("inside")
    assert patch_of(model) is None
    sparsecompile.optimize(model)
    with pytest.raises(ValueError, match="already optimized"):
        with sparsecompile.patched(model, method="snapkv", budget=8):
            pass
    assert patch_of(model) is not None  # the earlier patch is left alone


# ------------------------------------------------------------------------------------------------ model ids
@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache, offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_model(hub_cache, model_id: str):
    """Save a tiny model and tokenizer into ``hub_cache`` in the hub's layout (as ``hf download`` leaves it)."""
    from tiny_tokenizer import save_tiny_model

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_cache / f"models--{model_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return save_tiny_model(repo / "snapshots" / commit)


def test_model_id_offline_and_not_cached_says_so(hub_cache):
    from sparsecompile.models.default_model import load_model

    with pytest.raises(FileNotFoundError, match="'someone/tiny' .* not in the local cache .*hub.* while the hub is "
                                                "offline \\(HF_HUB_OFFLINE=1\\).*hf download someone/tiny"):
        load_model("someone/tiny", device="cpu")
    with pytest.raises(FileNotFoundError, match="neither a local HF directory, a .gguf file nor a Hugging Face"):
        load_model("./not/a/dir", device="cpu")


def test_cached_model_id_loads_through_transformers(hub_cache):
    from tiny_tokenizer import tiny_tokenizer

    from sparsecompile import LLM, SamplingParams

    reference = cache_model(hub_cache, "someone/tiny-llama")
    llm = LLM("someone/tiny-llama", device="cpu", dtype="auto", max_num_seqs=2, page_size=4)
    assert llm.llm_engine.model_name == "someone/tiny-llama"
    ids = tiny_tokenizer()("w5 w6 w7").input_ids
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    want = reference.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == want


@pytest.mark.parametrize("options,match", [
    ({"compile_prefill": "yes"}, "compile_prefill must be True or False, got 'yes'"),
    ({"compile_prefill": True, "tensor_parallel_size": 2}, "compile_prefill is not supported with "
                                                           "tensor_parallel_size > 1"),
])
def test_serving_flags_are_checked(options, match):
    from sparsecompile.config import ServingConfig

    with pytest.raises(MethodConfigError, match=match):
        ServingConfig(**options)


@pytest.mark.parametrize("args,match", [
    (dict(input_ids=torch.arange(3, 23)), "must be a .batch, tokens. tensor of integer token ids.*1-D"),
    (dict(input_ids=torch.ones(2, 20)), "float32"),
    (dict(input_ids=torch.ones(2, 0, dtype=torch.long)), "at least one token"),
    (dict(input_ids=torch.full((2, 20), 500)), r"outside the model's vocabulary \[0, 96\)"),
    (dict(input_ids=torch.ones(2, 20, dtype=torch.long), attention_mask=torch.ones(2, 5)), "must match input_ids"),
    (dict(input_ids=torch.ones(2, 20, dtype=torch.long), question_ids=torch.ones(2, 0, dtype=torch.long)),
     "question_ids must be"),
], ids=["1-D", "float", "empty", "out of vocabulary", "mask shape", "empty question"])
def test_compress_says_what_is_wrong_with_its_inputs_and_holds_nothing(args, match):
    _, model = tiny_pair()
    sparsecompile.optimize(model, "snapkv", budget=8, window=2)
    with pytest.raises(ValueError, match=match):
        sparsecompile.compress(model, **args)
    manager = patched_model(model).controller.manager
    assert manager is None or manager.allocator.num_free == manager.num_pages
