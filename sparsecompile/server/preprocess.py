"""From a raw HTTP request to engine input, before the engine sees it and off the event loop: the JSON body into a
request model (with messages that say what to send), prompts and chat messages into token ids, the length checks.

All of it runs on worker threads (:class:`Preprocessor`), so a long prompt neither stalls the engine thread (which
only ever receives token ids) nor the event loop (which keeps streaming other requests). Bodies are parsed on a
pool of their own, so a long tokenization does not hold up requests that need none (token-id prompts). Encoding
runs on one thread (fast tokenizers are not safe to encode from several threads at once, as vLLM found); it is safe
next to the engine thread's decoding, since neither changes the tokenizer's settings.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import APIError, validation_message

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

MAX_JSON_DEPTH = 32  # the API's own bodies nest 5 levels at most


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a Jinja string (it holds ``{{`` or ``{%``) or a file holding one; None = the tokenizer's."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template (no '{{{{' or '{{%' in it)")
    return path.read_text(encoding="utf-8")


def _reject_constant(name: str) -> None:
    raise ValueError(f"request body holds {name}, which is not JSON; send finite numbers")


def _depth(obj: Any) -> int:
    deepest, stack = 0, [(obj, 1)]
    while stack and deepest <= MAX_JSON_DEPTH:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def parse_json(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``; :class:`APIError` (400) naming what is wrong and what to send otherwise."""
    example = 'send a JSON object such as {"model": "...", "prompt": "..."}'
    if not raw.strip():
        raise APIError(400, f"the request body is empty; {example}")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not UTF-8 (byte {err.start} is {raw[err.start]:#04x}); send JSON "
                            "encoded as UTF-8") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, f"the request body nests too deeply to parse; {example}") from None
    except json.JSONDecodeError as err:
        raise APIError(400, f"request body is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                            f"{example}") from None
    except ValueError as err:
        raise APIError(400, str(err)) from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body is a JSON {type(obj).__name__}, not an object; {example}")
    if _depth(obj) > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels, more than any field of "
                            "this API needs")
    return obj


def check_unicode(text: str, param: str) -> None:
    """Refuse text a tokenizer cannot encode: a lone UTF-16 surrogate (JSON ``"\\ud800"`` without its pair)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"{param} is not valid Unicode: it holds a lone surrogate ({text[err.start]!r}) at "
                            f"character {err.start}; send UTF-8 text (in JSON, \\u escapes of surrogates come in "
                            "pairs)", param=param) from None


class Preprocessor:
    """Parses, tokenizes and checks requests on its own worker thread (see the module docstring).

    Args:
        tokenizer: the engine's tokenizer (None: token-id prompts only).
        max_model_len: the engine's context length (prompt + output).
        chat_template: a Jinja chat template replacing the tokenizer's, or None.
    """

    def __init__(self, tokenizer: Any, max_model_len: int, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self._parse_pool = ThreadPoolExecutor(2, thread_name_prefix="sparsecompile-parse")
        self._token_pool = ThreadPoolExecutor(1, thread_name_prefix="sparsecompile-tokenizer")

    async def _run(self, fn: Callable[[], T], pool: ThreadPoolExecutor | None = None) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool or self._token_pool, fn)

    def close(self) -> None:
        for pool in (self._parse_pool, self._token_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------ body
    async def parse(self, raw: bytes, content_type: str | None, model: type[M]) -> M:
        """The request model of a JSON body; 415 for a body declared as something else, 400 for a bad one."""
        media = content_type.split(";")[0].strip().lower() if content_type else None
        if media is not None and media != "application/json" and not media.endswith("+json"):
            raise APIError(415, f"Content-Type {content_type!r} is not JSON; send the body as JSON with the header "
                                "'Content-Type: application/json'")

        def parse() -> M:
            try:
                return model.model_validate(parse_json(raw))
            except ValidationError as err:
                message, param = validation_message(err.errors())
                raise APIError(400, message, param) from None

        return await self._run(parse, self._parse_pool)

    # ------------------------------------------------------------------------------------------ tokens
    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"this server's engine has no tokenizer, so {what}; send the prompt as token ids")
        return self.tokenizer

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt (text is tokenized as the engine would, special tokens added)."""
        if not isinstance(prompt, str):
            return list(prompt)
        check_unicode(prompt, "prompt")
        tokenizer = self._need_tokenizer("it cannot read text prompts")

        def encode() -> list[int]:
            try:
                return list(tokenizer(prompt).input_ids)
            except Exception as err:  # noqa: BLE001 - whatever the tokenizer refuses is the request's fault
                raise APIError(400, f"the tokenizer cannot encode this prompt: {err}", param="prompt") from None

        return await self._run(encode)

    async def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered by the chat template, the assistant's turn opened (no special tokens
        added again: the template holds the ones the model expects)."""
        for i, message in enumerate(messages):
            for key, value in message.items():
                check_unicode(value, f"messages.{i}.{key}")
        tokenizer = self._need_tokenizer("it cannot render chat messages")
        if self.chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise APIError(400, "the tokenizer has no chat template; send a raw prompt (/v1/completions) instead, or "
                                "start the server with --chat-template")

        def render() -> list[int]:
            try:
                text = tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                                     add_generation_prompt=True, tokenize=False)
                return list(tokenizer(text, add_special_tokens=False).input_ids)
            except Exception as err:  # noqa: BLE001 - the template refused these messages (e.g. role order)
                raise APIError(400, f"the model's chat template cannot render these messages: {err}",
                               param="messages") from None

        return await self._run(render)

    async def decode(self, ids: list[int]) -> str:
        tokenizer = self._need_tokenizer("it cannot echo a token-id prompt as text")
        return await self._run(lambda: tokenizer.decode(ids, skip_special_tokens=False))

    # ------------------------------------------------------------------------------------------ lengths
    def max_tokens(self, prompt_len: int, requested: int | None, param: str = "max_tokens") -> int:
        """The tokens a request may generate: ``requested``, or all the context leaves when None. 400 (as vLLM) when
        the prompt fills the context or ``requested`` does not fit next to it, never a silent cap."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the model's context is {limit} tokens, leaving "
                                f"no room to generate (shorten the prompt to < {limit})")
        room = limit - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise APIError(400, f"{param}={requested} is too large: the model's context is {limit} tokens and the "
                                f"prompt has {prompt_len}, so at most {room} tokens can be generated; lower {param} or "
                                "shorten the prompt", param=param)
        return requested
