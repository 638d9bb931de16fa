"""The OpenAI-compatible FastAPI application: completions, chat completions, models, health, metrics.

Every error is answered as OpenAI does, ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx
status, and the server keeps serving. Before a handler runs, :class:`~sparsecompile.server.guard.RequestGuard`
checks the Host header, the API key and the body's size and arrival time; the handler then parses and tokenizes
on the :class:`~sparsecompile.server.preprocess.Preprocessor`'s thread and hands the engine token ids only.
A streaming request is aborted in the engine as soon as its client goes away (Starlette cancels the body iterator
on disconnect); a non-streaming one is raced against the client's disconnect for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ..config import ServerConfig
from ..serving.interface import Engine
from ..serving.outputs import CompletionOutput, RequestOutput, RequestRejected, SamplingParams
from .async_engine import AsyncEngine, EngineDeadError, RequestStream
from .errors import APIError, error_body, validation_message
from .guard import RequestGuard, default_allowed_hosts
from .logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_field
from .metrics import ServerMetrics
from .preprocess import Preprocessor, load_chat_template
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
)
from .prune_routes import add_prune_routes

API_KEY_ENV = "SPARSECOMPILE_API_KEY"


def _error_response(status: int, message: str, param: str | None = None, error_type: str | None = None,
                    metrics: ServerMetrics | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.requests_rejected.labels(status=str(status)).inc()
    return JSONResponse(error_body(status, message, param, error_type), status_code=status, headers=headers)


class _AbortingStreamingResponse(StreamingResponse):
    """A streaming response that aborts its request however the response ends (done, disconnect, error)."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._request_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._request_stream.abort()


def _sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


def _usage(output: RequestOutput) -> UsageInfo:
    """A final (cumulative) output's token counts."""
    return UsageInfo.of(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs))


class _Deltas:
    """Per streamed choice: what a new output adds (text, tokens and their logprobs), and whether its finish reason
    is news (each choice's finish is sent once, though every later output repeats it). Streamed requests ask for
    ``DELTA`` outputs (only what each step added), so the tokens sent are counted here for the usage chunk."""

    def __init__(self) -> None:
        self.finished: set[int] = set()
        self.generated = 0

    def __call__(self, completion: CompletionOutput) -> tuple[list[int], list, str | None]:
        ids = completion.delta_token_ids
        steps = completion.logprobs[len(completion.logprobs) - len(ids):] if completion.logprobs and ids else []
        reason = completion.finish_reason if completion.index not in self.finished else None
        if reason is not None:
            self.finished.add(completion.index)
        self.generated += len(ids)
        return ids, steps, reason

    def usage(self, output: RequestOutput) -> UsageInfo:
        return UsageInfo.of(len(output.prompt_token_ids), self.generated)


