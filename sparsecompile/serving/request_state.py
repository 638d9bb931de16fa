"""Engine-side state of a request: a :class:`RequestGroup` is a request as its caller sees it (``n`` completions
of one prompt), a :class:`LiveSequence` one of those completions next to its scheduling state (``Request``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .detokenizer import Detokenizer
from .outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    SampleLogprobs,
    SamplingParams,
)
from .request import Request
from .sampling import TokenHistory


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

    def output(self) -> RequestOutput:
        """The request's state for its caller: every completion, with what changed since the last output as its
        deltas (``params.output_kind`` DELTA: the deltas alone, so a long completion is not copied every step)."""
        delta_only = self.params.output_kind is RequestOutputKind.DELTA
        completions = []
        for index in range(self.params.n):
            if index >= len(self.seqs):  # aborted before its first token: nothing was sampled
                completions.append(CompletionOutput(index, finish_reason="abort" if self.aborted else None))
                continue
            live = self.seqs[index]
            r, d = live.request, live.detok
            new_ids = r.output_ids[live.reported:]
            new_text = d.delta(r.finish_reason is not None)
            if delta_only:
                logprobs = None if live.logprobs is None else live.logprobs[live.reported:]
                text, ids = new_text, list(new_ids)
            else:
                logprobs = None if live.logprobs is None else list(live.logprobs)
                text, ids = d.text, list(r.output_ids)
            live.reported = len(r.output_ids)
            completions.append(CompletionOutput(index, text, ids, r.finish_reason, r.stop_reason, new_text, new_ids,
                                                logprobs, live.cumulative_logprob))
        finished = all(c.finish_reason is not None for c in completions)
        # prompt_token_ids is the engine's own list (copying a long prompt every step costs more): do not mutate it;
        # prompt_logprobs is complete (and no longer changes) once a request has an output
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, completions, finished,
                             replace(self.metrics), self.prompt_logprobs,
                             chain_id=self.seqs[0].request.chain_id if self.seqs else None)

    @property
    def reports_every_step(self) -> bool:
        """Whether the caller wants an output at every step that changes the request (not ``FINAL_ONLY``)."""
        return self.params.output_kind is not RequestOutputKind.FINAL_ONLY

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
