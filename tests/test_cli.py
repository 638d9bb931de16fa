"""The CLI: argument errors in one line, before torch loads when they need no model; method options checked before
the model loads; `generate` streams its tokens; `bench` without a GPU says so."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tiny_tokenizer import save_tiny_model, text_of

from sparsecompile.cli import main

# runs main() in a fresh interpreter and reports whether torch got imported on the way to the error
_NO_TORCH = """
import sys
from sparsecompile.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    print("exit", exit.code, "torch" in sys.modules)
"""


@pytest.mark.parametrize("argv,message", [
    (["--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0 (0 = greedy), got -1.0"),
    (["--prompt", "x", "--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt-file", "."], "--prompt-file '.' is a directory"),
    (["--prompt-file", "no/such/file.txt"], "--prompt-file 'no/such/file.txt' does not exist"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "x", "--max-new-tokens", "many"], "argument --max-new-tokens: invalid int value: 'many'"),
    (["--prompt", "x", "--budget", "8", "--top-p", "0"], "--top-p must be in (0, 1]"),  # method flags wait
])
def test_generate_argument_errors_are_one_line_and_need_no_torch(argv, message):
    out = subprocess.run([sys.executable, "-c", _NO_TORCH, "generate", *argv], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "exit 2 False", out.stderr
    assert out.stderr.count("\n") == 1 and message in out.stderr and out.stderr.startswith("sparsecompile generate:")


@pytest.mark.parametrize("argv,message", [
    (["--device", "cuda"], "--device cuda: CUDA is not available on this machine"),
    (["--method", "snapkv", "--budget", "0"], "snapkv: budget must be a positive number of tokens"),
    (["--method", "vanilla", "--window", "8"], "'window' is an option of method(s) pyramidkv, snapkv"),
    (["--page-size", "3"], "page_size must be a positive power of two"),
])
def test_errors_before_the_model_loads(argv, message, capsys, monkeypatch):
    import sparsecompile.models.default_model as default_model

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load before the options are checked")

    monkeypatch.setattr(default_model, "load_model", no_load)
    if torch.cuda.is_available() and argv[0] == "--device":
        pytest.skip("CUDA is available")
    with pytest.raises(SystemExit) as exit:
        main(["generate", "--prompt", "x", *argv])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and message in err and err.count("\n") == 1


def test_generate_streams_the_tokens_of_the_unpatched_model(tmp_path, capsys):
    reference = save_tiny_model(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6 w7", "--max-new-tokens", "6",
                 "--device", "cpu", "--method", "snapkv", "--budget", "64", "--page-size", "4"]) == 0
    captured = capsys.readouterr()
    ids = torch.tensor([[5, 6, 7]])
    want = reference.generate(input_ids=ids, max_new_tokens=6, do_sample=False)[0, 3:]
    assert captured.out.strip() == text_of(t for t in want if t != 2)
    assert "KV cache (snapkv)" in captured.err and "6 generated" in captured.err


def test_model_path_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["generate", "--prompt", "x", "--model", "./missing/dir/model"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and "neither a local HF directory" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench", "--grid", "quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sparsecompile bench: error:") and "needs a CUDA GPU" in err and err.count("\n") == 1
