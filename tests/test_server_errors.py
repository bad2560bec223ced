"""An unexpected error in a handler still answers in OpenAI's error shape, never a text/plain 500."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from kvserve.runtime.server.app import ServerConfig, build_app


async def test_unexpected_handler_error_is_a_json_500_with_the_request_id():
    app = build_app(ServerConfig(served_model_names=["tiny"]))

    async def broken(request):
        raise RuntimeError("a bug")

    app.router.add_get("/broken", broken)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/broken", headers={"X-Request-Id": "abc-1"}) as r:
                body = await r.json()
                assert r.status == 500 and r.headers["X-Request-Id"] == "abc-1"
            assert body["error"]["type"] == "server_error"
            assert "abc-1" in body["error"]["message"] and "a bug" not in body["error"]["message"]
            async with http.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status in (200, 503)  # still answering (503: no engine loaded here)
    finally:
        await runner.cleanup()
