"""The router forwards only what it must, and nothing a client sends grows its memory without bound.

A real router (`build_app`, served by aiohttp on 127.0.0.1) in front of a small real aiohttp app
standing in for a pod: it records every path it receives, so a test can say what never reached a
pod. Requests go out as raw HTTP over a socket, because aiohttp's and the openai client's URL
handling would normalise the very paths under test. The memory attack runs a `kvserve router`
process and reads its peak RSS from /proc.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest
from aiohttp import web

from kvserve.runtime.router.app import RouterConfig, build_app
from kvserve.runtime.router.endpoints import Endpoint, StaticEndpoints
from kvserve.runtime.router.metrics import RETIRED_KEPT
from kvserve.runtime.router.policy import PolicyConfig

pytestmark = pytest.mark.timeout(60)

KEY = "user-key-123"


class Pod:
    """A stand-in runtime: answers the routes a runtime serves, and `POST /drain` (an admin route
    no user may reach through the router), and records every request line it gets."""

    def __init__(self, answers: dict[str, tuple[int, bytes]] | None = None):
        self.seen: list[tuple[str, str, str | None]] = []  # (method, raw path, Authorization)
        self.answers = answers or {}  # path -> (status, body) instead of the usual answer
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Pod:
        async def any_route(request: web.Request) -> web.Response:
            await request.read()
            self.seen.append((request.method, request.raw_path, request.headers.get("Authorization")))
            if request.path in self.answers:
                status, body = self.answers[request.path]
                return web.Response(status=status, body=body, content_type="application/json")
            if request.path == "/v1/models":
                return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model",
                                                                      "created": 0, "owned_by": "kvserve"}]})
            if request.path == "/v1/completions":
                return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": 0,
                                          "model": "tiny", "choices": [{"index": 0, "text": " Paris",
                                                                        "finish_reason": "stop", "logprobs": None}]})
            return web.json_response({"path": request.raw_path})

        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", any_route)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_router(config: RouterConfig, endpoints: list[Endpoint]) -> tuple[web.AppRunner, int]:
    # handler_cancellation as `kvserve router` runs it: a client that leaves cancels its handler.
    runner = web.AppRunner(build_app(config, StaticEndpoints(endpoints)), shutdown_timeout=0.1,
                           handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    await asyncio.sleep(0.05)  # the endpoint source publishes its list
    return runner, site._server.sockets[0].getsockname()[1]


@pytest.fixture
async def pod():
    p = await Pod().start()
    yield p
    await p.stop()


async def raw_request(port: int, method: str, target: str, *, body: bytes = b"", headers: dict | None = None,
                      send_body: bool = True, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """One request exactly as written (no URL normalisation), `Connection: close`; the answer's
    status, headers and body. With `send_body=False` only the headers go out: an answer then
    proves the server decided without reading the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = {"Host": "router", "Connection": "close", "Content-Type": "application/json",
            "Content-Length": str(len(body)), **(headers or {})}
    head = {k: v for k, v in head.items() if v is not None}
    writer.write(f"{method} {target} HTTP/1.1\r\n".encode()
                 + b"".join(f"{k}: {v}\r\n".encode() for k, v in head.items()) + b"\r\n")
    if send_body and body:
        writer.write(body)
    await writer.drain()
    try:
        status_line = await asyncio.wait_for(reader.readline(), timeout)
        headers_out: dict[str, str] = {}
        while (line := await asyncio.wait_for(reader.readline(), timeout)) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers_out[k.strip().lower()] = v.strip()
        length = int(headers_out.get("content-length", "0"))
        data = await asyncio.wait_for(reader.readexactly(length), timeout) if length else b""
    finally:
        writer.close()
    return int(status_line.split()[1]), headers_out, data


def openai_error(data: bytes) -> dict:
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# --- the allowlist -------------------------------------------------------------------------------

