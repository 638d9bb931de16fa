"""Log-probabilities in vLLM's shapes: per token ``{token id: Logprob(logprob, rank, decoded_token)}``.

The engine asks :class:`LogprobRecorder` only for the requests that want logprobs (``logprobs`` or
``prompt_logprobs`` set), so a batch where none does pays nothing. Values are the model's own distribution:
the log-softmax of the raw logits (before penalties, bias and temperature), vLLM's default ``raw_logprobs``.
"""

from __future__ import annotations

import torch

from .outputs import Logprob, PromptLogprobs
from .sampling import token_logprobs

_PROMPT_ROWS = 512  # prompt positions per log-softmax (bounds the memory of long prompts' prompt logprobs)


class LogprobRecorder:
    """Turns :func:`~sparsecompile.serving.sampling.token_logprobs` tensors into logprob dicts, decoding each token
    once (the text of a token id is cached)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _dicts(self, tokens: list[int], logits: torch.Tensor, num_top: list[int]) -> list[dict[int, Logprob]]:
        """Per row of ``logits [rows, vocab]``: ``{tokens[row]: ...}`` then its ``num_top[row]`` most likely tokens."""
        values = token_logprobs(logits, torch.tensor(tokens, device=logits.device), max(num_top, default=0))
        chosen, rank, top_lp, top_ids = (v.tolist() for v in values)
        out = []
        for i, token in enumerate(tokens):
            entry = {token: Logprob(chosen[i], rank[i], self.token_text(token))}
            for j in range(num_top[i]):
                top = top_ids[i][j]
                if top not in entry:
                    entry[top] = Logprob(top_lp[i][j], j + 1, self.token_text(top))
            out.append(entry)
        return out

    def sampled(self, logits: torch.Tensor, tokens: list[int],
                num_top: list[int | None]) -> list[dict[int, Logprob] | None] | None:
        """The sampled tokens' dicts for the rows with ``num_top`` not None (None elsewhere); None if no row asks.

        Args:
            logits: ``[rows, vocab]`` the logits the tokens were sampled from (raw, before processing).
            tokens: the sampled token of each row (host list).
            num_top: per row, the most likely tokens to add, or None for a row that wants no logprobs.
        """
        rows = [i for i, k in enumerate(num_top) if k is not None]
        if not rows:
            return None
        dicts = self._dicts([tokens[i] for i in rows], logits[torch.tensor(rows, device=logits.device)],
                            [num_top[i] for i in rows])
        out: list[dict[int, Logprob] | None] = [None] * len(tokens)
        for i, entry in zip(rows, dicts):
            out[i] = entry
        return out

    def extend_prompt(self, record: PromptLogprobs, prompt_ids: list[int], start: int, logits: torch.Tensor,
                      num_top: int) -> PromptLogprobs:
        """Add the dicts of the prompt tokens that ``logits [chunk, vocab]`` (prompt positions ``start ..``) predict.

        Position ``j`` predicts prompt token ``j + 1``; the record starts with None for token 0 (``start == 0``
        starts it over, as a prompt prefilled again after a preemption does). Returns the record.
        """
        if start == 0:
            record = [None]
        stop = min(start + logits.shape[0], len(prompt_ids) - 1)
        for a in range(start, stop, _PROMPT_ROWS):
            b = min(stop, a + _PROMPT_ROWS)
            targets = prompt_ids[a + 1:b + 1]
            record += self._dicts(targets, logits[a - start:b - start], [num_top] * len(targets))
        return record