def create_app(engine: Engine, served_model_name: str | None = None, config: ServerConfig | None = None) -> FastAPI:
    """Build the app over ``engine`` (any :class:`~sparsecompile.serving.Engine`, e.g. an ``LLMEngine``).

    ``config`` (:class:`~sparsecompile.config.ServerConfig`) sets the API key (default: ``$SPARSECOMPILE_API_KEY``),
    the allowed Host headers, the body limit and read timeout, the chat template and the default seed; the model id
    is ``served_model_name``, else ``config.served_model_name``, else ``engine.model_name``. The engine thread starts
    with the app (or with the first request) and stops when the app shuts down. ``app.state.async_engine`` and
    ``app.state.metrics`` expose the bridge and the metrics.
    """
    config = config or ServerConfig()
    model_name = served_model_name or config.served_model_name or engine.model_name
    max_model_len = int(engine.max_model_len)
    metrics = ServerMetrics()
    bridge = AsyncEngine(engine, metrics)
    metrics.attach_engine_stats(bridge.stats)
    pre = Preprocessor(engine.tokenizer, max_model_len, load_chat_template(config.chat_template))
    api_key = config.api_key if config.api_key is not None else os.environ.get(API_KEY_ENV)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        bridge.start()
        try:
            yield
        finally:
            await asyncio.to_thread(bridge.shutdown)
            pre.close()

    app = FastAPI(title="sparsecompile", lifespan=lifespan)
    app.add_middleware(RequestGuard, allowed_hosts=config.allowed_hosts or default_allowed_hosts(config.host),
                       api_key=api_key or None, max_body=config.max_request_bytes, read_timeout=config.read_timeout,
                       on_reject=lambda status: metrics.requests_rejected.labels(status=str(status)).inc())
    app.state.async_engine = bridge
    app.state.metrics = metrics
    app.state.config = config

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return _error_response(err.status, err.message, err.param, err.error_type, metrics, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(err.errors()))
        return _error_response(400, message, param, metrics=metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = str(err.detail)
        if err.status_code == 404:
            message = f"no route {request.method} {request.url.path}; this server serves /v1/completions, " \
                      "/v1/chat/completions, /v1/models, /health and /metrics"
        return _error_response(err.status_code, message, metrics=metrics)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:  # a bug: uvicorn logs it, closes the connection
        return _error_response(500, f"internal error: {err!r}", metrics=metrics)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {model_name!r} "
                                "(see GET /v1/models)", param="model", error_type="model_not_found")

    def sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens)
        except RequestRejected as err:
            raise APIError(400, str(err)) from None

    async def admit(request_id: str, prompt: list[int], params: SamplingParams,
                    chain_id: str | None = None) -> RequestStream:
        try:
            return await bridge.add_request(request_id, prompt, params, chain_id=chain_id)
        except RequestRejected as err:
            raise APIError(400, str(err)) from None
        except EngineDeadError as err:
            raise APIError(503, str(err)) from None
        except Exception as err:  # noqa: BLE001 - an engine bug, logged by the engine thread; others go on
            raise APIError(500, f"the engine failed to add this request: {err!r}") from None

    async def respond(request: Request, stream: RequestStream, streaming: bool,
                      sse_body: Callable[[RequestStream], AsyncIterator[str]],
                      build: Callable[[RequestOutput], Any]) -> Response:
        if streaming:
            return _AbortingStreamingResponse(sse_body(stream), stream)
        final = await _final_unless_disconnected(request, stream)
        return Response(status_code=499) if final is None else JSONResponse(build(final).model_dump())

    def token_text(token: int) -> str:
        tokenizer = engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)

    @app.get("/health")
    async def health() -> Response:
        if bridge.error is not None:
            return _error_response(503, f"the engine stopped after an error: {bridge.error!r}")
        if bridge.draining:
            return _error_response(503, "the server is shutting down")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await pre.parse(await request.body(), request.headers.get("content-type"), CompletionRequest)
        check_model(body.model)
        prompt_ids = await pre.prompt_ids(body.prompt)
        max_tokens = pre.max_tokens(len(prompt_ids), body.max_tokens if body.max_tokens is not None else 16)
        params = sampling(body, max_tokens)
        echo = ""
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else await pre.decode(prompt_ids)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await admit(request_id, prompt_ids, params, body.chain_id)
        created = int(time.time())

        def echoed(output: RequestOutput) -> tuple[list[int], list]:
            """The prompt's tokens and logprob dicts, as echo puts them before a choice's own."""
            return list(prompt_ids), list(output.prompt_logprobs or [None] * len(prompt_ids))

        def choice(output: RequestOutput, c: CompletionOutput, text: str, ids: list[int], steps: list,
                   reason: str | None, offset: int = 0, final: bool = False,
                   prompt_logprobs: Any = None) -> CompletionChoice:
            logprobs = None
            if body.logprobs is not None:
                if body.echo and final:
                    prompt, prompt_steps = echoed(output)
                    ids, steps = prompt + ids, prompt_steps + steps
                logprobs = completion_logprobs(ids, steps, token_text, offset)
            return CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=reason,
                                    stop_reason=c.stop_reason if reason is not None else None,
                                    prompt_logprobs=prompt_logprobs)

        async def sse_body(outputs: RequestStream) -> AsyncIterator[str]:
            def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
                return CompletionResponse(id=request_id, created=created, model=model_name, choices=choices,
                                          usage=usage, chain_id=body.chain_id)

            offsets, started = {}, set()

            def events(output: RequestOutput, c: CompletionOutput, ids: list[int], steps: list,
                       reason: str | None) -> Iterator[str]:
                text = c.delta_text
                if body.echo and c.index not in started:  # the prompt opens each choice's stream
                    prompt, prompt_steps = echoed(output)
                    text, ids, steps = echo + text, prompt + ids, prompt_steps + steps
                started.add(c.index)
                if not (text or reason or (body.logprobs is not None and ids)):
                    return
                item = choice(output, c, text, ids, steps, reason, offsets.get(c.index, 0))
                if item.logprobs is not None and item.logprobs.tokens:
                    offsets[c.index] = item.logprobs.text_offset[-1] + len(item.logprobs.tokens[-1])
                yield _sse(chunk([item]))

            async for event in _sse_events(outputs, events, chunk if body.include_usage else None):
                yield event

        def build(final: RequestOutput) -> CompletionResponse:
            prompt_lp = prompt_logprobs_field(final.prompt_logprobs) if body.prompt_logprobs is not None else None
            choices = [choice(final, c, echo + c.text, c.token_ids, c.logprobs or [], c.finish_reason, final=True,
                              prompt_logprobs=prompt_lp) for c in final.outputs]
            return CompletionResponse(id=request_id, created=created, model=model_name, usage=_usage(final),
                                      chain_id=body.chain_id, choices=choices)

        return await respond(request, stream, body.stream, sse_body, build)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await pre.parse(await request.body(), request.headers.get("content-type"), ChatCompletionRequest)
        check_model(body.model)
        prompt_ids = await pre.chat_ids([m.as_template_input() for m in body.messages])
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = sampling(body, pre.max_tokens(len(prompt_ids), body.token_limit, param))
        num_top = body.top_logprobs or 0
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await admit(request_id, prompt_ids, params, body.chain_id)
        created = int(time.time())

        def logprobs(ids: list[int], steps: list) -> Any:
            return chat_logprobs(ids, steps, num_top, token_text) if body.logprobs else None

        async def sse_body(outputs: RequestStream) -> AsyncIterator[str]:
            def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=choices,
                                           usage=usage, chain_id=body.chain_id)

            def events(output: RequestOutput, c: CompletionOutput, ids: list[int], steps: list,
                       reason: str | None) -> Iterator[str]:
                if c.delta_text or (body.logprobs and ids):
                    yield _sse(chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(content=c.delta_text),
                                                      logprobs=logprobs(ids, steps))]))
                if reason is not None:
                    yield _sse(chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(), finish_reason=reason,
                                                      stop_reason=c.stop_reason)]))

            for index in range(params.n):
                yield _sse(chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))]))
            async for event in _sse_events(outputs, events, chunk if body.include_usage else None):
                yield event

        def build(final: RequestOutput) -> ChatCompletionResponse:
            choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                  logprobs=logprobs(c.token_ids, c.logprobs or [])) for c in final.outputs]
            return ChatCompletionResponse(id=request_id, created=created, model=model_name, usage=_usage(final),
                                          chain_id=body.chain_id, choices=choices,
                                          prompt_logprobs=prompt_logprobs_field(final.prompt_logprobs)
                                          if body.prompt_logprobs is not None else None)

        return await respond(request, stream, body.stream, sse_body, build)

    add_prune_routes(app, bridge)  # interval pruning of idle state (prune_routes.py)
    return app


