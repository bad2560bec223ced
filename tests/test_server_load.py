"""Load on loopback: 200 concurrent streaming clients on the tiny CPU model."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from server_helpers import http, idle, m, wait_until

from kvserve.runtime.server.main import ServerThread

CLIENTS = 200
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerThread([str(tiny_llama), "--served-model-name", "tiny", "--port", "0", "--num-kv-blocks", "512",
                        "--max-num-seqs", "256"])
    srv.start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
    yield srv.url
    assert srv.stop() == 0


async def _one(session: aiohttp.ClientSession, url: str, i: int) -> tuple[str, dict, str | None]:
    chat = i % 2 == 1
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "temperature": 0.8, "seed": i, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Request number {i}: tell me about cats."}]
    else:
        body["prompt"] = f"Request number {i}: the quick brown fox"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    text, usage, finish, done = "", None, None, False
    async with session.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: ")
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if event.get("usage"):
                usage = event["usage"]
            for c in event["choices"]:
                text += (c["delta"].get("content") or "") if chat else c["text"]
                finish = c.get("finish_reason") or finish
    assert done
    return text, usage, finish


async def test_200_concurrent_streams_complete_without_leaks(server):
    before = idle(server)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        results = await asyncio.gather(*(_one(session, server, i) for i in range(CLIENTS)))
    assert len(results) == CLIENTS
    for _text, usage, finish in results:
        assert usage["completion_tokens"] == MAX_TOKENS and finish == "length"
    after = idle(server)
    assert m(after, "vllm:kv_cache_usage_perc") == 0
    assert m(after, "vllm:request_success_total", finished_reason="length") - \
        m(before, "vllm:request_success_total", finished_reason="length") == CLIENTS
    assert m(after, "vllm:generation_tokens_total") - m(before, "vllm:generation_tokens_total") == CLIENTS * MAX_TOKENS
    assert m(after, "vllm:request_success_total", finished_reason="abort") == 0
