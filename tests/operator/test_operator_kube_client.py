"""The operator's API client (kubernetes_asyncio underneath) and its retry policy.

The policy is pure (operator/retry.py): tables and hypothesis properties. The client runs
against a scripted API server on loopback that answers each request from a list the test sets,
so every retry, Retry-After wait and give-up is observed on the wire.
"""

from __future__ import annotations

import asyncio
import json

import kopf
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from kvserve.operator.kube import APIError, KubeClient, NotOwned, apply
from kvserve.operator.retry import RetryPolicy, backoff_ceiling, handler_delay, next_delay, parse_retry_after, retryable

# --- the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("status,method,expected", [
    (None, "GET", True), (500, "GET", True), (502, "PATCH", True), (503, "DELETE", True), (504, "GET", True),
    (429, "POST", True), (409, "PATCH", True), (409, "DELETE", True), (409, "POST", False),
    (404, "GET", False), (400, "POST", False), (401, "GET", False), (403, "PATCH", False), (422, "PATCH", False),
])
def test_what_is_retried(status, method, expected):
    assert retryable(status, method) is expected


def test_retry_after_parsing():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None
    # An HTTP date: seconds from now.
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == pytest.approx(10.0)


def test_backoff_doubles_up_to_its_cap_and_handlers_wait_seconds():
    policy = RetryPolicy(base_seconds=0.1, max_backoff_seconds=1.0)
    assert [backoff_ceiling(policy, n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert backoff_ceiling(policy, 10_000) == 1.0
    assert [handler_delay(r) for r in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


@given(failures=st.integers(1, 20), elapsed=st.floats(0, 60), retry_after=st.none() | st.floats(0, 1e6),
       u=st.floats(0, 1, exclude_max=True))
def test_delay_is_bounded_jittered_and_honours_retry_after(failures, elapsed, retry_after, u):
    policy = RetryPolicy()
    delay = next_delay(policy, failures=failures, elapsed=elapsed, retry_after=retry_after, rng=lambda: u)
    if failures >= policy.attempts:
        assert delay is None
        return
    if delay is None:  # only the deadline stops it early
        assert elapsed + min(retry_after or 0, policy.max_retry_after_seconds) > policy.deadline_seconds \
            or elapsed + u * backoff_ceiling(policy, failures) > policy.deadline_seconds
        return
    assert 0 <= delay <= max(policy.max_backoff_seconds, policy.max_retry_after_seconds)
    assert elapsed + delay <= policy.deadline_seconds
    if retry_after is not None:
        assert delay >= min(retry_after, policy.max_retry_after_seconds)
    else:
        assert delay == pytest.approx(u * backoff_ceiling(policy, failures))


# --- the client on the wire ------------------------------------------------------------------


class Scripted:
    """An API server that answers from `script` (status, body, headers) in order, then does
    what it is asked. A scripted 500 on a write is a lost answer: the write still happens."""

    def __init__(self):
        self.script: list[tuple[int, dict, dict]] = []
        self.seen: list[tuple[str, str, str, dict]] = []
        self.objects: dict[str, dict] = {}

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append((request.method, request.path_qs, request.headers.get("Content-Type", ""),
                          dict(request.headers)))
        if self.script:
            status, payload, headers = self.script.pop(0)
            if status == "drop":
                request.transport.close()
                return web.Response()
            if status == 500 and request.method != "GET":
                self._store(request, body)  # the write happened; only its answer was lost
            return web.json_response(payload, status=status, headers=headers)
        return web.json_response(self._store(request, body))

    def _store(self, request: web.Request, body: bytes) -> dict | None:
        data = json.loads(body) if body else None
        if request.method == "POST":
            self.objects[data["metadata"]["name"]] = data
            return data
        name = request.path.rsplit("/", 1)[-1]
        if request.method == "PATCH":
            self.objects.setdefault(name, {}).update(data)
        if request.method == "DELETE":
            return self.objects.pop(name, None) or {}
        return self.objects.get(name, {"metadata": {"name": name}})


@pytest.fixture
async def server():
    scripted = Scripted()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", scripted.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    scripted.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    yield scripted
    await runner.cleanup()


def status(code: int, message: str = "x") -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}


def client_for(server, **kw) -> tuple[KubeClient, list[float]]:
    slept: list[float] = []
    policy = RetryPolicy(base_seconds=0.01, max_backoff_seconds=0.05, **kw)
    client = KubeClient(kopf.ConnectionInfo(server=server.url, token="secret-token"), policy=policy,
                        rng=lambda: 0.5)
    original = asyncio.sleep

    async def sleep(seconds, *a):
        slept.append(seconds)
        await original(0)

    client._sleep = sleep
    return client, slept


async def test_transient_errors_are_retried_inside_the_call(server):
    client, slept = client_for(server)
    server.script = [("drop", {}, {}), (503, status(503), {}), (500, status(500), {})]  # drop: a fresh connection
    try:
        dep = await client.get("Deployment", "ns", "web")
    finally:
        await client.close()
    assert dep == {"metadata": {"name": "web"}}
    assert [m for m, *_ in server.seen] == ["GET"] * 4
    assert server.seen[0][1] == "/apis/apps/v1/namespaces/ns/deployments/web"
    headers = server.seen[0][3]
    assert headers["User-Agent"] == "kvserve-operator" and headers["Authorization"] == "Bearer secret-token"
    # aiohttp itself re-sends an idempotent request once when the connection drops before any
    # answer; the two error answers are ours to retry.
    assert len(slept) >= 2 and client.retries == len(slept)


async def test_retry_after_is_honoured_and_capped(server):
    client, slept = client_for(server, max_retry_after_seconds=2.0)
    server.script = [(429, status(429), {"Retry-After": "1"}), (429, status(429), {"Retry-After": "3600"})]
    try:
        await client.list("Pod", "ns", {"app": "x"})
    finally:
        await client.close()
    assert slept == [1.0, 2.0]
    assert "labelSelector=app%3Dx" in server.seen[0][1] or "labelSelector=app=x" in server.seen[0][1]


async def test_give_up_after_the_attempts_with_the_last_answer(server):
    client, slept = client_for(server, attempts=3)
    server.script = [(503, status(503, "etcd is gone"), {})] * 5
    try:
        with pytest.raises(APIError) as info:
            await client.merge_patch("Service", "ns", "web", {"spec": {"type": "ClusterIP"}})
    finally:
        await client.close()
    assert info.value.status == 503 and info.value.attempts == 3
    assert "etcd is gone" in str(info.value) and "after 3 attempts" in str(info.value)
    assert len(server.seen) == 3 and server.seen[0][2] == "application/merge-patch+json"


async def test_client_errors_are_not_retried_and_404_is_absent(server):
    client, slept = client_for(server)
    server.script = [(404, status(404), {}), (422, status(422, "spec.replicas: Invalid value"), {}),
                     (404, status(404), {})]
    try:
        assert await client.get("PodDisruptionBudget", "ns", "web") is None
        with pytest.raises(APIError, match="spec.replicas: Invalid value") as info:
            await client.server_side_apply({"kind": "Deployment", "metadata": {"name": "web", "namespace": "ns"}})
        assert info.value.status == 422
        assert await client.delete("Service", "ns", "gone") is False
    finally:
        await client.close()
    assert slept == [] and len(server.seen) == 3
    assert "propagationPolicy=Background" in server.seen[2][1]


async def test_no_server_is_a_bounded_failure():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once the socket closes
    client = KubeClient(kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}"),
                        policy=RetryPolicy(attempts=3, base_seconds=0.01, max_backoff_seconds=0.01))
    try:
        with pytest.raises(APIError, match="no answer") as info:
            await client.get("Deployment", "ns", "web")
    finally:
        await client.close()
    assert info.value.status == 0 and info.value.attempts == 3


async def test_custom_resources_go_through_the_custom_objects_api(server):
    client, _ = client_for(server)
    try:
        await client.get("InferenceService", "ns", "llm")
    finally:
        await client.close()
    assert server.seen[0][1] == "/apis/kvserve.dev/v1alpha1/namespaces/ns/inferenceservices/llm"


OWNER = "uid-1"


def desired() -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "ns",
                         "ownerReferences": [{"uid": OWNER, "controller": True}]},
            "spec": {"type": "ClusterIP"}}


