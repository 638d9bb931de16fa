"""The floors of README's Layout hold (import-linter), and every option has one source (the config dataclasses)."""

import logging
import subprocess
import sys
import time

import pytest
from tiny_models import tiny_pair

from sparsecompile.config import EngineConfig, MethodConfigError, ServingConfig, split_options


def test_imports_run_only_down_the_floors():
    from importlinter.cli import lint_imports

    # lint_imports configures logging with dictConfig, which disables every logger that exists (ours included) for
    # the rest of the process: later tests that read sparsecompile's warnings would see nothing
    loggers = [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = {lg: lg.disabled for lg in loggers}
    try:
        assert lint_imports(config_filename="pyproject.toml") == 0, "run `lint-imports` to see which import breaks"
    finally:
        for lg, flag in disabled.items():
            lg.disabled = flag


def test_options_are_routed_by_the_dataclass_that_declares_them():
    routed = split_options({"page_size": 32, "max_num_seqs": 4, "budget": 8}, "snapkv", ["budget", "window"])
    assert routed == {"engine": {"page_size": 32}, "serving": {"max_num_seqs": 4}, "method": {"budget": 8}}
    with pytest.raises(MethodConfigError, match="'gpu_memory_utilization' is a serving option"):
        split_options({"gpu_memory_utilization": 0.9}, "vanilla", [], accepted=("engine", "method"))
    with pytest.raises(MethodConfigError, match="'window' is an option of method.*snapkv, not of 'vanilla'"):
        split_options({"window": 8}, "vanilla", [], owners=lambda name: ["pyramidkv", "snapkv"])
    with pytest.raises(MethodConfigError, match="unknown option 'bugdet'"):
        split_options({"bugdet": 8}, "snapkv", ["budget"])


def test_optimize_names_the_kind_of_a_refused_option():
    import sparsecompile

    _, model = tiny_pair()
    with pytest.raises(MethodConfigError, match="'max_num_seqs' is a serving option"):
        sparsecompile.optimize(model, "vanilla", max_num_seqs=4)
    with pytest.raises(MethodConfigError, match="'budget' is an option of method.*snapkv.*not of 'vanilla'"):
        sparsecompile.optimize(model, "vanilla", budget=4)


def test_llm_takes_serving_options_as_serving_options():
    import sparsecompile

    _, model = tiny_pair()
    with pytest.raises(ValueError, match="gpu_memory_utilization needs a CUDA device"):  # recognised, then checked
        sparsecompile.LLM(model, tokenizer=object(), gpu_memory_utilization=0.5)
    with pytest.raises(MethodConfigError, match="gpu_memory_utilization must be a fraction"):
        ServingConfig(gpu_memory_utilization=1.5)
    with pytest.raises(MethodConfigError, match="page_size must be a positive power of two"):
        EngineConfig(page_size="16")


def test_cli_help_is_instant_and_flags_come_from_the_configs():
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "sparsecompile.cli", "--help"], capture_output=True, text=True,
                         check=True)
    assert "generate" in out.stdout and "serve" in out.stdout
    assert time.perf_counter() - start < 1.5, "top-level help must not import torch"
    serve = subprocess.run([sys.executable, "-m", "sparsecompile.cli", "serve", "--help"], capture_output=True,
                           text=True, check=True).stdout
    for flag in ("--max-num-seqs", "--gpu-memory-utilization", "--prefill-chunk-size", "--budget", "--window"):
        assert flag in serve
    assert "(default: 16)" in serve and "observation window" in serve
