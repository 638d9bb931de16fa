"""Decode steps compile to one graph, with no graph break and no recompile across prompt lengths (a pool that grows
included: its page dimension is dynamic)."""

from __future__ import annotations

import os
import subprocess
import sys
import weakref

import pytest
import torch
from tiny_models import tiny_pair
from torch._dynamo.utils import counters

import sparsecompile
from sparsecompile.models.hf_patch import patched_model
from sparsecompile.passes import CaptureError, capture_backend


@pytest.mark.slow
def test_compiled_decode_one_graph_no_recompile():
    torch._dynamo.reset()
    counters.clear()
    reference, model = tiny_pair("llama", seed=6)
    sparsecompile.optimize(model, "vanilla", page_size=4, compile=True)
    controller = patched_model(model).controller
    pages = []
    for length in (7, 12, 19, 160, 330):  # the last two grow the pool and widen the block table
        ids = torch.randint(3, 96, (2, length))
        want = reference.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(input_ids=ids, max_new_tokens=8, do_sample=False), want)
        pages.append((controller.manager.num_pages, controller.manager.max_pages_per_seq))
    assert pages[2] < pages[3] < pages[4], pages
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    assert not counters["recompiles"]
    # restore() frees the pool at once: dynamo's trace leaves cycles that refer to the cache manager (a model
    # optimized again at once used to allocate its pool beside the old one)
    pool = weakref.ref(controller.manager.k_pool)
    del controller
    sparsecompile.restore(model)
    assert pool() is None


def test_each_engine_compiles_its_own_decode_variants():
    """Engines built one after another in one process each get a private dynamo cache for their decode step: with
    a recompile limit of 1, six instances still compile (one shared code object would fail the second)."""
    import torch._dynamo.config as dynamo_config

    from sparsecompile.runtime.compilation import compile_step

    class Step:
        def __init__(self, k: int) -> None:
            self.k = k

        def decode(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.k + 1

    torch._dynamo.reset()
    steps = [Step(k) for k in range(6)]
    compiled = [compile_step(s.decode, "eager") for s in steps]
    x = torch.ones(3)
    with dynamo_config.patch(recompile_limit=1):
        for _ in range(2):
            for step, fn in zip(steps, compiled):
                assert torch.equal(fn(x), x * step.k + 1)


def test_decode_steps_drop_only_the_models_tensor_guards():
    """The decode step's guard filter drops the tensor-metadata guards of the model's parameters (most of the guard
    time) and nothing else: a flag flipped on a module and a swapped module still recompile."""
    from sparsecompile.runtime.compilation import compile_step

    class Step:
        def decode(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return model(x)

    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).eval()
    fn = compile_step(Step().decode, "eager")
    x = torch.ones(2, 4)
    torch.testing.assert_close(fn(model, x), model(x))
    frames = counters["stats"]["unique_graphs"]
    model.train()  # the Dropout's flag: a value guard, kept
    fn(model, x)
    assert counters["stats"]["unique_graphs"] == frames + 1
    model.eval()
    model[0] = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())  # another module type: kept guards
    torch.testing.assert_close(fn(model, x), model(x))  # see it (the old graph would miss the ReLU)


@pytest.mark.slow
def test_a_model_cast_after_optimize_is_refused_by_compiled_decode():
    """Without tensor guards on the weights, a cast after optimize() must not run the graph built for the old
    dtype: the controller refuses the step and says what to do."""
    torch._dynamo.reset()
    _, model = tiny_pair("llama", seed=6)
    sparsecompile.optimize(model, "vanilla", page_size=4, compile=True)
    ids = torch.randint(3, 96, (1, 9))
    model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match="restore"):
        model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)


def test_capture_check_rejects_raw_sdpa():
    def uses_sdpa(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    torch._dynamo.reset()
    compiled = torch.compile(uses_sdpa, backend=capture_backend(1, cuda_graphs=False, inner="eager"), fullgraph=True)
    with pytest.raises(Exception) as err:
        compiled(torch.randn(1, 2, 4, 8))
    assert isinstance(err.value, CaptureError) or "CaptureError" in str(err.value)


@pytest.mark.slow
def test_warmup_compiles_ahead_into_the_disk_cache(tmp_path, monkeypatch, caplog):
    """`sparsecompile.warmup` compiles the decode step of each batch size before the first real call, announces it,
    and leaves inductor's graphs under the sparsecompile cache directory; the real call then compiles nothing."""
    monkeypatch.setenv("SPARSECOMPILE_CACHE", str(tmp_path))
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    torch._dynamo.reset()
    counters.clear()
    reference, model = tiny_pair("llama", seed=6)
    sparsecompile.optimize(model, "vanilla", page_size=4, compile=True)
    caplog.set_level("INFO", logger="sparsecompile")
    logger = __import__("logging").getLogger("sparsecompile")
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "disabled", False)  # a logging.config call elsewhere in the session may disable it
    seconds = sparsecompile.warmup(model, batch_sizes=[2], prompt_len=12, max_new_tokens=8)
    assert set(seconds) == {2}
    assert "compiling the decode step for batch 2" in caplog.text
    assert any((tmp_path / "compile").rglob("*")), "inductor wrote nothing under the sparsecompile cache"
    graphs = counters["stats"]["unique_graphs"]
    ids = torch.randint(3, 96, (2, 12))
    want = reference.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=8, do_sample=False), want)
    assert counters["stats"]["unique_graphs"] == graphs  # the warmed-up graph served the real call


def test_a_fresh_process_puts_inductor_graphs_under_the_sparsecompile_cache(tmp_path):
    """Importing inductor's config sets TORCHINDUCTOR_CACHE_DIR to torch's /tmp default; that must not win over ours
    (it did: every process wrote to /tmp, and carried caches came back empty), while a user's own setting does."""
    code = ("import sparsecompile; from sparsecompile.runtime.compilation import enable_compile_caches; "
            "print(enable_compile_caches())")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["SPARSECOMPILE_CACHE"] = str(tmp_path)
    ours = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert ours.stdout.strip().startswith(str(tmp_path / "compile"))
    mine = subprocess.run([sys.executable, "-c", code], env={**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "own")},
                          capture_output=True, text=True, check=True)
    assert mine.stdout.strip() == str(tmp_path / "own")
