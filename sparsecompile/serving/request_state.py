"""Engine-side state of a request: a :class:`RequestGroup` is a request as its caller sees it (``n`` completions
of one prompt), a :class:`LiveSequence` one of those completions next to its scheduling state (``Request``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .detokenizer import Detokenizer
from .outputs import PromptLogprobs, RequestMetrics, SampleLogprobs, SamplingParams
from .sampling import TokenHistory
from .scheduler import Request


@dataclass(eq=False)
class RequestGroup:
    """One request as its caller sees it: ``n`` completions of one prompt (one sequence until the first token)."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics  # shared by the sequences: prefill chunks and preemptions of all of them add up
    seqs: list[LiveSequence] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    aborted: bool = False

    @property
    def done(self) -> bool:
        complete = self.aborted or len(self.seqs) == self.params.n
        return complete and all(lv.request.finish_reason is not None for lv in self.seqs)


@dataclass(eq=False)
class LiveSequence:
    """Engine-side state of one sequence (one completion of a request) next to its scheduling state."""

    request: Request
    detok: Detokenizer
    generator: torch.Generator | None
    group: RequestGroup
    index: int = 0  # the completion's index among the request's n
    history: TokenHistory | None = None  # for penalties and min_tokens
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    reported: int = 0  # output tokens already reported (the rest is this step's delta)
