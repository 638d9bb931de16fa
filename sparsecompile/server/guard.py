"""What the server checks before a request reaches a handler (an ASGI middleware, found with a hostile client).

* **Host** (``/v1`` routes): the ``Host`` header must name an allowed host (default: the bind address, localhost,
  127.0.0.1, [::1]), so a web page whose DNS name was rebound to 127.0.0.1 cannot drive a local server from a
  browser. ``"*"`` allows every host. Refused with 400.
* **API key** (``/v1`` routes, when one is set): ``Authorization: Bearer <key>``, compared in constant time
  (:func:`hmac.compare_digest`). Refused with 401. ``/health`` and ``/metrics`` stay open.
* **Body size**: a ``Content-Length`` above the limit gets 413 before any of the body is read; a chunked body is
  counted as it arrives and cut off at the limit the same way.
* **Body time**: the whole body must arrive within ``read_timeout`` seconds, else 408 and the connection closes
  (a client that sends headers and then stalls would otherwise hold its connection and handler forever). The head
  of a request is bounded by the server's protocol (``runner.py``).

The body is read here, whole, then handed to the application as one message; the handler therefore never waits on
the network, and later ``receive()`` calls (disconnect detection) reach the connection directly.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_bytes

LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def host_name(header: str) -> str:
    """The host of a ``Host`` header, lower-cased, without its port (``[::1]:8000`` -> ``[::1]``)."""
    host = header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[:end + 1] if end > 0 else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def default_allowed_hosts(bind_host: str) -> list[str]:
    bind = bind_host.strip().lower()
    if ":" in bind and not bind.startswith("["):
        bind = f"[{bind}]"  # an IPv6 bind address appears bracketed in Host headers
    return [bind, *LOCAL_HOSTS]


class RequestGuard:
    """The ASGI middleware described in the module docstring.

    Args:
        app: the application behind it.
        allowed_hosts: accepted ``Host`` values (``"*"`` among them: any), or None for any.
        api_key: the key ``/v1`` routes require, or None.
        max_body: most bytes a request body may have.
        read_timeout: seconds the whole body may take to arrive.
        on_reject: called with the status of every request refused here (metrics).
    """

    def __init__(self, app: ASGIApp, *, allowed_hosts: Iterable[str] | None, api_key: str | None, max_body: int,
                 read_timeout: float, on_reject: Callable[[int], None] | None = None) -> None:
        self.app = app
        hosts = None if allowed_hosts is None else {host_name(h) if h != "*" else "*" for h in allowed_hosts}
        self.allowed_hosts = None if hosts is None or "*" in hosts else hosts
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.read_timeout = read_timeout
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), value)
        path = scope.get("path", "")
        if path == "/v1" or path.startswith("/v1/"):
            refusal = self._check_host(headers) or self._check_key(headers)
            if refusal is not None:
                await self._refuse(send, *refusal)
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await self._refuse(send, 413, f"the request body has {int(length)} bytes; this server accepts at most "
                                          f"{self.max_body} (--max-request-bytes)")
            return
        if (length is None or length == b"0") and b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)
            return
        body = await self._read_body(receive, send)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check_host(self, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        if self.allowed_hosts is None:
            return None
        raw = headers.get(b"host", b"").decode("latin-1")
        if host_name(raw) in self.allowed_hosts:
            return None
        allowed = ", ".join(sorted(self.allowed_hosts))
        return 400, (f"Host header {raw!r} is not allowed (accepted: {allowed}); this protects a local server from "
                     "DNS-rebinding web pages. Start the server with --allowed-hosts naming the host clients use "
                     "(or '*')")

    def _check_key(self, headers: dict[bytes, bytes]) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        if self.api_key is None:
            return None
        scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
        challenge = [(b"www-authenticate", b"Bearer")]
        if scheme.lower() != b"bearer" or not token.strip():
            return 401, "missing API key: send the header 'Authorization: Bearer <key>'", challenge
        if not hmac.compare_digest(token.strip(), self.api_key):
            return 401, "invalid API key (the 'Authorization: Bearer' token does not match the server's)", challenge
        return None

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once a refusal was sent (too large, too slow) or the client left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await self._refuse(send, 408, f"the request body did not arrive within {self.read_timeout:g} s "
                                              f"({size} bytes came); send the whole body at once")
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await self._refuse(send, 413, f"the request body is larger than {self.max_body} bytes, the most "
                                              "this server accepts (--max-request-bytes)")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, send: Send, status: int, message: str,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer ``status`` and close the connection (the rest of a body may still be on its way)."""
        if self.on_reject is not None:
            self.on_reject(status)
        body = error_bytes(status, message)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), *(headers or [])]})
        await send({"type": "http.response.body", "body": body})
