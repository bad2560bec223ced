"""A fault-injecting HTTP proxy in front of the Kubernetes API emulator.

The operator talks to the proxy; the proxy forwards to the emulator, except that a share of the
requests (`rate`) are answered with a fault instead, the way a loaded or restarting API server
(or a load balancer in front of it) answers:

  * 500 or 503: sometimes before the request reaches the server, sometimes after the server did
    the work (the answer is lost: a create then exists though the client saw an error);
  * 429 with `Retry-After: 1`;
  * 409 where a real server can answer it: on creates (POST: "already exists"), and on the
    operator client's own patches and deletes (which it retries). kopf's merge and JSON patches
    carry no preconditions, which a real server never answers with 409 (it retries merge-patch
    conflicts itself; a failed JSON-patch `test` is a 422), and kopf 1.45 lets a 409 there end a
    timer for good, so those are spared it;
  * watch streams are cut (the connection dropped) after a random 0.3 to 3 seconds.

Every request is logged with its User-Agent and fault, so a test can check the operator's calls
against the RBAC it documents, including calls that never reached the emulator.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}
WRITES = {"POST", "PATCH", "PUT", "DELETE"}
REASONS = {500: "InternalError", 503: "ServiceUnavailable", 429: "TooManyRequests", 409: "Conflict"}


@dataclass
class Logged:
    method: str
    path: str
    watch: bool
    user_agent: str
    fault: str | None  # "500", "500-after", "429", "409", "cut", or None


@dataclass
class FaultProxy:
    upstream: str
    rate: float = 0.2
    seed: int = 0
    statuses: tuple[int, ...] = (500, 503, 429, 409)
    watch_cut_seconds: tuple[float, float] = (0.3, 3.0)
    log: list[Logged] = field(default_factory=list)
    url: str | None = None

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.forced: list[tuple[str, str, int, bool]] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.enabled = True

    async def start(self, host: str = "127.0.0.1") -> FaultProxy:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"
        self._session = aiohttp.ClientSession(auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=None, sock_read=None))
        return self

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def faults(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for entry in self.log:
            if entry.fault:
                out[entry.fault] = out.get(entry.fault, 0) + 1
        return out

    def force(self, method: str, path_part: str, status: int, *, after: bool = False) -> None:
        """The next `method` request whose path contains `path_part` gets `status` (after the
        server did the work, with `after`), whatever the dice say: rare cases, made certain."""
        self.forced.append((method, path_part, status, after))

    def _forced(self, method: str, path: str) -> tuple[int, bool] | None:
        for i, (m, part, status, after) in enumerate(self.forced):
            if m == method and part in path:
                del self.forced[i]
                return status, after
        return None

    def _pick(self, method: str, user_agent: str) -> int | None:
        if not self.enabled or self.rng.random() >= self.rate:
            return None
        conflict_ok = method == "POST" or (method in WRITES and not user_agent.startswith("kopf/"))
        return self.rng.choice([s for s in self.statuses if s != 409 or conflict_ok])

    @staticmethod
    def _status(code: int) -> web.Response:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": f"injected fault {code}", "reason": REASONS.get(code, "InternalError"), "code": code}
        headers = {"Retry-After": "1"} if code == 429 else {}
        return web.Response(status=code, text=json.dumps(body), content_type="application/json", headers=headers)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        watch = request.query.get("watch") in ("true", "1")
        entry = Logged(request.method, request.path, watch, request.headers.get("User-Agent", ""), None)
        self.log.append(entry)
        forced = self._forced(request.method, request.path) if self.enabled else None
        if forced is not None:
            fault, forward_first = forced
        else:
            fault = self._pick(request.method, entry.user_agent)
            forward_first = fault in (500, 503) and request.method in WRITES and self.rng.random() < 0.5
        if fault is not None and not forward_first:
            entry.fault = str(fault)
            return self._status(fault)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        body = await request.read()
        async with self._session.request(request.method, self.upstream + request.rel_url.path_qs,
                                         headers=headers, data=body or None) as upstream:
            if forward_first:
                await upstream.read()
                entry.fault = f"{fault}-after"
                return self._status(fault)
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            if not watch:
                return web.Response(status=upstream.status, body=await upstream.read(), headers=out_headers)
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            await response.prepare(request)
            cut_after = self.rng.uniform(*self.watch_cut_seconds) if self.enabled else None
            try:
                async with asyncio.timeout(cut_after):
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
            except TimeoutError:
                entry.fault = "cut"
                if request.transport is not None:
                    request.transport.close()  # dropped, not ended: the client sees a broken stream
                return response
            except (ConnectionResetError, aiohttp.ClientError):
                return response
            await response.write_eof()
            return response


_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                   r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def rbac_triple(entry: Logged) -> tuple[str, str, str] | None:
    """(group, resource[/subresource], verb) of a logged request, None for discovery."""
    match = _PATH.match(entry.path)
    if match is None or (match["plural"] == "namespaces" and match["ns"] is None and match["name"]):
        return None
    group = match["group"] or ""
    if entry.method == "GET":
        verb = "watch" if entry.watch else ("get" if match["name"] else "list")
    else:
        verb = _VERBS.get(entry.method, entry.method.lower())
    resource = match["plural"] + (f"/{match['sub']}" if match["sub"] else "")
    return group, resource, verb
