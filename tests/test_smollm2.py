"""The embedded default model (trained SmolLM2-135M-Instruct): dense path equal to the unpatched model."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import sparsecompile

pytestmark = pytest.mark.slow


def test_real_prompt_greedy_equal(smollm2):
    model, tokenizer = smollm2
    model = copy.deepcopy(model)
    messages = [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    want = model.generate(input_ids=ids, max_new_tokens=40, do_sample=False)
    sparsecompile.optimize(model, "vanilla", prefill_chunk_size=16)
    got = model.generate(input_ids=ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(got, want), (tokenizer.decode(got[0]), tokenizer.decode(want[0]))
    stats = sparsecompile.kv_stats(model)
    assert stats.allocated_pages == 0  # released at the end of generate()
    sparsecompile.restore(model)


def test_cli_generate(smollm2_path):
    cmd = [sys.executable, "-m", "sparsecompile.cli", "generate", "--model", str(smollm2_path), "--prompt",
           "The capital of France is", "--max-new-tokens", "4", "--prefill-chunk-size", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "KV cache (vanilla)" in result.stderr and "MiB of K/V" in result.stderr


def test_cli_bad_option(smollm2_path, capsys):
    """In process (``test_cli_generate`` runs the command line as a shell does): exit status 2 and the reason."""
    from sparsecompile.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["generate", "--model", str(smollm2_path), "--prompt", "x", "--page-size", "3"])
    assert stop.value.code == 2 and "page_size must be a positive power of two" in capsys.readouterr().err
