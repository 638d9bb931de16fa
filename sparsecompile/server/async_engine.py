"""The bridge between asyncio request handlers and the (synchronous, not thread-safe) :class:`LLMEngine`.

One background thread owns the engine: it is the only caller of ``add_request``, ``abort_request``, ``step``,
``has_unfinished_requests`` and ``stats``. Handlers on the event loop talk to it through an inbox (a list under
a lock, plus a :class:`threading.Event` that wakes the thread); the thread drains the inbox before every step,
loops ``engine.step()`` while there is work and sleeps on the event otherwise. Each admitted request gets an
:class:`asyncio.Queue` that the thread feeds with ``loop.call_soon_threadsafe``.

A :class:`RequestStream` (and :meth:`AsyncEngine.generate`, built on it) aborts its request when it is closed
or cancelled before the request finished; that is how a client that disconnects frees its KV pages at once.

:meth:`AsyncEngine.stats` stays current while a step runs: requests still in the inbox count as waiting, and the
snapshot is refreshed as soon as the inbox is drained, not only after steps. :meth:`AsyncEngine.begin_shutdown`
drains without blocking (a signal's shutdown path): new requests get :class:`EngineDeadError`, running ones end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..serving.interface import Engine
from ..serving.outputs import RequestMetrics, RequestOutput, RequestRejected, SamplingParams
from .metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an engine step raised, or the server is shutting down)."""


