"""Request inputs and outputs of the serving runtime: :class:`SamplingParams`, :class:`RequestOutput`.

Names and meanings follow vLLM's, so code written against ``vllm.LLM`` reads the same here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class RequestRejected(ValueError):
    """A request can never be served as given (too long, larger than the KV pool, bad parameters)."""


#: Temperatures below this sample greedily (vLLM's threshold): dividing logits by less overflows fp32.
SAMPLING_EPS = 1e-5
#: Most top logprobs a request may ask for per token (``logprobs``, ``prompt_logprobs``), as vLLM's default.
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each :class:`RequestOutput` of a request carries (vLLM's names and meanings).

    ``CUMULATIVE``: an output every step that changed the request, each completion's text, tokens and logprobs so
    far plus this step's delta. ``DELTA``: an output every such step holding only this step's text, tokens and
    logprobs (``text`` / ``token_ids`` / ``logprobs`` equal the deltas; ``cumulative_logprob`` stays cumulative):
    a streaming server's chunks, without copying a growing completion every step. ``FINAL_ONLY``: one output,
    when the request finishes (cumulative): offline generation, with no per-step output at all.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop (vLLM's names, defaults and meanings).

    Attributes:
        max_tokens: most tokens generated per completion (>= 1).
        temperature: below ``SAMPLING_EPS`` (e.g. 0) greedy; otherwise logits are divided by it before sampling.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability reaches ``top_p`` (1 = off).
        top_k: keep the ``top_k`` most likely tokens (0 or -1 = off).
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's (0 = off).
        seed: per-request seed; the same seed and prompt give the same tokens whatever else is batched. With
            ``n > 1`` completion ``i`` draws from seed :func:`child_seed` ``(seed, i)`` (completion 0 from ``seed``).
        stop: strings that end generation; the text returned stops before the first one.
        include_stop_str_in_output: the text returned ends with the stop string that ended it (or the stop
            token's / EOS's text) instead of before it.
        stop_token_ids: token ids that end generation (kept in ``token_ids``; decoded into the text only with
            ``include_stop_str_in_output``).
        ignore_eos: keep generating past the tokenizer's end-of-sequence token.
        skip_special_tokens: drop special tokens when decoding text.
        n: completions of the prompt (the prompt is processed once; each completion samples on its own).
        presence_penalty: subtracted from the logit of every token already generated (in [-2, 2]; 0 = off).
        frequency_penalty: subtracted from a token's logit once per time it was generated (in [-2, 2]; 0 = off).
        repetition_penalty: tokens of the prompt or the output get their logit divided by it when positive,
            multiplied when negative (> 0; 1 = off). All three penalties apply to the logits before temperature.
        min_tokens: tokens generated before EOS, ``stop_token_ids`` or a stop string may end the completion (EOS
            and stop tokens are masked until then).
        logit_bias: ``{token id: bias}`` added to those logits before sampling (bias in [-100, 100]).
        logprobs: return the log-probability of each generated token and of the ``logprobs`` most likely ones
            (0..20; None = off). Log-probabilities are the model's (log-softmax of the raw logits, before
            penalties, bias and temperature), as vLLM's default ``raw_logprobs``.
        prompt_logprobs: the same for every prompt token after the first (0..20; None = off).
        output_kind: what each output of the request carries (:class:`RequestOutputKind`; a name such as
            ``"delta"`` is accepted). ``LLM.generate`` asks for ``FINAL_ONLY`` itself.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.output_kind, str) and self.output_kind.upper() in RequestOutputKind.__members__:
            self.output_kind = RequestOutputKind[self.output_kind.upper()]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        self.validate()

    def validate(self) -> None:
        def bad(message: str) -> RequestRejected:
            return RequestRejected(f"SamplingParams: {message}")

        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _number(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _integer(self.top_k) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _integer(self.seed):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not _integer(t) or t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _integer(self.n) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                raise bad(f"{name} must be in [-2, 2], got {value!r}")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not _integer(token) or token < 0:
                raise bad(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not _number(bias) or not -100 <= bias <= 100:
                raise bad(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _integer(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = ", ".join(k.name.lower() for k in RequestOutputKind)
            raise bad(f"output_kind must be a RequestOutputKind ({kinds}), got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before sampling (penalties, ``logit_bias``, ``min_tokens``)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed completion ``index`` of an ``n > 1`` request samples with: ``seed`` itself for completion 0 (so
    ``n = 1`` is unchanged), else ``(seed + index * 0x9E3779B97F4A7C15) mod 2**64`` (the golden-ratio step spreads
    siblings far apart in seed space). None stays None."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**64


@dataclass
class Logprob:
    """A token's log-probability at one position, as vLLM reports it.

    ``rank``: 1 for the most likely token (ties share the worse rank); ``decoded_token``: the token's own text.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per generated token, ``{token id: Logprob}``: the sampled token first, then the requested most likely ones.
SampleLogprobs = list[dict[int, Logprob]]
#: Per prompt token, the same (None for the first token, which nothing predicts).
PromptLogprobs = list[dict[int, Logprob] | None]


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

    ``text`` / ``token_ids`` are cumulative (with ``RequestOutputKind.DELTA``, like ``logprobs``, only what this
    output adds); ``delta_text`` / ``delta_token_ids`` hold what was added since the request's previous output (what
    a streaming client sends on). ``index`` is the completion's place among the request's ``n``.
    ``logprobs`` (when requested) has one entry per token of ``token_ids``; ``cumulative_logprob`` sums the sampled
    tokens' log-probabilities. ``finish_reason``: None while running, then "stop" (EOS, a stop
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
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's state as the engine reports it after a step (or at the end of ``LLM.generate``).

    ``outputs`` holds the request's ``n`` completions, in index order (every one in every output; the ones this step
    did not change have empty deltas); ``finished`` once all of them are. ``prompt_logprobs`` (when requested) has one
    entry per prompt token, complete from the first output on.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobs | None = None
    chain_id: str | None = None  # the session the request continued / left its state under (None: no chain)
