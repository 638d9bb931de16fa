"""Host time the serving engine spends building outputs (2026-12-05, nineteenth session; CPU, tiny random model).

    python benchmarks/sessions/output_host_cost.py generate   # LLM.generate, 256 requests x 512 tokens: whole run
                                                              # and the engine's outputs a step
    python benchmarks/sessions/output_host_cost.py stream     # 64 streams, 2,048-token prompts, 512 tokens: outputs
                                                              # plus the server bridge's copies a step, CUMULATIVE with
                                                              # the prompt copied (as before) against DELTA

Run it at a commit before the output kinds (da43d16) for ``generate``'s "before" figure.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_llm import DigitTokenizer  # noqa: E402
from tiny_models import tiny_pair  # noqa: E402

from sparsecompile import LLM, SamplingParams  # noqa: E402
from sparsecompile.server.async_engine import _detached  # noqa: E402
from sparsecompile.serving import engine as engine_module  # noqa: E402


def _llm(seqs: int, tokens: int) -> LLM:
    _, model = tiny_pair("llama", max_position_embeddings=4096, num_hidden_layers=1, hidden_size=32,
                         intermediate_size=32)
    return LLM(model, "vanilla", tokenizer=DigitTokenizer(), max_model_len=tokens + 8, max_num_seqs=seqs,
               page_size=16, max_num_batched_tokens=16384, num_pages=seqs * (tokens + 16) // 16 + 64)


class _Timed:
    """Wraps ``LLMEngine._outputs`` (and a copy of each output, as the server bridge makes): seconds and calls."""

    def __init__(self, detach=None) -> None:
        self.seconds, self.calls, self.detach = 0.0, 0, detach
        self.original = engine_module.LLMEngine._outputs

    def __call__(self, changed):
        start = time.perf_counter()
        outputs = self.original(changed)
        if self.detach is not None:
            outputs = [self.detach(o) for o in outputs]
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return outputs

    def __enter__(self):
        engine_module.LLMEngine._outputs = staticmethod(self)
        return self

    def __exit__(self, *exc) -> None:
        engine_module.LLMEngine._outputs = staticmethod(self.original)


def generate(n: int = 256, tokens: int = 512) -> None:
    llm = _llm(n, tokens + 16)
    rng = random.Random(0)
    prompts = [[rng.randint(3, 90) for _ in range(16)] for _ in range(n)]
    with _Timed() as timed:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - start
    print(f"generate: {n} x {tokens} tokens, wall {wall:.2f} s, outputs {1e3 * timed.seconds / timed.calls:.2f} ms a "
          f"step over {timed.calls} steps")


def _copied_prompt(output):
    """The bridge's copy before 2026-12-05: the prompt's ids too."""
    completions = [dataclasses.replace(c, token_ids=list(c.token_ids), delta_token_ids=list(c.delta_token_ids),
                                       logprobs=None if c.logprobs is None else list(c.logprobs))
                   for c in output.outputs]
    return dataclasses.replace(output, prompt_token_ids=list(output.prompt_token_ids), outputs=completions)


def stream(n: int = 64, prompt: int = 2048, tokens: int = 512) -> None:
    for logprobs in (None, 2):
        row = []
        for kind, detach in (("cumulative", _copied_prompt), ("delta", _detached)):
            engine = _llm(n, prompt + tokens).llm_engine
            rng = random.Random(0)
            for i in range(n):
                engine.add_request(f"r{i}", [rng.randint(3, 90) for _ in range(prompt)],
                                   SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                                  logprobs=logprobs, output_kind=kind))
            with _Timed(detach) as timed:
                while engine.has_unfinished_requests():
                    engine.step()
            row.append(f"{kind} {1e3 * timed.seconds / timed.calls:.2f} ms a step")
        print(f"stream: {n} x ({prompt} + {tokens}), logprobs={logprobs}: " + ", ".join(row))


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"generate": generate, "stream": stream}[sys.argv[1] if len(sys.argv) > 1 else "stream"]()
