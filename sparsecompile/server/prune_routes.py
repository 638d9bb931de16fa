"""HTTP routes of interval pruning (``serving/prune.py``): ``POST /v1/prefix_cache/prune`` and
``GET /v1/prefix_cache/prune/{prune_id}``.

The POST names the idle state by ``chain_id``, by ``token_ids``, or by a chat request (``messages``, rendered with
the server's chat template, the assistant turn opened, as a chat completion would be); it answers 202 with the
``prune_id`` and the status so far. The prune runs on the engine thread between steps: ``completed`` (entries
removed, pages freed), ``blocked`` (the state is in use by a running request: it runs as soon as that request
finishes) or ``failed`` with the reason (nothing changed). The GET reports the latest status.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from ..serving.prune import PruneSpec
from .async_engine import AsyncEngine
from .protocol import ChatMessage


class PruneRequest(BaseModel):
    """Body of ``POST /v1/prefix_cache/prune``: exactly one of ``chain_id``, ``token_ids``, ``messages``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    chain_id: StrictStr | None = Field(None, min_length=1)
    token_ids: list[StrictInt] | None = None
    messages: list[ChatMessage] | None = None
    ranges: list[Annotated[list[StrictInt], Field(min_length=2, max_length=2)]] = Field(min_length=1)
    keep_tokens: StrictInt = Field(ge=0)
    policy: Literal["kvzip", "snapkv"] = "kvzip"

    @model_validator(mode="after")
    def _one_target(self) -> PruneRequest:
        given = [x is not None for x in (self.chain_id, self.token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("name the state to prune with exactly one of chain_id, token_ids or messages")
        return self


def add_prune_routes(app: FastAPI, bridge: AsyncEngine) -> None:
    """Register the prune routes on ``app``; errors use the app's OpenAI-style handlers."""

    @app.post("/v1/prefix_cache/prune", status_code=202)
    async def submit(body: PruneRequest) -> JSONResponse:
        messages = [m.as_template_input() for m in body.messages] if body.messages is not None else None

        def run(engine):
            tokens = body.token_ids
            if messages is not None:
                tokens = engine.chat_prompt_ids(messages)
            spec = PruneSpec([tuple(r) for r in body.ranges], body.keep_tokens, body.policy, chain_id=body.chain_id,
                             token_ids=None if tokens is None else list(tokens))
            return asdict(engine.submit_prune(spec))

        return JSONResponse(await bridge.run_on_engine_thread(run), status_code=202)

    @app.get("/v1/prefix_cache/prune/{prune_id}")
    async def status(prune_id: str) -> JSONResponse:
        record = await bridge.run_on_engine_thread(lambda engine: engine.prune_status(prune_id))
        if record is None:
            return JSONResponse({"error": {"message": f"no prune {prune_id!r} (unknown, or forgotten: the server keeps "
                                                      "the latest 1024)", "type": "not_found_error", "param": None,
                                           "code": 404}}, status_code=404)
        return JSONResponse(asdict(record))