async def _sse_events(outputs: RequestStream,
                      events: Callable[[RequestOutput, CompletionOutput, list[int], list, str | None], Iterator[str]],
                      usage_chunk: Callable[[list, UsageInfo], Any] | None) -> AsyncIterator[str]:
    """A streamed request's SSE events: per output and choice, ``events(output, choice, new token ids, their
    logprob steps, the finish reason if it is news)``; after the last output the usage chunk (``usage_chunk([],
    usage)``, if asked for); then ``data: [DONE]``. An engine failure mid-stream ends it with one error event."""
    deltas = _Deltas()
    async for output in _guarded(outputs):
        if isinstance(output, str):
            yield output
            return
        for c in output.outputs:
            for event in events(output, c, *deltas(c)):
                yield event
        if output.finished and usage_chunk is not None:
            yield _sse(usage_chunk([], deltas.usage(output)))
    yield "data: [DONE]\n\n"


async def _guarded(stream: RequestStream) -> AsyncIterator[RequestOutput | str]:
    """The outputs of the stream; an engine failure (or a shutdown) mid-stream becomes one SSE error event and
    ``data: [DONE]`` (a str) and the end."""
    try:
        async for output in stream:
            yield output
    except EngineDeadError as err:
        yield _sse(error_body(503, str(err))) + "data: [DONE]\n\n"
    finally:
        stream.abort()


async def _final_unless_disconnected(request: Request, stream: RequestStream) -> RequestOutput | None:
    """The request's finished output, or None (request aborted) if the client disconnects first."""

    async def last_output() -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        assert final is not None
        return final

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return await _first_of(last_output(), disconnected(), on_exit=stream.abort)


async def _first_of(result: Awaitable[RequestOutput], cancel_if: Awaitable[None],
                    on_exit: Callable[[], None]) -> RequestOutput | None:
    task = asyncio.ensure_future(result)
    watcher = asyncio.ensure_future(cancel_if)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        on_exit()
    if not task.done() or task.cancelled():
        return None
    try:
        return task.result()
    except EngineDeadError as err:
        raise APIError(503, str(err)) from None