@dataclass
class _Stream:
    """Engine-thread bookkeeping of one admitted request."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    last: RequestOutput | None = None
    saw_first_token: bool = False

    def push(self, item: RequestOutput | BaseException) -> None:
        _call_in_loop(self.loop, self.queue.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: _Stream
    admitted: asyncio.Future
    chain_id: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future = field(repr=False)


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop was closed: nobody is left to receive it
        pass


def _settle(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` from its own loop unless it was cancelled meanwhile."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    _call_in_loop(future.get_loop(), settle)


def _detached(output: RequestOutput) -> RequestOutput:
    """A copy of ``output`` that later engine steps cannot change (the engine may update its objects in place). The
    prompt's ids are the engine's own list, which it never changes: not copied (a long prompt, every step)."""
    completions = [dataclasses.replace(c, token_ids=list(c.token_ids), delta_token_ids=list(c.delta_token_ids),
                                       logprobs=None if c.logprobs is None else list(c.logprobs))
                   for c in output.outputs]
    return dataclasses.replace(output, outputs=completions)


class RequestStream:
    """The outputs of one admitted request, in order, ending with the finished one (async-iterable once).

    Raises :class:`EngineDeadError` if the engine stops first. :meth:`abort` (also called by :meth:`aclose`)
    cancels the request in the engine unless it already finished; it is safe to call any number of times.
    """

    def __init__(self, request_id: str, queue: asyncio.Queue, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.finished = False
        self._queue = queue
        self._abort = abort
        self._abort_sent = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished and not self._abort_sent:
            self._abort_sent = True
            self._abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread and serves it to asyncio code.

    Args:
        engine: the engine; from now on only this object's thread may call it.
        metrics: optional :class:`ServerMetrics` fed with per-request counts and latencies.
    """

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self._metrics = metrics
        self._inbox: list[_Add | _Abort | _Call] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = engine.stats()
        self._queued_adds = 0  # requests sent to the engine thread and not yet in a stats snapshot
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------------------- asyncio side

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine thread, if one did."""
        return self._error

    @property
    def draining(self) -> bool:
        """True once shutdown began: new requests are refused, running ones end."""
        return self._stopping

    def stats(self) -> Any:
        """The engine's ``EngineStats`` as of the last snapshot (taken by the engine thread after each step and each
        inbox drain), with the requests still on their way to the engine counted as waiting."""
        with self._lock:
            stats, queued = self._stats, self._queued_adds
        if queued and dataclasses.is_dataclass(stats) and hasattr(stats, "num_waiting"):
            stats = dataclasses.replace(stats, num_waiting=stats.num_waiting + queued)
        return stats

    def start(self) -> None:
        """Start the engine thread (idempotent; :meth:`add_request` starts it too)."""
        with self._lock:
            self._check_alive()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sparsecompile-engine", daemon=True)
                self._thread.start()

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          chain_id: str | None = None) -> RequestStream:
        """Admit a request; raises ``RequestRejected`` (from the engine) if it can never be served."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop=loop, queue=asyncio.Queue(), arrival=time.monotonic())
        admitted = loop.create_future()
        self.start()
        self._send(_Add(request_id, prompt, params, stream, admitted, chain_id))
        try:
            await admitted
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it frees whatever the add took
            raise
        return RequestStream(request_id, stream.queue, self.abort)

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; abort it if the caller stops or is cancelled first."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (frees its pages); unknown or finished ids are ignored. Callable from any thread."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                return
            self._inbox.append(_Abort(request_id))
        self._wakeup.set()

    async def run_on_engine_thread(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps (e.g. to use the tokenizer safely)."""
        loop = asyncio.get_running_loop()
        result = loop.create_future()
        self.start()
        self._send(_Call(fn, loop, result))
        return await result

    def begin_shutdown(self) -> None:
        """Start stopping without waiting: new requests get :class:`EngineDeadError` (503), and the engine thread
        aborts every running request (their streams raise :class:`EngineDeadError`) after its current step."""
        with self._lock:
            self._stopping = True
        self._wakeup.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread: abort every request (their streams raise :class:`EngineDeadError`)."""
        self.begin_shutdown()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _send(self, command: _Add | _Abort | _Call) -> None:
        with self._lock:
            self._check_alive()
            self._inbox.append(command)
            if isinstance(command, _Add):
                self._queued_adds += 1
        self._wakeup.set()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error!r}; restart the server")
        if self._stopping:
            raise EngineDeadError("the server is shutting down")

    # ------------------------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self.engine.bind_thread(f"the server's engine thread ({threading.current_thread().name})")
            while True:
                self._wakeup.clear()
                with self._lock:
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                for command in commands:
                    self._handle(command)
                adds = sum(isinstance(c, _Add) for c in commands)
                if commands:
                    stats = self.engine.stats()  # current before the (maybe long) next step, not after it
                    with self._lock:
                        self._stats = stats
                        self._queued_adds -= adds
                if stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                    self._stats = self.engine.stats()
                else:
                    self._stats = self.engine.stats()
                    self._wakeup.wait()
            self._close_all(EngineDeadError("the server is shutting down"), abort_in_engine=True)
        except BaseException as err:  # noqa: BLE001 - any engine failure must reach every waiting request
            logger.exception("engine thread failed; failing all requests")
            with self._lock:
                self._error = err
            self._close_all(EngineDeadError(f"the engine failed: {err!r}"), abort_in_engine=False)
        finally:
            self.engine.bind_thread(None)  # stopped: the engine may be driven from elsewhere again

    def _handle(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            self._admit(command)
        elif isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            stream = self._streams.pop(command.request_id, None)
            if stream is not None:
                self._finish_aborted(command.request_id, stream)
        else:
            try:
                value = command.fn(self.engine)
            except Exception as err:  # noqa: BLE001 - handed to the caller
                _settle(command.result, error=err)
            else:
                _settle(command.result, result=value)

    def _admit(self, command: _Add) -> None:
        if command.request_id in self._streams:
            _settle(command.admitted, error=RequestRejected(
                f"request id {command.request_id!r} is already in use; use a unique id per request"))
            return
        try:
            chain = {"chain_id": command.chain_id} if command.chain_id is not None else {}
            self.engine.add_request(command.request_id, command.prompt, command.params, **chain)
        except Exception as err:  # noqa: BLE001 - RequestRejected, or an engine bug reported to this request only
            if not isinstance(err, RequestRejected):
                logger.exception("engine.add_request(%r) failed", command.request_id)
            _settle(command.admitted, error=err)
            return
        self._streams[command.request_id] = command.stream
        _settle(command.admitted)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted by us meanwhile
                continue
            output = _detached(output)
            self._observe(stream, output, now)
            stream.last = output
            if output.finished:
                del self._streams[output.request_id]
            stream.push(output)

    def _finish_aborted(self, request_id: str, stream: _Stream) -> None:
        last = stream.last
        if last is None:
            output = RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[],
                                   outputs=[], finished=True, metrics=RequestMetrics(arrival_time=stream.arrival))
        else:
            completions = [dataclasses.replace(c, finish_reason=c.finish_reason or "abort", delta_text="",
                                               delta_token_ids=[]) for c in last.outputs]
            output = dataclasses.replace(last, outputs=completions, finished=True)
        if self._metrics is not None:
            self._metrics.requests_finished.labels(finish_reason="abort").inc()
            self._metrics.e2e_latency.observe(time.monotonic() - stream.arrival)
        stream.push(output)

    def _observe(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        metrics = self._metrics
        if metrics is None:
            return
        if stream.last is None:
            metrics.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            metrics.generation_tokens.inc(len(completion.delta_token_ids))
            if completion.token_ids and not stream.saw_first_token:
                stream.saw_first_token = True
                # when the engine sampled it: a request that reports only its final output has its first here too
                first = output.metrics.first_token_time
                metrics.time_to_first_token.observe((now if first is None else first) - stream.arrival)
        if output.finished:
            reason = output.outputs[0].finish_reason if output.outputs else "abort"
            metrics.requests_finished.labels(finish_reason=reason or "unknown").inc()
            metrics.e2e_latency.observe(now - stream.arrival)

    def _close_all(self, error: EngineDeadError, abort_in_engine: bool) -> None:
        with self._lock:
            commands, self._inbox = self._inbox, []
            self._queued_adds -= sum(isinstance(c, _Add) for c in commands)
        for command in commands:
            if isinstance(command, _Add):
                _settle(command.admitted, error=error)
            elif isinstance(command, _Call):
                _settle(command.result, error=error)
        for request_id, stream in list(self._streams.items()):
            if abort_in_engine:
                try:
                    self.engine.abort_request(request_id)
                except Exception:  # noqa: BLE001 - shutting down regardless
                    logger.exception("engine.abort_request(%r) failed during shutdown", request_id)
            stream.push(error)
        self._streams.clear()
        if abort_in_engine:
            try:
                self._stats = self.engine.stats()
            except Exception:  # noqa: BLE001
                logger.exception("engine.stats() failed during shutdown")
