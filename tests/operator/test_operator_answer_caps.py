"""The operator reads agents' /v1/signals and routers' /router/demand with a byte cap: a pod that
answers with an endless or huge body is refused without the operator buffering it (real aiohttp
servers on 127.0.0.1, the operator's real sources)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from kvserve.operator.sources import AgentSource, RouterDemandSource, read_capped

pytestmark = pytest.mark.timeout(60)

CAP = 256 * 1024
SIGNALS = {"kv_cache_utilization": 0.25, "queue_depth": 1, "requests_running": 2, "stale": False,
           "engine_up": True, "ready": True}


class Pods:
    """One server whose answers the test picks per path; it counts what it managed to send."""

    def __init__(self):
        self.sent = 0
        self.closed_early = False
        self.mode = "ok"

    async def handler(self, request: web.Request) -> web.StreamResponse:
        if self.mode == "ok":
            body = SIGNALS if request.path == "/v1/signals" else {"held": 0, "idle_seconds": 1.0}
            return web.json_response(body)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        if self.mode == "declared-huge":
            response.content_length = 10 * 1024**3
        else:
            response.enable_chunked_encoding()
        await response.prepare(request)
        chunk = b" " * 65536
        try:
            await response.write(b"{\"pad\": \"")
            while True:  # endless: only the client hanging up ends it
                await response.write(chunk)
                self.sent += len(chunk)
                if self.mode == "declared-huge":
                    await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError, RuntimeError):
            self.closed_early = True
            raise
        return response


@pytest.fixture
async def pods():
    state = Pods()
    app = web.Application()
    app.router.add_get("/{tail:.*}", state.handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.port = site._server.sockets[0].getsockname()[1]
    yield state
    await runner.cleanup()


def pod(name: str = "p-0") -> dict:
    return {"metadata": {"name": name},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


async def test_a_normal_answer_is_read(pods):
    source = AgentSource(port=pods.port, timeout=5, max_answer_bytes=CAP)
    errors: dict = {}
    (signals,) = await source.scrape("default", "tiny", [pod()], errors)
    await source.close()
    assert errors == {} and not signals.stale and signals.kv_cache_utilization == 0.25


@pytest.mark.parametrize("mode", ["endless", "declared-huge"])
async def test_an_oversized_signals_answer_is_refused_unread(pods, mode):
    pods.mode = mode
    source = AgentSource(port=pods.port, timeout=20, max_answer_bytes=CAP)
    errors: dict = {}
    started = time.monotonic()
    (signals,) = await source.scrape("default", "tiny", [pod()], errors)
    await source.close()
    # Refused at once (not after the 20 s timeout), as a stale pod the autoscaler never scales down on.
    assert time.monotonic() - started < 10
    assert signals.stale and signals.ready
    assert f"over the {CAP}-byte limit" in errors["p-0"]
    if mode == "declared-huge":
        assert pods.sent <= 65536  # the declared length alone was enough to refuse it


async def test_an_endless_router_demand_answer_is_refused(pods):
    pods.mode = "endless"
    source = RouterDemandSource(port=pods.port, timeout=20, max_answer_bytes=CAP)
    errors: dict = {}
    started = time.monotonic()
    demand = await source.scrape([pod("router-0")], errors)
    await source.close()
    assert time.monotonic() - started < 10
    assert f"over the {CAP}-byte limit" in errors["router-0"]
    assert demand.held == 0


async def test_read_capped_takes_an_answer_of_exactly_the_limit(pods):
    import aiohttp

    body = json.dumps({"x": "y" * 100}).encode()
    app = web.Application()
    app.router.add_get("/", lambda r: web.Response(body=body, content_type="application/json"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/") as r:
                assert await read_capped(r, len(body)) == body
            async with session.get(f"http://127.0.0.1:{port}/") as r:
                with pytest.raises(ValueError, match=f"over the {len(body) - 1}-byte limit"):
                    await read_capped(r, len(body) - 1)
    finally:
        await runner.cleanup()
