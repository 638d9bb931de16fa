"""Passkey-in-a-haystack prompts built at test time.

Two haystacks: ``"austen"``, the opening chapters of Jane Austen's *Emma* (public domain), shipped in
``tests/data/emma_chapters.txt``; and ``"pydoc"``, the Python language reference that the standard
library ships (``pydoc_data.topics``).
"""

from __future__ import annotations

import functools
import os
import re

import torch

AUSTEN_TEXT = os.path.join(os.path.dirname(__file__), "data", "emma_chapters.txt")


@functools.cache
def _filler_paragraphs(source: str) -> tuple[str, ...]:
    if source == "austen":
        with open(AUSTEN_TEXT, encoding="utf-8") as handle:
            text = handle.read().split("\n\n", 1)[1]  # drop the attribution line
        return tuple(p.strip().replace("\n", " ") for p in text.split("\n\n") if len(p.strip()) > 40)
    if source == "pydoc":
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        return tuple(p.strip() for p in text.split("\n\n") if len(p.strip()) > 80)
    raise ValueError(f"unknown haystack {source!r}")


def passkey_prompt(tokenizer, passkey: str = "68213", target_tokens: int = 3000, depth: float = 0.5,
                   source: str = "austen") -> torch.Tensor:
    """Chat-formatted ``input_ids [1, n]`` (about ``target_tokens`` long) hiding ``passkey`` at ``depth`` (0..1)."""
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key."
    question = "What is the pass key? Answer with the number only."
    paragraphs, chosen, used = _filler_paragraphs(source), [], 0
    budget = target_tokens - 80
    for p in paragraphs:
        n = len(tokenizer(p)["input_ids"])
        if used + n > budget:
            break
        chosen.append(p)
        used += n
    chosen.insert(int(round(depth * len(chosen))), needle)
    content = "Read the text below and remember the pass key hidden in it.\n\n" + "\n\n".join(chosen)
    messages = [{"role": "user", "content": content + "\n\n" + question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def retrieves(model, tokenizer, input_ids: torch.Tensor, passkey: str = "68213", max_new_tokens: int = 12) -> bool:
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         max_new_tokens=max_new_tokens, do_sample=False)
    text = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
    return passkey in re.sub(r"\D", "", text) or passkey in text