TRAVERSALS = [
    "/v1/../drain", "/v1/%2e%2e/drain", "/v1/%2E%2E/drain", "/v1/.%2e/drain", "/v1/%2e./drain",
    "/v1/..%2fdrain", "/v1/..%2Fdrain", "/v1/%2fdrain", "/v1/..%5cdrain", "/v1\\..\\drain",
    "/v1/chat/../../drain", "/v1/./completions", "/v1/%2e/completions", "/v1//completions",
    "//v1/completions", "/v1/completions/..", "/v1/completions/.", "/tokenize/../drain",
    "/v1/%252e%252e/drain", "/v1/completions%00", "/drain", "/admin/drain", "/v1/embeddings",
    "/v1/responses", "/metrics/../drain", "/v1/models/../../drain",
]


@pytest.mark.parametrize("target", TRAVERSALS)
async def test_paths_outside_the_allowlist_never_reach_a_pod(pod, target):
    runner, port = await start_router(RouterConfig(), [Endpoint("pod", pod.url, None)])
    try:
        status, _, data = await raw_request(port, "POST", target, body=b'{"model": "tiny", "prompt": "hi"}',
                                            headers={"Authorization": f"Bearer {KEY}"})
    finally:
        await runner.cleanup()
    assert status == 404, (target, status, data)
    error = openai_error(data)
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert "The router serves POST /v1/completions" in error["message"]
    assert pod.seen == []


async def test_allowlisted_routes_go_upstream_by_their_own_path(pod):
    runner, port = await start_router(RouterConfig(), [Endpoint("pod", pod.url, None)])
    try:
        for target in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                       "/v1/completions?next=/../drain"):
            status, headers, data = await raw_request(port, "POST", target, body=b'{"model": "tiny"}',
                                                      headers={"Authorization": f"Bearer {KEY}"})
            assert status == 200, (target, data)
        # The wrong method on a known route is a 405, not a forward.
        status, _, data = await raw_request(port, "GET", "/v1/completions")
        assert status == 405 and "POST" in openai_error(data)["message"]
        status, _, data = await raw_request(port, "GET", "/v1/models")
        assert status == 200 and json.loads(data)["data"][0]["id"] == "tiny"
    finally:
        await runner.cleanup()
    assert [p for _, p, _ in pod.seen] == ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                                           "/v1/completions", "/v1/models"]
    assert all(auth == f"Bearer {KEY}" for _, _, auth in pod.seen[:5])  # forwarded unchanged


# --- the credential ----------------------------------------------------------------------------

@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x"])
async def test_a_wrong_key_is_a_401_before_the_body_and_never_held(pod, authorization):
    config = RouterConfig(api_keys=(KEY, "second-key"))
    runner, port = await start_router(config, [])  # scaled to zero: a request would be held
    try:
        # Only the headers of an 8 MB body go out: the 401 comes without the router reading it.
        status, _, data = await raw_request(port, "POST", "/v1/completions", body=b"x" * (8 << 20),
                                            headers={"Authorization": authorization}, send_body=False)
        assert status == 401
        error = openai_error(data)
        assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
        from kvserve.runtime.router.app import ROUTER

        demand = runner.app[ROUTER].demand()
        assert demand["held"] == 0 and demand["held_total"] == 0 and demand["requests_total"] == 0
        status, _, _ = await raw_request(port, "GET", "/v1/models", headers={"Authorization": authorization})
        assert status == 401
    finally:
        await runner.cleanup()


