"""Admission limits, the agent beside a live runtime, drain via the agent, and SIGTERM drain."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
from server_helpers import http, idle, m, wait_until

from kvserve.runtime.agent.app import AgentConfig, build_app
from kvserve.runtime.server.main import ServerThread


def _start_server(model, *extra) -> ServerThread:
    srv = ServerThread([str(model), "--served-model-name", "tiny", "--port", "0", "--num-kv-blocks", "256",
                        "--drain-timeout", "10", *extra])
    srv.start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
    return srv


def _open_stream(url: str, body: dict) -> socket.socket:
    """Starts a streaming request on a raw socket; returns once admitted (response headers sent)."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(65536)
    assert got.startswith(b"HTTP/1.1 200"), got
    return sock


LONG = {"model": "tiny", "prompt": "A long story:", "max_tokens": 1500, "stream": True, "ignore_eos": True}


def test_queue_full_gets_429_with_retry_after(tiny_llama):
    srv = _start_server(tiny_llama, "--max-num-seqs", "1", "--max-queue-len", "1")
    try:
        socks = [_open_stream(srv.url, LONG), _open_stream(srv.url, LONG)]
        s, h, body = http(srv.url, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
        err = json.loads(body)["error"]
        assert s == 429 and h["retry-after"] == "1"
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        for sock in socks:
            sock.close()
        idle(srv.url)
        s, _, _ = http(srv.url, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert s == 200
        s, _, _ = http(srv.url, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1, "n": 3})
        assert s == 400  # 3 sequences never fit in 1 running + 1 queued: retrying cannot help
    finally:
        assert srv.stop() == 0


async def test_agent_standardizes_live_kvserve_and_drains_it(tiny_llama):
    srv = _start_server(tiny_llama, "--admin-api-key", "admin-key-for-tests")
    runner = None
    try:
        for _ in range(2):
            s, _, _ = http(srv.url, "POST", "/v1/completions",
                           {"model": "tiny", "prompt": [3, 4, 5, 6], "max_tokens": 4, "ignore_eos": True})
            assert s == 200
        runtime = idle(srv.url)

        from aiohttp import web
        app = build_app(AgentConfig(engine_url=srv.url, interval_s=0.1, admin_api_key="admin-key-for-tests"))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        agent = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        async with aiohttp.ClientSession() as client:
            async def signals():
                async with client.get(agent + "/v1/signals") as r:
                    return await r.json()

            deadline = time.monotonic() + 10
            while (sig := await signals())["stale"]:
                assert time.monotonic() < deadline
                await __import__("asyncio").sleep(0.05)
            assert sig["engine"] == "kvserve" and sig["ready"] is True and sig["model_name"] == "tiny"
            assert sig["kv_cache_capacity_tokens"] == 256 * 16 and sig["tensor_parallel_size"] == 1
            assert sig["kv_cache_utilization"] == 0 and sig["queue_depth"] == 0 and sig["requests_running"] == 0
            assert sig["prompt_tokens_total"] == m(runtime, "vllm:prompt_tokens_total") == 8
            assert sig["generation_tokens_total"] == m(runtime, "vllm:generation_tokens_total") == 8
            async with client.get(agent + "/ready") as r:
                assert r.status == 200

            # preStop: drain through the agent while a stream is in flight.
            body = dict(LONG, max_tokens=60)
            async with client.post(srv.url + "/v1/completions", json=body) as stream:
                first = await stream.content.readline()
                assert first.startswith(b"data: ")
                admin = {"Authorization": "Bearer admin-key-for-tests"}
                drain = __import__("asyncio").create_task(
                    client.post(agent + "/drain", params={"timeout": "30"}, headers=admin))
                await __import__("asyncio").sleep(0.1)
                assert http(srv.url, "GET", "/ready")[0] == 503
                s, _, b = http(srv.url, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"})
                assert s == 503 and json.loads(b)["error"]["type"] == "service_unavailable_error"
                rest = await stream.content.read()
            assert rest.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in rest
            resp = await drain
            result = await resp.json()
            assert result["drained"] is True and result["engine"] == "kvserve"
            async with client.get(agent + "/ready") as r:
                assert r.status == 503
    finally:
        if runner is not None:
            await runner.cleanup()
        assert srv.stop() == 0


def test_sigterm_drains_in_flight_stream_and_exits_0(tiny_llama):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.runtime.cli", "serve", str(tiny_llama), "--port", "0",
         "--served-model-name", "tiny", "--num-kv-blocks", "256", "--drain-timeout", "60"],
        stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log: list[str] = []
    port = threading.Event()

    def pump():
        for line in proc.stderr:
            log.append(line)
            if (mm := re.search(r"listening on http://[\d.]+:(\d+)", line)):
                port.url = f"http://127.0.0.1:{mm.group(1)}"
                port.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert port.wait(60), "".join(log)
        url = port.url
        wait_until(lambda: http(url, "GET", "/ready")[0] == 200, timeout=120)
        sock = _open_stream(url, dict(LONG, max_tokens=100, stream_options={"include_usage": True}))
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: http(url, "GET", "/ready")[0] == 503)
        s, _, _ = http(url, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"})
        assert s == 503
        got = b""
        while not got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # chunked framing around SSE
            chunk = sock.recv(65536)
            assert chunk, "stream cut before [DONE]"
            got += chunk
        sock.close()
        assert b'"finish_reason":"length"' in got and b'"completion_tokens":100' in got
        assert proc.wait(30) == 0, "".join(log)
        assert any("draining" in line for line in log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_timeout_aborts_leftovers_cleanly(tiny_llama):
    """Past --drain-timeout the in-flight stream ends with finish_reason "abort" and [DONE]."""
    srv = ServerThread([str(tiny_llama), "--port", "0", "--num-kv-blocks", "256", "--drain-timeout", "0.3"])
    srv.start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
    sock = _open_stream(srv.url, dict(LONG, model=None, max_tokens=2000))
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    got = b""
    sock.settimeout(30)
    while not got.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    sock.close()
    stopper.join(30)
    assert b'"finish_reason":"abort"' in got and b"data: [DONE]" in got
    assert srv.exit_code == 0


def test_ready_503_while_loading_and_exit_1_when_load_fails(tiny_llama):
    from kvserve.runtime.engine import LLMEngine

    gate = threading.Event()

    def slow_load():
        gate.wait(30)
        return LLMEngine.from_args(model=str(tiny_llama), num_kv_blocks=64)

    srv = ServerThread([str(tiny_llama), "--port", "0"], engine_factory=slow_load).start()
    try:
        # Loading: alive, but neither healthy (vLLM's meaning) nor ready.
        s, h, body = http(srv.url, "GET", "/live")
        assert s == 200 and json.loads(body)["status"] == "loading"
        s, h, body = http(srv.url, "GET", "/health")
        assert s == 503 and json.loads(body)["status"] == "loading" and h["retry-after"]
        s, h, body = http(srv.url, "GET", "/ready")
        assert s == 503 and json.loads(body)["status"] == "loading"
        s, h, body = http(srv.url, "POST", "/v1/completions", {"prompt": "x"})
        assert s == 503 and "loading" in json.loads(body)["error"]["message"] and h["retry-after"]
        gate.set()
        # A client that waits on /health (as vLLM's users do) gets served on its first request.
        wait_until(lambda: http(srv.url, "GET", "/health")[0] == 200, timeout=60)
        assert http(srv.url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200
        assert http(srv.url, "GET", "/ready")[0] == 200 and http(srv.url, "GET", "/live")[0] == 200
    finally:
        gate.set()
        assert srv.stop() == 0

    def broken():
        raise ValueError("max_model_len: 99999 exceeds the model's 2048")

    bad = ServerThread([str(tiny_llama), "--port", "0"], engine_factory=broken).start()
    bad._thread.join(30)
    assert bad.exit_code == 1


async def test_health_live_and_ready_through_each_state():
    """/live: alive (restart only when it can never serve); /health: vLLM's "can serve";
    /ready: "send me traffic" (not while draining)."""
    import types

    import aiohttp
    from aiohttp import web

    from kvserve.runtime.server.app import STATE, ServerConfig, build_app

    app = build_app(ServerConfig(served_model_names=["m"]))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    state = app[STATE]

    async def codes() -> tuple[int, int, int]:
        async with aiohttp.ClientSession() as http:
            out = []
            for route in ("/live", "/health", "/ready"):
                async with http.get(url + route) as r:
                    out.append(r.status)
            return tuple(out)

    try:
        assert await codes() == (200, 503, 503)  # loading
        state.engine = types.SimpleNamespace(dead=None)
        assert await codes() == (200, 200, 200)  # serving
        state.draining = True
        assert await codes() == (200, 200, 503)  # draining: healthy, takes no new traffic
        state.retired = True
        assert await codes() == (503, 503, 503)  # an admin drain is over: restart it
        state.retired = False
        state.engine.dead = RuntimeError("rank 1 exited")
        assert await codes() == (500, 500, 503)  # dead engine: restart it
        state.engine, state.draining, state.load_error = None, False, "ValueError: bad config"
        assert await codes() == (500, 500, 503)  # load failed
    finally:
        await runner.cleanup()
