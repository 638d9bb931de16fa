"""The OpenAI server carries ``chain_id`` through (an extra request field, echoed in the response) and /metrics counts
chain hits, misses by reason, suffix tokens and the prefix cache; ``/v1/prefix_cache/prune`` prunes idle chains
(completed, failed with the reason, blocked until the chain is idle). Tiny model, in-process ASGI client."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families
from test_llm import DigitTokenizer, prompts_of
from tiny_models import tiny_pair

from sparsecompile import LLM, SamplingParams
from sparsecompile.server import create_app


def test_chain_id_round_trip_and_metrics():
    _, model = tiny_pair()
    llm = LLM(model, "snapkv", tokenizer=DigitTokenizer(), budget=20, window=4, page_size=4, prefill_chunk_size=16,
              max_num_seqs=4, max_num_batched_tokens=24, model_name="tiny")
    app = create_app(llm.llm_engine)
    first, extra = prompts_of([30, 6], seed=4)

    async def run() -> tuple[list[dict], dict[str, dict]]:
        transport = httpx.ASGITransport(app=app)
        bodies = []
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            prompt = first
            for _ in range(2):
                response = await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "chain_id": "session-1"})
                assert response.status_code == 200, response.text
                bodies.append(response.json())
                prompt = prompt + [int(t) for t in bodies[-1]["choices"][0]["text"].split()] + extra
            bad = await client.post("/v1/completions", json={"model": "tiny", "prompt": first, "chain_id": ""})
            assert bad.status_code == 400 and "chain_id" in bad.json()["error"]["message"]
            await asyncio.sleep(0.05)  # the engine thread's stats snapshot follows the last step
            metrics = (await client.get("/metrics")).text
        app.state.async_engine.shutdown()
        samples = {}
        for family in text_string_to_metric_families(metrics):
            for sample in family.samples:
                samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        return bodies, samples

    bodies, samples = asyncio.run(run())
    assert [b["chain_id"] for b in bodies] == ["session-1", "session-1"]
    assert samples["sparsecompile_chain_hits_total"][()] == 1
    assert samples["sparsecompile_chain_misses_total"][(("reason", "unknown_chain"),)] == 1
    assert samples["sparsecompile_chain_misses_total"][(("reason", "prefix_mismatch"),)] == 0
    assert samples["sparsecompile_chain_suffix_tokens_total"][()] == 1 + len(extra)
    assert samples["sparsecompile_idle_chains"][()] == 1 and samples["sparsecompile_kv_pages_reclaimable"][()] > 0
    assert samples["sparsecompile_prefix_cache_hits_total"][()] == 0


def test_prune_endpoint_runs_blocks_and_reports():
    _, model = tiny_pair()
    llm = LLM(model, "snapkv", tokenizer=DigitTokenizer(), budget=64, window=4, page_size=4, prefill_chunk_size=16,
              max_num_seqs=4, max_num_batched_tokens=24, model_name="tiny")
    engine = llm.llm_engine
    app = create_app(engine)
    prompt = prompts_of([40], seed=5)[0]

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            first = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                                               "temperature": 0, "chain_id": "s"})
            tokens = prompt + [int(t) for t in first.json()["choices"][0]["text"].split()]
            done = await client.post("/v1/prefix_cache/prune", json={"token_ids": tokens, "ranges": [[8, 24]],
                                                                     "keep_tokens": 4, "policy": "snapkv"})
            assert done.status_code == 202 and done.json()["status"] == "completed", done.text
            assert done.json()["removed_entries"] == 2 * 2 * 12
            status = await client.get(f"/v1/prefix_cache/prune/{done.json()['prune_id']}")
            assert status.status_code == 200 and status.json()["status"] == "completed"
            bad = await client.post("/v1/prefix_cache/prune", json={"chain_id": "s", "ranges": [[8, 10]],
                                                                    "keep_tokens": 1})
            assert bad.status_code == 202 and bad.json()["status"] == "failed"
            assert "page-aligned" in bad.json()["reason"]
            invalid = await client.post("/v1/prefix_cache/prune", json={"ranges": [[8, 16]], "keep_tokens": 1})
            assert invalid.status_code == 400 and "exactly one of" in invalid.json()["error"]["message"]
            missing = await client.get("/v1/prefix_cache/prune/prune-999")
            assert missing.status_code == 404
            # a prune of a chain in use waits for it, then runs
            stream = await app.state.async_engine.add_request("busy", tokens + [5] * 20,
                                                              SamplingParams(temperature=0, max_tokens=30),
                                                              chain_id="s")
            blocked = await client.post("/v1/prefix_cache/prune", json={"chain_id": "s", "ranges": [[24, 32]],
                                                                        "keep_tokens": 0})
            assert blocked.json()["status"] == "blocked", blocked.text
            async for _ in stream:
                pass
            later = await client.get(f"/v1/prefix_cache/prune/{blocked.json()['prune_id']}")
            assert later.json()["status"] == "completed" and later.json()["removed_entries"] == 2 * 2 * 8
        app.state.async_engine.shutdown()

    asyncio.run(run())