async def expect_continue(port: int, authorization: str, length: int) -> bytes:
    """Headers with `Expect: 100-continue`, as curl sends a big body: what the router answers
    before any body byte is sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nAuthorization: {authorization}\r\n"
                 f"Content-Length: {length}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    if answer.startswith(b"HTTP/1.1 100"):
        writer.write(b"{" + b" " * (length - 2) + b"}")
        await writer.drain()
        answer += await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    size = re.search(rb"Content-Length: (\d+)", answer, re.IGNORECASE)
    answer += await asyncio.wait_for(reader.readexactly(int(size.group(1))) if size else reader.read(), 5)
    writer.close()
    return answer


async def test_expect_100_continue_is_refused_before_the_body_is_sent(pod):
    config = RouterConfig(api_keys=(KEY,), max_request_body_bytes=1 << 20)
    runner, port = await start_router(config, [Endpoint("pod", pod.url, None)])
    try:
        answer = await expect_continue(port, "Bearer wrong", 1000)
        assert answer.startswith(b"HTTP/1.1 401") and b"100 Continue" not in answer
        answer = await expect_continue(port, f"Bearer {KEY}", 2 << 20)
        assert answer.startswith(b"HTTP/1.1 413") and b"--max-request-body-bytes" in answer
        answer = await expect_continue(port, f"Bearer {KEY}", 1000)
        assert answer.startswith(b"HTTP/1.1 100 Continue") and b"HTTP/1.1 200" in answer
    finally:
        await runner.cleanup()
    assert len(pod.seen) == 1


async def test_every_configured_key_is_accepted_and_forwarded_unchanged(pod):
    runner, port = await start_router(RouterConfig(api_keys=(KEY, "second-key")), [Endpoint("pod", pod.url, None)])
    try:
        for key in (KEY, "second-key"):
            status, _, _ = await raw_request(port, "POST", "/v1/completions", body=b"{}",
                                             headers={"Authorization": f"Bearer {key}"})
            assert status == 200
    finally:
        await runner.cleanup()
    assert [auth for _, _, auth in pod.seen] == [f"Bearer {KEY}", "Bearer second-key"]


async def test_the_openai_client_with_the_key_and_without(pod):
    import openai

    runner, port = await start_router(RouterConfig(api_keys=(KEY,)), [Endpoint("pod", pod.url, None)])
    try:
        base = f"http://127.0.0.1:{port}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as client:
            reply = await client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=2)
            assert reply.choices[0].text == " Paris"
            assert [m.id async for m in client.models.list()] == ["tiny"]
        async with openai.AsyncOpenAI(base_url=base, api_key="not-the-key", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as denied:
                await client.completions.create(model="tiny", prompt="hi", max_tokens=2)
            assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
    finally:
        await runner.cleanup()
    assert len(pod.seen) == 2  # the refused ones never reached it


async def test_what_the_router_reads_whole_from_a_pod_is_capped():
    huge = b'{"error": {"message": "' + b"x" * (2 << 20) + b'"}}'
    pod = await Pod({"/v1/completions": (503, huge), "/v1/models": (200, huge)}).start()
    runner, port = await start_router(RouterConfig(served_model_name="tiny", max_attempts=1),
                                      [Endpoint("pod", pod.url, None)])
    try:
        status, headers, data = await raw_request(port, "POST", "/v1/completions", body=b"{}")
        assert status == 503 and len(data) < 4096 and headers["retry-after"]
        assert "more than 65536 bytes" in openai_error(data)["message"]
        status, _, data = await raw_request(port, "GET", "/v1/models")  # the pod's list is ignored
        assert status == 200 and [m["id"] for m in json.loads(data)["data"]] == ["tiny"]
    finally:
        await runner.cleanup()
        await pod.stop()


async def test_pods_that_went_away_leave_a_bounded_number_of_series(pod):
    second = await Pod().start()
    runner, port = await start_router(RouterConfig(policy=PolicyConfig(policy="round-robin")),
                                      [Endpoint("a", pod.url, None), Endpoint("b", second.url, None)])
    from kvserve.runtime.router.app import ROUTER

    try:
        for _ in range(2):
            assert (await raw_request(port, "POST", "/v1/completions", body=b"{}"))[0] == 200
        metrics = (await raw_request(port, "GET", "/metrics"))[2].decode()
        assert 'upstream="a"' in metrics and 'upstream="b"' in metrics
        router = runner.app[ROUTER]
        router.publish([Endpoint("a", pod.url, None)])
        metrics = (await raw_request(port, "GET", "/metrics"))[2].decode()
        assert 'upstream="b"' in metrics  # what a gone pod served still shows, for a while
        # Pods come and go under an autoscaler, each with a new name: 33 more gone, b's and then
        # pod-0's series go.
        for i in range(RETIRED_KEPT + 1):
            router.publish([Endpoint("a", pod.url, None), Endpoint(f"pod-{i}", second.url, None)])
            assert (await raw_request(port, "POST", "/v1/completions", body=b"{}"))[0] == 200
        router.publish([Endpoint("a", pod.url, None)])
        metrics = (await raw_request(port, "GET", "/metrics"))[2].decode()
        assert 'upstream="a"' in metrics and 'upstream="b"' not in metrics and 'upstream="pod-0"' not in metrics
        shown = set(re.findall(r'upstream="([^"]+)"', metrics))
        assert len(shown) <= RETIRED_KEPT + 1
    finally:
        await runner.cleanup()
        await second.stop()


# --- the hold queue's room, checked before the body is read -------------------------------------

async def test_held_bytes_are_checked_from_content_length_before_reading(pod):
    config = RouterConfig(max_held_bytes=1 << 20, max_request_body_bytes=4 << 20, hold_timeout_s=30)
    runner, port = await start_router(config, [])
    from kvserve.runtime.router.app import ROUTER

    router = runner.app[ROUTER]
    try:
        first = asyncio.create_task(raw_request(port, "POST", "/v1/completions", body=b"x" * (700 << 10)))
        for _ in range(100):
            if router.demand()["held"] == 1:
                break
            await asyncio.sleep(0.02)
        assert router.demand()["held"] == 1
        # A second body would pass the byte budget: refused at once, from its headers alone.
        started = time.monotonic()
        status, headers, data = await raw_request(port, "POST", "/v1/completions", body=b"x" * (700 << 10),
                                                  send_body=False)
        assert status == 503 and headers["retry-after"] and time.monotonic() - started < 2
        assert "--max-held-bytes" in openai_error(data)["message"]
        # One body over the per-request limit: 413 from its Content-Length.
        status, _, data = await raw_request(port, "POST", "/v1/completions", body=b"x" * (5 << 20),
                                            send_body=False)
        assert status == 413 and "--max-request-body-bytes" in openai_error(data)["message"]
        # Chunked (no Content-Length): counted as it streams, refused once over the budget.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")
        chunk = b"y" * (64 << 10)
        for _ in range(12):  # 768 KiB: over what the first request left
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-held-bytes" in answer
        assert router.demand()["held"] == 1
        # The pod comes back: the held request goes through, and its bytes are freed.
        router.publish([Endpoint("pod", pod.url, None)])
        status, _, _ = await asyncio.wait_for(first, 10)
        assert status == 200 and router.hold.held_bytes == 0 and router.buffered.used == 0
    finally:
        await runner.cleanup()


async def test_clients_that_leave_while_held_leave_nothing_behind():
    runner, port = await start_router(RouterConfig(hold_timeout_s=30), [])
    from kvserve.runtime.router.app import ROUTER

    router = runner.app[ROUTER]
    try:
        for _ in range(20):
            task = asyncio.create_task(raw_request(port, "POST", "/v1/completions", body=b"x" * 1000))
            for _ in range(100):
                if router.demand()["held"]:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for _ in range(100):
                if not router.demand()["held"]:
                    break
                await asyncio.sleep(0.01)
        assert router.demand()["held"] == 0 and router.hold.held_bytes == 0 and router.buffered.used == 0
        assert len(router.hold._queue) == 0  # no abandoned ticket is kept until a pod comes back
    finally:
        await runner.cleanup()


# --- the attack, against a router process ----------------------------------------------------

def peak_rss_mb(pid: int) -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def test_forty_8mb_bodies_with_a_wrong_key_do_not_grow_the_router(tmp_path, monkeypatch):
    """40 clients send 8 MB bodies with a wrong key while no pod is ready: before, the router read
    and held every body (83 MB -> 828 MB); now each gets a 401 from its headers."""
    from kvserve.testing.router_harness import Cluster, RouterProcess

    # The key comes from the environment, as on Kubernetes (a secretKeyRef).
    monkeypatch.setenv("KVSERVE_API_KEY", KEY)
    cluster = Cluster(tmp_path)
    router = None
    try:
        router = RouterProcess("--inferenceservice", "asleep", "--hold-timeout", "3", "--max-held-bytes",
                               str(32 << 20), cluster=cluster,
                               log=tmp_path / "router.log").wait_ready(0)  # no pod: requests are held
        _, baseline = peak_rss_mb(router.proc.pid)
        body = b"x" * (8 << 20)

        async def attack():
            return await asyncio.gather(*(raw_request(router.port, "POST", "/v1/completions", body=body,
                                                      headers={"Authorization": "Bearer wrong"}, timeout=30)
                                          for _ in range(40)), return_exceptions=True)

        answers = asyncio.run(attack())
        rss, peak = peak_rss_mb(router.proc.pid)
        statuses = [a[0] if isinstance(a, tuple) else type(a).__name__ for a in answers]
        print(f"router RSS: baseline peak {baseline:.0f} MB, after the attack {rss:.0f} MB, peak {peak:.0f} MB")
        demand = router.demand()
        assert demand["held_total"] == 0 and demand["requests_total"] == 0  # nothing to wake a service for
        assert all(s == 401 for s in statuses), statuses
        assert peak - baseline < 40, (baseline, peak)

        # With the key, the same bodies are held, but only as many as --max-held-bytes takes (4 of
        # 8 MB); the others get a 503 from their headers, and the held ones one when the hold ends.
        async def with_the_key():
            return await asyncio.gather(*(raw_request(router.port, "POST", "/v1/completions", body=body,
                                                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
                                          for _ in range(40)), return_exceptions=True)

        answers = asyncio.run(with_the_key())
        _, held_peak = peak_rss_mb(router.proc.pid)
        statuses = [a[0] if isinstance(a, tuple) else type(a).__name__ for a in answers]
        print(f"with the key: peak {held_peak:.0f} MB")
        assert statuses == [503] * 40 and router.demand()["held_total"] == 4
        assert held_peak - baseline < 32 + 40, (baseline, held_peak)
    finally:
        if router is not None:
            router.stop()
        cluster.stop()


def test_open_connections_are_capped(tmp_path):
    """Connections that never finish their headers cost memory and aiohttp has no cap of its own:
    past --max-connections a new one is closed at once; a slot that frees up serves again."""
    import socket

    from kvserve.testing.router_harness import RouterProcess, get_json

    router = RouterProcess("--endpoints", "http://127.0.0.1:9", "--agent-port", "-1", "--max-connections", "20",
                           log=tmp_path / "router.log").wait_ready()
    held: list[socket.socket] = []
    try:
        for _ in range(20):  # half-sent requests: the headers never end
            s = socket.create_connection(("127.0.0.1", router.port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")
            held.append(s)
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", router.port), timeout=5)
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        try:
            assert extra.recv(100) == b""  # closed without an answer
        except ConnectionResetError:
            pass
        extra.close()
        for s in held[:5]:
            s.close()
        time.sleep(0.3)
        assert get_json(router.url + "/health") == {"status": "ok"}
        assert "closing new ones" in (tmp_path / "router.log").read_text()
    finally:
        for s in held:
            s.close()
        router.stop()
    assert router.proc.returncode == 0  # SIGTERM is still a clean, graceful exit
