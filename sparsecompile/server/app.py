"""The OpenAI-compatible FastAPI application: completions, chat completions, models, health, metrics.

Every error is answered as OpenAI does, ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx
status, and the server keeps serving. A streaming request is aborted in the engine as soon as its client goes
away (Starlette cancels the body iterator on disconnect); a non-streaming one is raced against the client's
disconnect for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ..serving.interface import Engine
from ..serving.outputs import RequestOutput, RequestRejected, SamplingParams
from .async_engine import AsyncEngine, EngineDeadError, RequestStream
from .metrics import ServerMetrics
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
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)
from .prune_routes import add_prune_routes

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                503: "service_unavailable", 500: "internal_server_error"}


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or _ERROR_TYPES.get(status, "invalid_request_error")


def _error_response(status: int, message: str, param: str | None = None, error_type: str | None = None,
                    metrics: ServerMetrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.requests_rejected.labels(status=str(status)).inc()
    body = ErrorResponse(error=ErrorInfo(message=message, param=param, code=status,
                                         type=error_type or _ERROR_TYPES.get(status, "invalid_request_error")))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per problem, e.g. ``max_tokens: Input should be greater than or equal to 1``."""
    parts, params = [], []
    for problem in err.errors():
        loc = [str(p) for p in problem.get("loc", ()) if p != "body"]
        kind = problem.get("type", "")
        if kind == "json_invalid":
            detail = problem.get("ctx", {}).get("error", "")
            parts.append(f"request body is not valid JSON ({detail}); send a JSON object")
            continue
        if kind == "extra_forbidden":
            parts.append(f"unknown field {'.'.join(loc)!r}; remove it (see the OpenAI API reference for the "
                         "supported fields)")
        else:
            msg = str(problem.get("msg", "invalid value")).removeprefix("Value error, ")
            parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
        if loc:
            params.append(".".join(loc))
    return "; ".join(parts) or "invalid request", (params[0] if params else None)


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
    completion = len(output.outputs[0].token_ids) if output.outputs else 0
    return UsageInfo.of(len(output.prompt_token_ids), completion)


