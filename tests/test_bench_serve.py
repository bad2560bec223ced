"""bench/serve.py loses no request to a server that refuses some at first (llama-server lost 8 of
32 at concurrency 8), and counts what it could not save: against a real aiohttp server on
127.0.0.1 that answers each prompt's first try with a 503, drops the second's connection before
answering, and streams the third."""

from __future__ import annotations

import collections
import importlib.util
import json
import pathlib
import sys

from aiohttp import web

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
serve = importlib.util.module_from_spec(_spec)
sys.modules["bench_serve"] = serve  # its dataclasses look their module up while the class is built
_spec.loader.exec_module(serve)
serve.RETRY_BACKOFF_S = 0.01  # the tries here are refused on purpose: no need to wait for a server to recover

OUT_LEN = 4


async def _flaky_server(cut_after_first_token: set[int] = frozenset()):
    tries: collections.Counter = collections.Counter()

    async def models(request):
        return web.json_response({"data": [{"id": "flaky"}]})

    async def completions(request):
        body = await request.json()
        key = tuple(body["prompt"])
        tries[key] += 1
        if tries[key] == 1:
            return web.json_response({"error": {"message": "no slot"}}, status=503)
        if tries[key] == 2:
            request.transport.close()  # gone before the answer, as a server that drops a connection
            return web.Response()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await resp.write(b"data: " + json.dumps({"choices": [{"text": f"t{i}"}]}).encode() + b"\n\n")
            if len(body["prompt"]) in cut_after_first_token:
                request.transport.close()
                return resp
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", tries


def _args(*extra: str):
    return serve.parse_args(["--num-prompts", "12", "--max-concurrency", "4", "--random-input-len", "12",
                             "--random-output-len", str(OUT_LEN), "--vocab-size", "1000", *extra])


async def test_refused_tries_are_tried_again_and_nothing_is_lost():
    runner, url, tries = await _flaky_server()
    try:
        summary = await serve.run(_args(), url)
    finally:
        await runner.cleanup()
    assert summary["completed"] == 12 and summary["failed"] == 0 and summary["errors"] == []
    assert summary["retried"] == 12 and summary["total_output_tokens"] == 12 * OUT_LEN
    assert all(r["attempts"] == 3 for r in summary["requests"])


async def test_what_cannot_be_saved_is_counted_not_hidden():
    # Two tries are not enough for any request (the warm-up, 8 tokens of the first prompt, is not
    # counted); a stream cut after its first token is never tried again.
    runner, url, tries = await _flaky_server()
    try:
        summary = await serve.run(_args("--max-attempts", "2"), url)
    finally:
        await runner.cleanup()
    assert summary["completed"] == 0 and summary["failed"] == 12
    assert any("ServerDisconnected" in e or "ClientOSError" in e for e in summary["errors"])

    runner, url, tries = await _flaky_server(cut_after_first_token={12})
    try:
        summary = await serve.run(_args("--random-range-ratio", "0"), url)
    finally:
        await runner.cleanup()
    assert summary["failed"] == 12 and summary["completed"] == 0
    assert all(r["attempts"] == 3 for r in summary["requests"])  # refused twice, then cut: not tried a 4th time