async def test_apply_is_one_server_side_apply_under_the_operators_field_manager(server):
    """No create, no merge patch: a PATCH with the apply content type, fieldManager and force.
    An answer lost after the server applied is retried: applying again is harmless."""
    client, _ = client_for(server)
    server.script = [(404, status(404), {}), (500, status(500), {})]
    try:
        assert await apply(client, desired(), OWNER) == "created"
    finally:
        await client.close()
    assert [m for m, *_ in server.seen] == ["GET", "PATCH", "PATCH"]
    method, path, content_type, _ = server.seen[-1]
    assert content_type == "application/apply-patch+yaml"
    assert path.startswith("/api/v1/namespaces/ns/services/web?")
    assert "fieldManager=kvserve-operator" in path and "force=true" in path.lower()
    assert list(server.objects) == ["web"]


async def test_apply_leaves_someone_elses_object_alone(server):
    client, _ = client_for(server)
    theirs = {**desired(), "metadata": {"name": "web", "namespace": "ns", "resourceVersion": "7",
                                        "ownerReferences": [{"uid": "someone-else", "controller": True}]}}
    server.script = [(200, theirs, {})]
    try:
        with pytest.raises(NotOwned, match="Service ns/web exists and is not owned"):
            await apply(client, desired(), OWNER)
    finally:
        await client.close()
    assert [m for m, *_ in server.seen] == ["GET"]
