"""Helpers of the server tests: uvicorn in a thread, SSE parsing, a scripted engine and a character tokenizer."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import uvicorn

from sparsecompile.serving.outputs import CompletionOutput, RequestMetrics, RequestOutput


class ServerThread:
    """uvicorn serving an app on 127.0.0.1 (a free port) in a background thread; a context manager yielding the base
    URL. Pass a ``uvicorn.Config`` (e.g. ``runner.uvicorn_config``) or an app."""

    def __init__(self, app_or_config) -> None:
        config = app_or_config if isinstance(app_or_config, uvicorn.Config) else \
            uvicorn.Config(app_or_config, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "uvicorn did not shut down"


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


class CharTokenizer:
    """One token per character (``ord % 50 + 1``); decodes token ``t`` to a letter. ``delay`` seconds per encode;
    records the threads that encoded."""

    chat_template = "<role>content...<assistant>"  # rendered by apply_chat_template below

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.threads: set[str] = set()

    def __call__(self, text: str, add_special_tokens: bool = True):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        text.encode("utf-8")  # a lone surrogate raises, as real tokenizers do
        return SimpleNamespace(input_ids=[ord(c) % 50 + 1 for c in text])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    def apply_chat_template(self, messages, chat_template=None, add_generation_prompt=True, tokenize=False) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@dataclass
class Stats:
    num_running: int = 0
    num_waiting: int = 0
    free_pages: int = 8
    total_pages: int = 8
    num_preemptions: int = 0


class ScriptedEngine:
    """Follows the Engine contract: one token (7, text "h") per request per step, ``step_time`` seconds a step.

    ``gate``: when set, a step waits for it (``stepping`` is set while a step waits), so tests can hold a step.
    """

    model_name = "scripted"
    method = "vanilla"

    def __init__(self, max_model_len: int = 64, step_time: float = 0.0, tokenizer=None) -> None:
        self.max_model_len = max_model_len
        self.step_time = step_time
        self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer()
        self.live: dict[str, tuple] = {}
        self.waiting: list[str] = []
        self.gate: threading.Event | None = None
        self.stepping = threading.Event()

    def add_request(self, request_id, prompt, params) -> None:
        if not all(isinstance(t, int) and 0 <= t < 100 for t in prompt):
            from sparsecompile.serving.outputs import RequestRejected

            raise RequestRejected("prompt token ids must be integers in [0, 100)")
        self.live[request_id] = (list(prompt), params, [])
        self.waiting.append(request_id)

    def abort_request(self, request_id) -> None:
        self.live.pop(request_id, None)
        if request_id in self.waiting:
            self.waiting.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def bind_thread(self, owner) -> None:
        self.owner = owner

    def stats(self) -> Stats:
        running = len(self.live) - len(self.waiting)
        return Stats(num_running=running, num_waiting=len(self.waiting), free_pages=8 - running)

    def chat_prompt_ids(self, messages):
        raise AssertionError("the server renders chat templates itself")

    def step(self) -> list[RequestOutput]:
        self.waiting.clear()  # admitted at the start of a step
        if self.gate is not None:
            self.stepping.set()
            self.gate.wait()
        time.sleep(self.step_time)
        outputs = []
        for request_id, (prompt, params, tokens) in list(self.live.items()):
            tokens.append(7)
            done = len(tokens) >= params.max_tokens
            outputs.append(RequestOutput(request_id, None, prompt, [CompletionOutput(
                0, "h" * len(tokens), list(tokens), "length" if done else None, None, "h", [7])], done,
                RequestMetrics(time.monotonic())))
            if done:
                del self.live[request_id]
        return outputs
