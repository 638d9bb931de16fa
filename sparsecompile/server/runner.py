"""Running the app with uvicorn: a bounded request head, and a drain before shutdown (SIGTERM, SIGINT).

* uvicorn's h11 protocol never times out a connection that sends part of a request head and stalls; the
  protocol here closes a connection whose head is not complete ``read_timeout`` seconds after it connected (or
  after its previous response). The body's own deadline is :class:`~sparsecompile.server.guard.RequestGuard`'s.
* On SIGTERM or SIGINT, before uvicorn waits for open connections, the engine drains: running requests end (a
  stream gets an error event and ``data: [DONE]``, a waiting client 503), new ones get 503, ``/health`` turns 503.
  The process then exits normally (status 0, no traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from ..config import ServerConfig
from ..serving.interface import Engine
from .app import create_app

logger = logging.getLogger(__name__)


def _head_timeout_protocol(read_timeout: float) -> type[asyncio.Protocol] | str:
    """uvicorn's h11 protocol with a deadline on each request head ("auto" if this uvicorn lacks the hooks)."""
    try:
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError:  # pragma: no cover - uvicorn without its h11 implementation
        return "auto"
    if not all(hasattr(H11Protocol, name) for name in ("handle_events", "on_response_complete", "connection_lost")):
        logger.warning("this uvicorn's h11 protocol has changed; request heads are not timed out")
        return "auto"

    class HeadTimeoutProtocol(H11Protocol):
        """Closes a connection whose request head does not arrive whole within ``read_timeout`` seconds."""

        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(read_timeout, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a whole head arrived: the request is the app's now
                self._cancel_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_head_timer()  # the next request's head (idle keep-alive closes sooner)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

    return HeadTimeoutProtocol


def uvicorn_config(app: Any, config: ServerConfig) -> uvicorn.Config:
    """The uvicorn settings ``serve`` runs ``app`` with (tests reuse them)."""
    # uvicorn's default logging config disables every logger created before it (ours: "sparsecompile")
    log_config = {**uvicorn.config.LOGGING_CONFIG, "disable_existing_loggers": False}
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                          http=_head_timeout_protocol(config.read_timeout), lifespan="on",
                          timeout_graceful_shutdown=5, log_config=log_config)


class DrainingServer(uvicorn.Server):
    """uvicorn's server that calls ``drain()`` when shutdown starts, before it waits for open connections."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], None]) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets: Any = None) -> None:
        self._drain()
        await super().shutdown(sockets)


@contextlib.contextmanager
def _sigterm_exits_quietly() -> Iterator[None]:
    """uvicorn re-raises the signal that stopped it once it is done; let a re-raised SIGTERM end the process
    normally instead of killing it (SIGINT keeps raising KeyboardInterrupt, which the CLI catches)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve(engine: Engine, config: ServerConfig | None = None, **overrides: Any) -> None:
    """Serve ``engine`` over HTTP with uvicorn until SIGTERM / SIGINT (see the module docstring).

    ``config``: a :class:`~sparsecompile.config.ServerConfig`; ``overrides`` replace its fields (``host=``,
    ``port=``, ...; ``log_level=`` is read as ``uvicorn_log_level``).
    """
    if "log_level" in overrides:
        overrides["uvicorn_log_level"] = overrides.pop("log_level")
    config = dataclasses.replace(config or ServerConfig(), **overrides)
    app = create_app(engine, config=config)
    server = DrainingServer(uvicorn_config(app, config), app.state.async_engine.begin_shutdown)
    with _sigterm_exits_quietly():
        server.run()
