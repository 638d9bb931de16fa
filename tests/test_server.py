"""The OpenAI-compatible server (``sparsecompile.server``) over the real engine on the embedded SmolLM2, served
by uvicorn on 127.0.0.1: concurrent streaming with cancellations (text equal to the engine's alone, KV pages
back to their starting count), clear 4xx answers to bad requests, OpenAI-shaped responses, /metrics; and, with a
scripted engine that fails, the 503 path.
"""

from __future__ import annotations

import asyncio
import copy
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerThread, sse_events

from sparsecompile.server import create_app
from sparsecompile.serving.outputs import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-test"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
MAX_TOKENS = 8
MAX_MODEL_LEN = 256


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as ``{(sample name, sorted labels): value}``."""
    text = httpx.get(f"{base_url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(values: dict, name: str, **labels: str) -> float:
    return values[(f"sparsecompile_{name}", tuple(sorted(labels.items())))]


def wait_until_idle(base_url: str, free_pages: float, timeout: float = 20.0) -> dict:
    """Poll /metrics until nothing runs or waits and every KV page is free again; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        values = scrape(base_url)
        idle = (metric(values, "num_requests_running") == 0 and metric(values, "num_requests_waiting") == 0
                and metric(values, "kv_pages_free") == free_pages)
        if idle:
            return values
        assert time.monotonic() < deadline, (
            f"engine not idle after {timeout} s: running {metric(values, 'num_requests_running')}, waiting "
            f"{metric(values, 'num_requests_waiting')}, free pages {metric(values, 'kv_pages_free')} of {free_pages}")
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------ the real engine


@pytest.fixture(scope="module")
def served(smollm2):
    """One engine, the reference outputs of each prompt run alone through ``LLM.generate``, and the server."""
    from sparsecompile.llm import LLM

    model, tokenizer = smollm2  # fp32 on CPU; copied, since the engine patches its model in place
    llm = LLM(copy.deepcopy(model), method="vanilla", tokenizer=tokenizer, max_num_seqs=16,
              max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    # Each prompt alone. In a worker thread, as the server's engine thread: on a busy 2-core CPU the main thread's
    # OpenMP team spin-waits and makes these forwards ~20x slower (OMP_WAIT_POLICY=PASSIVE avoids that too).
    with ThreadPoolExecutor(1) as pool:
        refs = {p: pool.submit(llm.generate, p, greedy, use_tqdm=False).result()[0].outputs[0] for p in PROMPTS}
    engine = llm.llm_engine
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.free_pages == stats.total_pages
    with ServerThread(create_app(engine, MODEL)) as base_url:
        yield SimpleNamespace(url=base_url, refs=refs, tokenizer=engine.tokenizer, free_pages=stats.free_pages)


def test_concurrent_streams_with_cancellations(served):
    """16 greedy streaming clients, 5 of which hang up after two chunks: the others stream exactly what the engine
    generates for their prompt alone, the 5 are aborted in the engine, and every KV page comes back."""
    cancelled = {1, 4, 7, 10, 13}
    before = scrape(served.url)

    async def client(i: int) -> tuple[str, str | None, dict | None]:
        body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "temperature": 0, "stream": True,
                # a cancelled request would run ~240 steps (a minute) if it were not aborted
                "max_tokens": 240 if i in cancelled else MAX_TOKENS,
                "stream_options": {"include_usage": True}}
        if i in cancelled:
            body.pop("stream_options")
        text, reason, usage, chunks, done = "", None, None, 0, False
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                assert response.headers["content-type"].startswith("text/event-stream")
                async for line in response.aiter_lines():
                    event = next(sse_events([line]), None)
                    if event is None:
                        continue
                    if event == "[DONE]":
                        done = True
                        continue
                    assert event["object"] == "text_completion" and event["model"] == MODEL
                    if event["choices"]:
                        text += event["choices"][0]["text"]
                        reason = event["choices"][0]["finish_reason"] or reason
                        chunks += 1
                    else:
                        usage = event["usage"]
                    if i in cancelled and chunks == 2:
                        return text, None, None  # leaving both contexts closes the connection mid-stream
        assert done, f"client {i}: stream ended without data: [DONE]"
        return text, reason, usage

    async def run_all():
        return await asyncio.gather(*(client(i) for i in range(16)))

    results = asyncio.run(run_all())
    for i, (text, reason, usage) in enumerate(results):
        ref = served.refs[PROMPTS[i % len(PROMPTS)]]
        if i in cancelled:  # hung up mid-stream, after two chunks of the same greedy text
            assert text and ref.text.startswith(text), (i, text, ref.text)
            continue
        assert text == ref.text, f"client {i}: streamed {text!r}, engine alone gives {ref.text!r}"
        assert reason == ref.finish_reason
        prompt_tokens = len(served.tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids)
        assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": len(ref.token_ids),
                         "total_tokens": prompt_tokens + len(ref.token_ids)}
    after = wait_until_idle(served.url, served.free_pages)  # a cancelled request left running takes > 20 s
    aborted = metric(after, "requests_finished_total", finish_reason="abort") - \
        metric(before, "requests_finished_total", finish_reason="abort")
    assert aborted == len(cancelled)
    finished = sum(metric(after, "requests_finished_total", finish_reason=r) -
                   metric(before, "requests_finished_total", finish_reason=r) for r in ("stop", "length"))
    assert finished == 16 - len(cancelled)


