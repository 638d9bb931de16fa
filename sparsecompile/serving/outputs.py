"""Request inputs and outputs of the serving runtime: :class:`SamplingParams`, :class:`RequestOutput`.

Names and meanings follow vLLM's, so code written against ``vllm.LLM`` reads the same here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class RequestRejected(ValueError):
    """A request can never be served as given (too long, larger than the KV pool, bad parameters)."""


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    Attributes:
        max_tokens: most tokens generated (>= 1).
        temperature: 0 = greedy; otherwise logits are divided by it before sampling.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability reaches ``top_p`` (1 = off).
        top_k: keep the ``top_k`` most likely tokens (0 or -1 = off).
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's (0 = off).
        seed: per-request seed; the same seed and prompt give the same tokens whatever else is batched.
        stop: strings that end generation; the text returned stops before the first one.
        stop_token_ids: token ids that end generation (kept in ``token_ids``, not decoded into the text).
        ignore_eos: keep generating past the tokenizer's end-of-sequence token.
        skip_special_tokens: drop special tokens when decoding text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(message: str) -> RequestRejected:
            return RequestRejected(f"SamplingParams: {message}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad(f"stop must be non-empty strings, got {self.stop!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestMetrics:
    """Per-request statistics (times from ``time.monotonic()``; seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    #: prompt tokens whose KV was reused (a chain continuation or a prefix-cache hit), not recomputed
    num_cached_tokens: int = 0
    #: requests with a chain id: whether the chain was reattached, and if not, why (serving/chain_cache.py)
    chain_hit: bool | None = None
    chain_miss_reason: str | None = None
    #: the reattached chain's history was pruned (interval pruning): attention reads a compressed payload
    compressed_history: bool = False

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """The generated part of one request.

    ``text`` / ``token_ids`` are cumulative; ``delta_text`` / ``delta_token_ids`` hold what the last engine step
    added (what a streaming client sends on). ``finish_reason``: None while running, then "stop" (EOS, a stop
    string or a stop token), "length" (``max_tokens``) or "abort" (cancelled). ``stop_reason`` is the stop
    string or stop token id that matched, if any.
    """

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's state as the engine reports it after a step (or at the end of ``LLM.generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    chain_id: str | None = None  # the session the request continued / left its state under (None: no chain)
