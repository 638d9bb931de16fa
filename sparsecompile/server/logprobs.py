"""The engine's logprobs (vLLM's ``{token id: Logprob}`` per token) in the shapes OpenAI's API returns.

A log-probability that is not finite (``-inf`` for a token the model rules out, NaN from bad logits) is reported
as ``-9999.0``, as OpenAI documents for very unlikely tokens (JSON has no infinity).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..serving.outputs import Logprob, PromptLogprobs
from .protocol import ChoiceLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob

UNLIKELY = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNLIKELY


def _text(step: dict[int, Logprob], token: int, token_text: Callable[[int], str]) -> str:
    entry = step.get(token)
    return entry.decoded_token if entry is not None and entry.decoded_token is not None else token_text(token)


def completion_logprobs(token_ids: list[int], steps: list[dict[int, Logprob] | None],
                        token_text: Callable[[int], str], offset: int = 0) -> CompletionLogprobs:
    """OpenAI's completions ``logprobs`` of ``token_ids`` (``steps``: their dicts; None for an echoed first prompt
    token, which has no logprob). ``top_logprobs`` maps each token text to its logprob: the chosen token and the
    requested most likely ones. ``text_offset`` starts at ``offset`` (the characters already sent)."""
    out = CompletionLogprobs()
    for token, step in zip(token_ids, steps):
        if step is None:
            text = token_text(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            text = _text(step, token, token_text)
            out.token_logprobs.append(finite(step[token].logprob))
            out.top_logprobs.append({_text(step, t, token_text): finite(p.logprob) for t, p in step.items()})
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=finite(logprob), bytes=list(token.encode("utf-8", errors="replace")))


def chat_logprobs(token_ids: list[int], steps: list[dict[int, Logprob]], num_top: int,
                  token_text: Callable[[int], str]) -> ChoiceLogprobs:
    """OpenAI's chat ``logprobs``: per token its text, logprob, UTF-8 bytes and the ``num_top`` most likely tokens
    (by rank; the chosen token is among them only if it ranks there)."""
    content = []
    for token, step in zip(token_ids, steps):
        chosen = _top(_text(step, token, token_text), step[token].logprob)
        ranked = sorted(((p.rank, t, p) for t, p in step.items() if p.rank is not None and p.rank <= num_top),
                        key=lambda item: item[0])[:num_top]
        tops = [_top(_text(step, t, token_text), p.logprob) for _, t, p in ranked]
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=tops))
    return ChoiceLogprobs(content=content)


def prompt_logprobs_field(record: PromptLogprobs | None) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs`` (per prompt token ``{token id: {logprob, rank, decoded_token}}``, None first)."""
    if record is None:
        return None
    return [None if step is None else
            {t: PromptLogprob(logprob=finite(p.logprob), rank=p.rank, decoded_token=p.decoded_token)
             for t, p in step.items()}
            for step in record]
