"""Offline batch generation with continuous batching: ``sparsecompile.LLM`` over the embedded SmolLM2-135M.

    python examples/offline_batch.py [--method snapkv] [--budget 256]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a model hub

import sparsecompile  # noqa: E402
from sparsecompile import LLM, SamplingParams  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Write a haiku about rain.",
             "Why is the sky blue? Answer in one sentence.", "Give two tips for learning to code."]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="vanilla", choices=sparsecompile.available_methods())
    parser.add_argument("--budget", type=int, default=None, help="tokens kept / read per layer (sparse methods)")
    args = parser.parse_args()

    options = {} if args.budget is None else {"budget": args.budget}
    llm = LLM(None, args.method, max_num_seqs=4, **options)  # None: the embedded default model
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=48)
    for question, out in zip(QUESTIONS, llm.chat(conversations, params)):
        completion, ttft = out.outputs[0], out.metrics.time_to_first_token
        print(f"Q: {question}\nA: {completion.text.strip()}  [{completion.finish_reason}, "
              f"{out.metrics.num_generated_tokens} tokens, first token after {ttft:.2f} s]\n")
    stats = llm.llm_engine.stats()
    print(f"engine: {stats.steps} steps, {stats.prompt_tokens} prompt + {stats.generation_tokens} generated tokens, "
          f"{stats.num_preemptions} preemptions, {stats.free_pages}/{stats.total_pages} KV pages free")


if __name__ == "__main__":
    main()