def create_app(engine: Engine, served_model_name: str | None = None) -> FastAPI:
    """Build the app over ``engine`` (any :class:`~sparsecompile.serving.Engine`, e.g. an ``LLMEngine``);
    ``served_model_name`` defaults to ``engine.model_name``.

    The engine thread starts with the app (or with the first request) and stops when the app shuts down.
    ``app.state.async_engine`` and ``app.state.metrics`` expose the bridge and the metrics.
    """
    model_name = served_model_name or engine.model_name
    max_model_len = int(engine.max_model_len)
    metrics = ServerMetrics()
    bridge = AsyncEngine(engine, metrics)
    metrics.attach_engine_stats(bridge.stats)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        bridge.start()
        try:
            yield
        finally:
            await asyncio.to_thread(bridge.shutdown)

    app = FastAPI(title="sparsecompile", lifespan=lifespan)
    app.state.async_engine = bridge
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return _error_response(err.status, err.message, err.param, err.error_type, metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(err)
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

    async def admit(request_id: str, prompt: str | list[int], params: SamplingParams,
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

    @app.get("/health")
    async def health() -> Response:
        if bridge.error is not None:
            return _error_response(503, f"the engine stopped after an error: {bridge.error!r}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = _sampling(body, body.max_tokens or 16)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await admit(request_id, body.prompt, params, body.chain_id)
        created = int(time.time())

        async def sse_body(outputs: RequestStream) -> AsyncIterator[str]:
            def chunk(text: str, reason: str | None, usage: UsageInfo | None = None,
                      choices: bool = True) -> CompletionResponse:
                choice = [CompletionChoice(text=text, finish_reason=reason)] if choices else []
                return CompletionResponse(id=request_id, created=created, model=model_name, choices=choice,
                                          usage=usage, chain_id=body.chain_id)

            async for item in _guarded(outputs):
                if isinstance(item, str):
                    yield item
                    return
                text, reason, output = item
                if text or output.finished:
                    yield _sse(chunk(text, reason))
                if output.finished and body.include_usage:
                    yield _sse(chunk("", None, _usage(output), choices=False))
            yield "data: [DONE]\n\n"

        def build(final: RequestOutput) -> CompletionResponse:
            completion = final.outputs[0]
            return CompletionResponse(id=request_id, created=created, model=model_name, usage=_usage(final),
                                      chain_id=body.chain_id, choices=[CompletionChoice(text=completion.text,
                                                                finish_reason=completion.finish_reason,
                                                                stop_reason=completion.stop_reason)])

        return await respond(request, stream, body.stream, sse_body, build)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        messages = [m.as_template_input() for m in body.messages]
        try:
            prompt = await bridge.run_on_engine_thread(lambda e: e.chat_prompt_ids(messages))
        except EngineDeadError as err:
            raise APIError(503, str(err)) from None
        except Exception as err:  # noqa: BLE001 - the template refused these messages (e.g. role order)
            raise APIError(400, f"the model's chat template cannot render these messages: {err}",
                           param="messages") from None
        # Without a limit the engine stops at the context length (it caps max_tokens at max_model_len - prompt).
        params = _sampling(body, body.token_limit or max_model_len)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await admit(request_id, prompt, params, body.chain_id)
        created = int(time.time())

        async def sse_body(outputs: RequestStream) -> AsyncIterator[str]:
            def chunk(delta: DeltaMessage | None, reason: str | None = None,
                      usage: UsageInfo | None = None) -> ChatCompletionChunk:
                choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=reason)]
                return ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=choices,
                                           usage=usage, chain_id=body.chain_id)

            yield _sse(chunk(DeltaMessage(role="assistant", content="")))
            async for item in _guarded(outputs):
                if isinstance(item, str):
                    yield item
                    return
                text, reason, output = item
                if text:
                    yield _sse(chunk(DeltaMessage(content=text)))
                if output.finished:
                    yield _sse(chunk(DeltaMessage(), reason))
                    if body.include_usage:
                        yield _sse(chunk(None, usage=_usage(output)))
            yield "data: [DONE]\n\n"

        def build(final: RequestOutput) -> ChatCompletionResponse:
            completion = final.outputs[0]
            return ChatCompletionResponse(id=request_id, created=created, model=model_name, usage=_usage(final),
                                          chain_id=body.chain_id,
                                          choices=[ChatChoice(message=AssistantMessage(content=completion.text),
                                                              finish_reason=completion.finish_reason,
                                                              stop_reason=completion.stop_reason)])

        return await respond(request, stream, body.stream, sse_body, build)

    add_prune_routes(app, bridge)  # interval pruning of idle state (prune_routes.py)
    return app


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens)
    except RequestRejected as err:
        raise APIError(400, str(err)) from None


async def _guarded(stream: RequestStream) -> AsyncIterator[tuple[str, str | None, RequestOutput] | str]:
    """Per output of the stream ``(delta text, finish reason, output)``; an engine failure mid-stream becomes one SSE
    error event (a str) and the end."""
    try:
        async for output in stream:
            completion = output.outputs[0] if output.outputs else None
            text = completion.delta_text if completion else ""
            yield text, (completion.finish_reason if completion else "abort"), output
    except EngineDeadError as err:
        body = ErrorResponse(error=ErrorInfo(message=str(err), type=_ERROR_TYPES[503], code=503))
        yield _sse(body) + "data: [DONE]\n\n"
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


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          log_level: str = "info") -> None:
    """Serve ``engine`` over HTTP with uvicorn until interrupted (Ctrl-C shuts the engine thread down)."""
    import uvicorn

    uvicorn.run(create_app(engine, served_model_name), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)
