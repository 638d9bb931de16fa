"""benchmarks/user_path.py's ``--profile-generate``: a streamer steps the profiler once a token, so the profile covers a
window of decode steps inside one ``generate()`` call (here on CPU: the host ops of the loop, no CUDA kernels)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import user_path  # noqa: E402


def test_profile_window_covers_decode_steps_of_one_generate(tmp_path, monkeypatch):
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    import sparsecompile
    from sparsecompile.models import fast_generate

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    sparsecompile.optimize(model, "vanilla", compile=False)
    calls = []
    original = fast_generate.SparseSampleLoop._read

    def counted(check, streamer):  # every decode step's stop check goes through here
        calls.append(check[0])
        return original(check, streamer)

    monkeypatch.setattr(fast_generate.SparseSampleLoop, "_read", staticmethod(counted))
    try:
        got = user_path.profile_generate(model, torch.randint(3, 100, (2, 24)), str(tmp_path / "p.txt"))
    finally:
        sparsecompile.restore(model)
    wait, warmup, active = user_path.PROFILE_WINDOW
    assert len(calls) == wait + warmup + active + 8  # one generate() call, all of its tokens through the fast loop
    text = (tmp_path / "p.txt").read_text()
    assert text.startswith(f"{active} decode steps of one generate() call")
    steps = [line.split() for line in text.splitlines() if line.strip().startswith("ProfilerStep*")]
    assert steps and steps[0][-1] == str(active)  # the window: exactly `active` tokens
    assert "sparsecompile::paged_attention" in text  # decode steps inside it
    assert got["profile_gpu_idle_share"] is None  # no CUDA kernels on CPU
