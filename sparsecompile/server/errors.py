"""Errors answered the way OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status."""

from __future__ import annotations

import json
from typing import Any

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error")


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind or error_type(status), "param": param, "code": status}}


def error_bytes(status: int, message: str, param: str | None = None, kind: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, param, kind)).encode()


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line per pydantic problem, e.g. ``max_tokens: Input should be greater than or equal to 1``;
    returns the message and the first field named."""
    parts, params = [], []
    for problem in errors:
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
