"""The seam between the serving engine and whatever drives it (the OpenAI server, ``LLM``): the :class:`Engine`
protocol. The server depends on this, never on :class:`~sparsecompile.serving.engine.LLMEngine` itself."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .outputs import RequestOutput, SamplingParams


@runtime_checkable
class Engine(Protocol):
    """A synchronous, single-threaded serving engine: requests in, :class:`RequestOutput` deltas out.

    The server tokenizes on threads of its own with ``tokenizer`` (None: token-id prompts only; decoding is all it
    does besides encoding) and passes ``add_request`` token ids; an output holds one ``CompletionOutput`` per
    completion (``SamplingParams.n``).
    """

    model_name: str
    method: str
    max_model_len: int
    tokenizer: Any

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    chain_id: str | None = None) -> None:
        """Queue a request; raises ``RequestRejected`` with the reason when it can never be served. ``chain_id``: the
        conversation it continues (its KV stays idle between turns; engines without a chain cache ignore it)."""

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free what it holds (unknown or finished ids are ignored)."""

    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; the requests that changed."""

    def has_unfinished_requests(self) -> bool: ...

    def bind_thread(self, owner: str | None) -> None:
        """Only the calling thread (``owner`` names it in errors) may change the engine from now on; None unbinds.
        The server's engine thread binds itself while it runs."""

    def stats(self) -> Any:
        """A snapshot of counters and gauges (running, waiting, free pages, ...)."""

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered with the tokenizer's chat template."""


@runtime_checkable
class ServedModel(Protocol):
    """What :class:`~sparsecompile.serving.engine.LLMEngine` drives: a forward over the KV core, and model facts.

    ``inner(input_ids, inputs_embeds, position_ids, logits_to_keep) -> logits`` runs one forward with the
    controller's step active (the patched HF forward, or an exported artifact's prefill program); decode steps go
    through ``controller.decode``, which may use a step installed with ``install_decode_step``.
    """

    controller: Any  # runtime.controller.SparseController
    max_length: int | None
    vocab_size: int
    name: str | None
    eos_token_ids: set[int]

    def inner(self, input_ids: Any, inputs_embeds: Any, position_ids: Any, logits_to_keep: int) -> Any: ...
