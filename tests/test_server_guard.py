"""The server against a hostile client (CPU, a scripted engine, uvicorn on 127.0.0.1): API key, Host header,
body size and time limits, half-open connections, malformed bodies, tokenization off the engine thread,
/metrics while a step runs (and a final-only request's time to first token, on a tiny model), and the drain at
shutdown.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import CharTokenizer, ScriptedEngine, ServerThread, sse_events

from sparsecompile.config import MethodConfigError, ServerConfig
from sparsecompile.server import create_app
from sparsecompile.server.app import API_KEY_ENV
from sparsecompile.server.guard import host_name
from sparsecompile.server.runner import uvicorn_config

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "scripted", "prompt": [1, 2, 3], "max_tokens": 2}


def serve(engine: ScriptedEngine, **options) -> ServerThread:
    config = ServerConfig(port=0, uvicorn_log_level="warning", **options)
    app = create_app(engine, config=config)
    thread = ServerThread(uvicorn_config(app, config))
    thread.app = app
    return thread


@pytest.fixture(scope="module")
def guarded():
    """A server with an API key, a 64 KiB body limit and a 1 s read timeout."""
    thread = serve(ScriptedEngine(), api_key=KEY, max_request_bytes=64 << 10, read_timeout=1.0)
    with thread as url:
        yield url, thread.port


def raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection; everything the server answers until it closes (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pass
    return b"".join(chunks)


def asgi_get(app, path: str, base_url: str = "http://127.0.0.1", **headers: str) -> int:
    """The status of GET ``path`` sent straight to the ASGI app (no server, no lifespan)."""

    async def get() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url) as http:
            return (await http.get(path, headers=headers)).status_code

    return asyncio.run(get())


def test_api_key_guards_every_v1_route(guarded, monkeypatch):
    url, _ = guarded
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
            for response in (http.get("/v1/models", headers=headers), http.post("/v1/completions", json=BODY,
                                                                                  headers=headers)):
                assert response.status_code == 401, headers
                assert response.headers["www-authenticate"] == "Bearer"
                assert "Authorization: Bearer" in response.json()["error"]["message"]
        assert http.get("/v1/models", headers=AUTH).status_code == 200
        assert http.post("/v1/completions", json=BODY, headers=AUTH).json()["choices"][0]["text"] == "hh"
        assert http.get("/v1/nothing", headers=AUTH).status_code == 404
    # without api_key the environment variable sets it
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    app = create_app(ScriptedEngine(), config=ServerConfig())
    assert asgi_get(app, "/v1/models") == 401
    assert asgi_get(app, "/v1/models", Authorization="Bearer from-env") == 200


def test_host_header_must_name_an_allowed_host(guarded):
    url, port = guarded
    assert host_name("[::1]:8000") == "[::1]" and host_name("LocalHost:1") == "localhost" and host_name("a.b") == "a.b"
    with httpx.Client(base_url=url, timeout=10) as http:
        rebound = http.get("/v1/models", headers={**AUTH, "Host": f"attacker.example:{port}"})
        assert rebound.status_code == 400
        assert "attacker.example" in rebound.json()["error"]["message"] and "--allowed-hosts" in \
            rebound.json()["error"]["message"]
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
            assert http.get("/v1/models", headers={**AUTH, "Host": host}).status_code == 200, host
        assert http.get("/health", headers={"Host": "attacker.example"}).status_code == 200
    for allowed, status in ((["*"], 200), (["api.example.com"], 400), (["Attacker.Example"], 200)):
        app = create_app(ScriptedEngine(), config=ServerConfig(allowed_hosts=allowed))
        assert asgi_get(app, "/v1/models", "http://attacker.example:80") == status, allowed


def test_body_limits_answer_413_before_reading(guarded):
    url, port = guarded
    start = time.monotonic()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\n\r\n")
    answer = raw(port, head + b'{"model": "scripted", "prompt": "')
    assert answer.startswith(b"HTTP/1.1 413") and b"50000000 bytes" in answer
    assert time.monotonic() - start < 0.9  # at once, not after the read timeout

    def chunks():
        yield b'{"model": "scripted", "prompt": "'
        for _ in range(20):
            yield b"x" * 4096

    with httpx.Client(base_url=url, timeout=10, headers=AUTH) as http:
        response = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert response.status_code == 413 and "--max-request-bytes" in response.json()["error"]["message"]
        assert http.post("/v1/completions", json=BODY).status_code == 200  # still serving


def test_malformed_bodies_get_messages_that_say_what_to_send(guarded):
    url, _ = guarded
    deep = '{"model": "scripted", "prompt": ' + "[" * 40 + "1" + "]" * 40 + "}"
    very_deep = '{"model": ' + "[" * 20000 + "]" * 20000 + "}"
    cases = [  # (body, content type, status, words)
        (b"", "application/json", 400, ["body is empty", "send a JSON object"]),
        (b"  \n", None, 400, ["body is empty"]),
        (b'{"model": "scripted", "prompt": "\xff\xfe"}', "application/json", 400, ["not UTF-8", "byte 33"]),
        (deep.encode(), "application/json", 400, ["nests deeper than 32 levels"]),
        (very_deep.encode(), "application/json", 400, ["nests too deeply"]),
        (json.dumps(BODY).encode(), "text/plain", 415, ["'text/plain' is not JSON", "application/json"]),
        (json.dumps(BODY).encode(), "application/x-www-form-urlencoded", 415, ["Content-Type"]),
        (b"[1, 2]", "application/json", 400, ["JSON list, not an object"]),
        (b'{"model": "scripted", "prompt": [1], "temperature": NaN}', "application/json", 400, ["NaN"]),
        (b'{"model": "scripted", "prompt": "a\\ud800b"}', "application/json", 400, ["lone surrogate", "prompt"]),
        (b'{"model": "scripted", "prompt": "hi", "max_tokens": 70}', None, 400,
         ["max_tokens=70 is too large", "context is 64 tokens", "at most 62"]),
        (b'{"model": "scripted", "messages": [{"role": "user", "content": "\\udc00"}]}', "application/json", 400,
         ["messages.0.content", "lone surrogate"]),
    ]
    with httpx.Client(base_url=url, timeout=10, headers=AUTH) as http:
        for body, content_type, status, words in cases:
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            headers = {"Content-Type": content_type} if content_type else {}
            response = http.post(path, content=body, headers=headers)
            assert response.status_code == status, (body[:80], response.text)
            for word in words:
                assert word in response.json()["error"]["message"], (body[:80], response.text)
        # a body without Content-Type is read as JSON; the server still serves
        assert http.post("/v1/completions", content=json.dumps(BODY).encode()).status_code == 200
        chat = http.post("/v1/chat/completions", json={"model": "scripted", "max_tokens": 1,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len("<user>hi<assistant>")


def test_half_open_connections_are_closed_after_the_read_timeout(guarded):
    """300 connections that stall: 150 mid-body (408, closed), 150 mid-head (closed). None stays open."""
    url, port = guarded
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    sockets = []
    for i in range(300):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(head + b'{"model": "scr' if i % 2 == 0 else b"POST /v1/completions HTTP/1.1\r\nHost: 12")
        sockets.append(sock)
    start = time.monotonic()
    answers = {sock: b"" for sock in sockets}
    open_ = set(sockets)
    while open_ and time.monotonic() - start < 8:
        readable, _, _ = select.select(list(open_), [], [], 0.5)
        for sock in readable:
            chunk = sock.recv(65536)
            answers[sock] += chunk
            if not chunk:
                open_.discard(sock)
    elapsed = time.monotonic() - start
    for sock in sockets:
        sock.close()
    assert not open_, f"{len(open_)} of 300 stalled connections still open after {elapsed:.1f} s"
    assert all(answers[s].startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answers[s]
               for s in sockets[0::2])
    assert all(answers[s] == b"" for s in sockets[1::2])
    with httpx.Client(base_url=url, timeout=10, headers=AUTH) as http:
        assert http.post("/v1/completions", json=BODY).status_code == 200


def test_tokenization_runs_off_the_engine_thread_and_the_event_loop():
    tokenizer = CharTokenizer(delay=1.5)
    engine = ScriptedEngine(tokenizer=tokenizer, step_time=0.01)
    with serve(engine) as url:

        async def run() -> tuple[float, float, float]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                start = time.monotonic()
                slow = asyncio.ensure_future(http.post("/v1/completions", json={**BODY, "prompt": "long text"}))
                await asyncio.sleep(0.2)
                health = await http.get("/health")
                fast = await http.post("/v1/completions", json=BODY)  # token ids: needs no tokenizer
                fast_done = time.monotonic() - start
                assert health.status_code == 200 and fast.status_code == 200
                response = await slow
                assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 9
                return fast_done, time.monotonic() - start

        fast_done, slow_done = asyncio.run(run())
    assert fast_done < 1.2 < slow_done  # the token-id request did not wait for the 1.5 s tokenization
    assert tokenizer.threads == {"sparsecompile-tokenizer_0"}


def test_metrics_are_current_while_a_step_runs():
    """The snapshot is taken when the inbox is drained (not only after steps), and requests still in the inbox
    count as waiting: a request that arrives during a long step shows at once."""
    engine = ScriptedEngine()
    engine.gate = threading.Event()
    with serve(engine) as url:

        def gauges() -> dict[str, float]:
            text = httpx.get(f"{url}/metrics").text
            return {s.name.removeprefix("sparsecompile_"): s.value for f in text_string_to_metric_families(text)
                    for s in f.samples if s.name.endswith(("running", "waiting", "kv_pages_free"))}

        with httpx.Client(base_url=url, timeout=30) as http, ThreadPoolExecutor(2) as pool:
            try:
                first = pool.submit(http.post, "/v1/completions", json=BODY)
                assert engine.stepping.wait(10)  # the engine thread is inside a step now
                # the snapshot taken when the first request left the inbox (the step admits it later)
                assert gauges() == {"num_requests_running": 0, "num_requests_waiting": 1, "kv_pages_free": 8}
                second = pool.submit(http.post, "/v1/completions", json=BODY)
                deadline = time.monotonic() + 10
                while gauges()["num_requests_waiting"] != 2:  # queued in the bridge's inbox behind the step
                    assert time.monotonic() < deadline, gauges()
                    time.sleep(0.05)
            finally:
                engine.gate.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
        assert gauges() == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_pages_free": 8}


def test_time_to_first_token_is_when_the_engine_sampled_it():
    """A non-streamed request gets only its final output from the engine (``FINAL_ONLY``): its time to first token
    is still the first token's (the engine's ``first_token_time``), not the time the final output arrived."""
    from test_llm import DigitTokenizer, prompts_of
    from tiny_models import tiny_pair

    from sparsecompile import LLM

    _, model = tiny_pair()
    llm = LLM(model, "vanilla", tokenizer=DigitTokenizer(), page_size=4, max_num_seqs=2, model_name="tiny")
    app = create_app(llm.llm_engine)

    async def run() -> dict[str, float]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            body = {"model": "tiny", "prompt": prompts_of([9])[0], "max_tokens": 60, "temperature": 0,
                    "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            text = (await client.get("/metrics")).text
        app.state.async_engine.shutdown()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.endswith(("time_to_first_token_seconds_sum", "e2e_request_latency_seconds_sum"))}

    sums = asyncio.run(run())
    ttft = sums["sparsecompile_time_to_first_token_seconds_sum"]
    e2e = sums["sparsecompile_e2e_request_latency_seconds_sum"]
    assert 0 < ttft < e2e  # 59 decode steps come after the first token


def test_drain_ends_streams_with_an_error_event_and_refuses_new_requests():
    engine = ScriptedEngine(step_time=0.05)
    thread = serve(engine)
    with thread as url, httpx.Client(base_url=url, timeout=30) as http:
        events = []
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 60, "stream": True}) as response:
            for event in sse_events(response.iter_lines()):
                events.append(event)
                if len(events) == 2:
                    thread.app.state.async_engine.begin_shutdown()  # what SIGTERM / SIGINT do first
        assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
        assert len(events) < 30
        refused = http.post("/v1/completions", json=BODY)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert http.get("/health").status_code == 503


def test_server_config_validation():
    with pytest.raises(MethodConfigError, match="uvicorn_log_level"):
        ServerConfig(uvicorn_log_level="loud")
    with pytest.raises(MethodConfigError, match="read_timeout"):
        ServerConfig(read_timeout=0)
    with pytest.raises(MethodConfigError, match="allowed_hosts"):
        ServerConfig(allowed_hosts="localhost")
    with pytest.raises(MethodConfigError, match="port"):
        ServerConfig(port=70000)
    assert not hasattr(ServerConfig(), "seed")  # one seed option: ServingConfig.seed (--seed)
