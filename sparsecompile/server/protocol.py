"""Pydantic models of the OpenAI-compatible HTTP API: requests, responses, streaming chunks, errors.

Requests forbid unknown fields and use strict types (``"max_tokens": "5"`` is refused, not coerced), so a
client that misspells a field or sends an unsupported one hears about it instead of being silently ignored.
Fields are named as OpenAI names them; the extras vLLM popularised (``top_k``, ``min_p``, ``stop_token_ids``,
``ignore_eos``, ``repetition_penalty``, ``min_tokens``, ``prompt_logprobs``, ``include_stop_str_in_output``,
``skip_special_tokens``) are accepted too. Responses carry logprobs in OpenAI's shapes (completions:
``tokens / token_logprobs / top_logprobs / text_offset``; chat: ``content: [{token, logprob, bytes, top_logprobs}]``)
and ``prompt_logprobs`` in vLLM's.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from ..serving.outputs import MAX_LOGPROBS, RequestOutputKind, RequestRejected, SamplingParams

_REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True)
#: request fields passed to SamplingParams as they are
_SAME_AS_SAMPLING_PARAMS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                            "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "n",
                            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
MAX_N = 128  # completions per request (each is a sequence in the engine; a huge n would exhaust host memory)


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage`` a last chunk carries the request's token counts."""

    model_config = _REQUEST_CONFIG
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (everything that maps onto :class:`SamplingParams`)."""

    model_config = _REQUEST_CONFIG

    model: StrictStr
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: StrictInt = Field(0, ge=0)
    logit_bias: dict[StrictStr, float] | None = None
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    user: StrictStr | None = None  # accepted and ignored, as OpenAI documents it (abuse monitoring)
    #: sparsecompile extra: the conversation this request continues (chain cache: its KV stays between turns)
    chain_id: StrictStr | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _check_supported(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM); send the request "
                             "without streaming")
        return self

    def _logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` for this request (each endpoint names it its own way)."""
        return None

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's :class:`SamplingParams` for this request (a request without a seed takes the
        engine's default, ``ServingConfig.seed``): a streamed one's outputs are the deltas each step added, another's
        the final one only. Raises ``RequestRejected`` on bad values."""
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                if not key.isdigit():
                    raise RequestRejected(f"logit_bias keys must be token ids (decimal strings), got {key!r}")
                bias[int(key)] = value
        same = {name: getattr(self, name) for name in _SAME_AS_SAMPLING_PARAMS}
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams(max_tokens=max_tokens, logit_bias=bias, logprobs=self._logprobs(),
                              prompt_logprobs=self._prompt_logprobs(), output_kind=kind, **same)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is one string or one list of token ids."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            raise ValueError("batch prompts not supported: send one prompt (a string or a list of token ids) "
                             "per request")
        if len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        return self

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs`` returns the prompt tokens' logprobs too (as vLLM)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class TextContentPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content (the only kind supported)."""

    model_config = _REQUEST_CONFIG
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message of a chat request."""

    model_config = _REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextContentPart] | None = None
    name: StrictStr | None = None

    def as_template_input(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict chat templates expect, with content parts joined into one string."""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. Without a token limit, generation may fill the model's context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ----------------------------------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class PromptLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs``: ``{token id: {logprob, rank, decoded_token}}`` per prompt token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionLogprobs(BaseModel):
    """OpenAI's completions ``logprobs``: per token its text, logprob, the most likely tokens and text offset."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobsField = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    chain_id: str | None = None  # echoed from the request (sparsecompile extra)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    chain_id: str | None = None  # echoed from the request (sparsecompile extra)
    prompt_logprobs: PromptLogprobsField = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    chain_id: str | None = None  # echoed from the request (sparsecompile extra)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sparsecompile"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