def test_non_streaming_client_that_gives_up_is_aborted(served):
    before = scrape(served.url)
    body = {"model": MODEL, "prompt": PROMPTS[1], "temperature": 0, "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
    after = wait_until_idle(served.url, served.free_pages, timeout=15)
    assert metric(after, "requests_finished_total", finish_reason="abort") == \
        metric(before, "requests_finished_total", finish_reason="abort") + 1


def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(served):
    url = f"{served.url}/v1/completions"
    ok = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    long_prompt = " ".join(["word"] * (MAX_MODEL_LEN + 10))
    cases = [  # (request, status, words the message must contain)
        ({**ok, "model": "gpt-4"}, 404, ["gpt-4", "does not exist", MODEL]),
        ({**ok, "max_tokens": 0}, 400, ["max_tokens", "greater than or equal to 1"]),
        ({**ok, "prompt": long_prompt}, 400, ["prompt has", f"{MAX_MODEL_LEN} tokens"]),
        (b'{"model": "smollm2-test", "prompt": "hi",', 400, ["not valid JSON"]),
        ({**ok, "frobnicate": 1}, 400, ["unknown field", "frobnicate"]),
        ({**ok, "n": 0}, 400, ["n", "greater than or equal to 1"]),
        ({**ok, "prompt": ["a", "b"]}, 400, ["batch prompts not supported"]),
        ({**ok, "logprobs": 21}, 400, ["logprobs", "less than or equal to 20"]),
        ({**ok, "max_tokens": MAX_MODEL_LEN}, 400, [f"max_tokens={MAX_MODEL_LEN} is too large",
                                                    f"context is {MAX_MODEL_LEN} tokens", "at most"]),
        ({**ok, "min_tokens": 9}, 400, ["min_tokens must be an integer in [0, max_tokens=8]"]),
        ({**ok, "logit_bias": {"x": 1}}, 400, ["logit_bias keys must be token ids"]),
        ({**ok, "logit_bias": {"5": 101}}, 400, ["logit_bias values must be in [-100, 100]"]),
        ({**ok, "presence_penalty": 2.5}, 400, ["presence_penalty", "less than or equal to 2"]),
        ({**ok, "prompt_logprobs": 1, "stream": True}, 400, ["prompt_logprobs are not available"]),
        ({**ok, "top_p": 1.5}, 400, ["top_p", "less than or equal to 1"]),
        ({**ok, "temperature": -0.5}, 400, ["temperature"]),
        ({**ok, "stop_token_ids": [-3]}, 400, ["stop_token_ids must be token ids >= 0"]),
        ({**ok, "max_tokens": "5"}, 400, ["max_tokens", "valid integer"]),
        ({**ok, "prompt": [1, 10**9]}, 400, ["token ids must be integers"]),
    ]
    with httpx.Client(timeout=30) as http:
        for request, status, words in cases:
            if isinstance(request, bytes):
                response = http.post(url, content=request, headers={"content-type": "application/json"})
            else:
                response = http.post(url, json=request)
            assert response.status_code == status, (request, response.text)
            error = response.json()["error"]
            assert set(error) >= {"message", "type", "code"} and error["code"] == status
            for word in words:
                assert word in error["message"], (request, error)
        chat = http.post(f"{served.url}/v1/chat/completions",
                         json={"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]})
        assert chat.status_code == 400 and "role" in chat.json()["error"]["message"]
        missing = http.get(f"{served.url}/v1/nothing-here")
        assert missing.status_code == 404 and "/v1/completions" in missing.json()["error"]["message"]
        response = http.post(url, json=ok)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == served.refs[PROMPTS[0]].text
    values = wait_until_idle(served.url, served.free_pages, timeout=10)
    assert metric(values, "requests_rejected_total", status="400") >= 19


def test_openai_shaped_responses_health_models_metrics(served):
    before = scrape(served.url)
    with httpx.Client(base_url=served.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]

        prompt = PROMPTS[2]
        ref = served.refs[prompt]
        ids = served.tokenizer(prompt).input_ids
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "user": "u1"}
        completion = http.post("/v1/completions", json=body).json()
        assert completion["object"] == "text_completion" and completion["id"].startswith("cmpl-")
        assert completion["model"] == MODEL and isinstance(completion["created"], int)
        choice = completion["choices"][0]
        assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
        assert completion["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(ref.token_ids),
                                       "total_tokens": len(ids) + len(ref.token_ids)}
        # The same prompt as token ids, and a stop string taken from the middle of the reference text.
        by_ids = http.post("/v1/completions", json={**body, "prompt": ids}).json()
        assert by_ids["choices"][0]["text"] == ref.text
        stop = ref.text.strip()[2:5]
        stopped_response = http.post("/v1/completions", json={**body, "stop": stop}).json()
        stopped = stopped_response["choices"][0]
        assert stopped["text"] == ref.text[:ref.text.index(stop)] and stopped["finish_reason"] == "stop"
        assert stopped["stop_reason"] == stop

        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat_body = {"model": MODEL, "messages": messages, "max_completion_tokens": 8, "temperature": 0}
        chat = http.post("/v1/chat/completions", json=chat_body).json()
        assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
        message = chat["choices"][0]["message"]
        assert message["role"] == "assistant" and message["content"]
        rendered = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        chat_prompt_tokens = len(served.tokenizer(rendered).input_ids)
        assert chat["usage"]["prompt_tokens"] == chat_prompt_tokens
        assert chat["usage"]["total_tokens"] == chat_prompt_tokens + chat["usage"]["completion_tokens"]

        stream_body = {**chat_body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/chat/completions", json=stream_body) as response:
            events = list(sse_events(response.iter_lines()))
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert content == message["content"]
        assert chunks[-2]["choices"][0]["finish_reason"] == chat["choices"][0]["finish_reason"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == chat["usage"]

        response = http.get("/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    after = scrape(served.url)
    usages = [r["usage"] for r in (completion, by_ids, stopped_response, chat, chunks[-1])]
    for name, key in (("generation_tokens_total", "completion_tokens"), ("prompt_tokens_total", "prompt_tokens")):
        assert metric(after, name) - metric(before, name) == sum(u[key] for u in usages)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert metric(after, f"{name}_count") - metric(before, f"{name}_count") == 5
    assert metric(after, "kv_pages_total") == served.free_pages
    assert ("sparsecompile_num_preemptions_total", ()) in after


def test_vllm_sampling_options_in_openai_shapes(served):
    """n, logprobs, echo, seed, logit_bias, penalties, min_tokens and prompt_logprobs through the `openai` client,
    whose response models check the shapes; streams carry the same tokens, text and logprobs as the responses."""
    from openai import OpenAI
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    client = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = PROMPTS[0]
    ids = served.tokenizer(prompt).input_ids
    args = dict(model=MODEL, prompt=prompt, max_tokens=5, n=2, logprobs=2, echo=True, seed=5, temperature=1.0)
    sampled = client.completions.create(**args)
    assert isinstance(sampled, Completion) and [c.index for c in sampled.choices] == [0, 1]
    assert sampled.usage.completion_tokens == sum(len(c.logprobs.tokens) - len(ids) for c in sampled.choices)
    for choice in sampled.choices:
        lp = choice.logprobs
        assert choice.text.startswith(prompt) and lp.tokens[:len(ids)] == [served.tokenizer.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(1 <= len(d) <= 3 for d in lp.top_logprobs[1:])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert [c.text for c in client.completions.create(**args).choices] == [c.text for c in sampled.choices]
    assert sampled.choices[0].text != sampled.choices[1].text  # siblings sample on their own

    greedy = client.completions.create(**{**args, "temperature": 0, "n": 1},
                                       extra_body={"prompt_logprobs": 1, "repetition_penalty": 1.0})
    choice = greedy.choices[0]
    assert choice.text == prompt + served.refs[prompt].text[:len(choice.text) - len(prompt)]
    generated = choice.logprobs.token_logprobs[len(ids):]
    assert generated == [max(d.values()) for d in choice.logprobs.top_logprobs[len(ids):]]  # greedy: the top token
    prompt_lp = choice.model_extra["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(ids)
    assert [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], prompt_lp[1:])] == \
        choice.logprobs.token_logprobs[1:len(ids)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "logprobs": 2, "echo": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as response:
        chunks = [e["choices"][0] for e in sse_events(response.iter_lines()) if e != "[DONE]"]
    assert "".join(c["text"] for c in chunks) == choice.text
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert sum((c["logprobs"][key] for c in chunks), []) == getattr(choice.logprobs, key), key

    target = served.tokenizer(" Paris").input_ids[0]
    biased = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                       logit_bias={str(target): 100}, presence_penalty=0.5, frequency_penalty=0.5)
    assert biased.choices[0].text == " Paris" * 3
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logit_bias={"2": 100},
                                       extra_body={"min_tokens": 6})  # EOS (2) made certain, but masked
    assert forced.usage.completion_tokens == 6 and forced.choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2, temperature=0,
                                          logprobs=True, top_logprobs=3)
    assert isinstance(chat, ChatCompletion) and chat.choices[0].message.content == chat.choices[1].message.content
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens // 2
    for item in content:
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].token == item.token
        assert item.logprob == item.top_logprobs[0].logprob and item.bytes == list(item.token.encode())
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert text == chat.choices[0].message.content and [t.token for t in streamed] == [t.token for t in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))  # n=2 batched vs alone
    assert chunks[-1].usage.completion_tokens == len(content)


def test_cli_serve(smollm2_path, tmp_path):
    """``sparsecompile serve MODEL`` with vLLM-style flags (API key, chat template file, default seed) answers; SIGTERM
    drains it: a running stream ends with an error event and ``data: [DONE]``, and the process exits 0 without a
    traceback (SIGINT takes the same path through uvicorn)."""
    from transformers import AutoTokenizer

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "sparsecompile.cli", "serve", str(smollm2_path), "--port", str(port),
           "--dtype", "float32", "--device", "cpu", "--max-model-len", "128", "--max-num-seqs", "2",
           "--kv-cache-memory", "64MiB", "--served-model-name", "cli-model", "--api-key", "k3y",
           "--chat-template", str(template), "--seed", "3", "--log-level", "info", "--block-size", "16"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base_url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert process.poll() is None, f"sparsecompile serve exited: {process.communicate()[0][-2000:]}"
            assert time.monotonic() < deadline, "sparsecompile serve did not come up in 120 s"
            try:
                if httpx.get(f"{base_url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.25)
        assert httpx.get(f"{base_url}/v1/models").status_code == 401
        http = httpx.Client(base_url=base_url, headers={"Authorization": "Bearer k3y"}, timeout=60)
        assert http.get("/v1/models").json()["data"][0]["id"] == "cli-model"
        body = {"model": "cli-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        chat = http.post("/v1/chat/completions", json=body).json()
        assert chat["usage"]["completion_tokens"] == 2 and chat["choices"][0]["finish_reason"] == "length"
        tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
        assert chat["usage"]["prompt_tokens"] == len(tokenizer("Q: Hi\nA:", add_special_tokens=False).input_ids)
        unseeded = {"model": "cli-model", "prompt": "Once upon", "max_tokens": 6, "temperature": 1.0}
        texts = [http.post("/v1/completions", json=unseeded).json()["choices"][0]["text"] for _ in range(2)]
        # --seed 3 as in vLLM: requests without a seed take seeds 3, 4, 5, ... in arrival order (the chat took 3),
        # so a restart replays them while two requests still differ
        assert texts[0] != texts[1]
        seeded = http.post("/v1/completions", json={**unseeded, "seed": 4}).json()["choices"][0]["text"]
        assert seeded == texts[0]
        stream = {**unseeded, "max_tokens": 100, "ignore_eos": True, "stream": True}
        events = []
        with http.stream("POST", "/v1/completions", json=stream) as response:
            for event in sse_events(response.iter_lines()):
                events.append(event)
                if len(events) == 2:
                    process.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
        assert len(events) < 60
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert process.returncode == 0, output[-2000:]
    assert "serving 'cli-model' (method vanilla, max_model_len 128" in output and "(API key required)" in output
    assert "Application shutdown complete" in output and "Traceback" not in output


def test_cli_serve_flags():
    from sparsecompile.cli import build_parser

    args = build_parser().parse_args(["serve", "model-dir", "--block-size", "32", "--log-level", "debug",
                                      "--allowed-hosts", "a.example", "b.example", "--max-request-bytes", "1MiB"])
    assert (args.model_path, args.page_size, args.uvicorn_log_level) == ("model-dir", 32, "debug")
    assert args.allowed_hosts == ["a.example", "b.example"] and args.max_request_bytes == 1 << 20


# -------------------------------------------------------------------------- a scripted engine that fails


@dataclass
class _Stats:
    num_running: int = 0
    num_waiting: int = 0
    free_pages: int = 8
    total_pages: int = 8
    num_preemptions: int = 0


class FailingEngine:
    """Follows the LLMEngine contract; emits one token per request per step and raises on step ``fail_at``."""

    model_name = "scripted"
    max_model_len = 64
    tokenizer = None

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.steps, self.live = fail_at, 0, {}

    def add_request(self, request_id, prompt, params) -> None:
        if prompt == [13]:
            raise TypeError("scripted bug in add_request")
        self.live[request_id] = (list(prompt), params, [])

    def abort_request(self, request_id) -> None:
        self.live.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def bind_thread(self, owner) -> None:
        pass

    def stats(self) -> _Stats:
        return _Stats(num_running=len(self.live), free_pages=8 - len(self.live))

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("scripted device failure")
        outputs = []
        for request_id, (prompt, params, tokens) in list(self.live.items()):
            tokens.append(7)
            done = len(tokens) >= params.max_tokens
            outputs.append(RequestOutput(request_id, None, prompt, [CompletionOutput(
                0, "x" * len(tokens), list(tokens), "length" if done else None, None, "x", [7])], done,
                RequestMetrics(time.monotonic())))
            if done:
                del self.live[request_id]
        time.sleep(0.05)
        return outputs


def test_engine_failures_answer_500_503_and_health_turns_unhealthy():
    with ServerThread(create_app(FailingEngine(fail_at=4), "scripted")) as base_url, \
            httpx.Client(base_url=base_url, timeout=30) as http:
        body = {"model": "scripted", "prompt": [1, 2, 3], "max_tokens": 2}
        bug = http.post("/v1/completions", json={**body, "prompt": [13]})
        assert bug.status_code == 500 and "scripted bug in add_request" in bug.json()["error"]["message"]
        first = http.post("/v1/completions", json=body)  # steps 1-2: fine, the bug hurt only its own request
        assert first.status_code == 200 and first.json()["choices"][0]["text"] == "xx"
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 50, "stream": True}) as response:
            events = list(sse_events(response.iter_lines()))
        assert events[-1] == "[DONE]" and "scripted device failure" in events[-2]["error"]["message"]
        after = http.post("/v1/completions", json=body)
        assert after.status_code == 503 and "restart the server" in after.json()["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503 and "scripted device failure" in health.json()["error"]["message"]
