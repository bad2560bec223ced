"""`kvserve router`: one front door for an InferenceService's pods (the imperative shell).

Only the runtime's user routes pass (access.py: an allowlist, sent upstream by the route's own
path), and with `--api-key` only with one of the keys, checked before a body is read: a refused
request costs no memory, is never held and never wakes a sleeping service. Bodies are read against
byte budgets (limits.py, bodies.py). What passes is streamed through chunk by chunk.
Completions and chat completions are placed by the policy (policy.py); the other routes go to the
least-loaded pod. A pod that refuses a request before the router has sent the client a single byte
(connection refused or reset, 503 while loading or draining, 429 at capacity) is excluded and the
request goes to another pod; once bytes reached the client the stream is the pod's, and a pod dying
mid-stream ends it. A client that goes away closes the upstream connection, which aborts the
request in the runtime.

With no ready pod, requests are held (hold.py) and `/router/demand` says so: that is the signal
the operator wakes a service scaled to zero on.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web, web_urldispatcher

from kvserve.runtime.engine.prefix_cache import block_hashes, extra_key

from .access import Route, RouteRefused, bearer_ok, resolve_route
from .bodies import MODELS_LIMIT, REFUSAL_LIMIT, BodyRefused, TooLong, read_capped, read_request_body
from .endpoints import Endpoint
from .hold import HoldFull, HoldQueue, HoldTimeout, Ticket
from .kv_events import KVEventSubscriptions
from .kv_index import KVIndexConfig, PreciseMatch
from .limits import BodyLimits, ByteBudget
from .load import LoadPoller
from .metrics import CONTENT_TYPE, RouterMetrics
from .policy import PREFIX_HIT, Choice, PolicyConfig, PolicyState, adapter_of, choose, chunk_hashes, routing_key
from .prompt_keys import MAX_BLOCKS, PromptKeys, load_tokenizer, tokenize_request

log = logging.getLogger("kvserve.router")

# Refusals that mean "not now, not here": safe to send elsewhere, nothing was generated.
RETRY_STATUSES = (429, 503)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "content-encoding",
              "expect"}
ROUTED = ("completion", "chat")  # route kinds the policy places; the others go to the least-loaded pod
UNAUTHORIZED = "Invalid or missing API key: send `Authorization: Bearer <key>`."


@dataclass
class RouterConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    hold_timeout_s: float = 300.0
    max_held: int = 1024
    max_attempts: int = 3  # pods tried per request before the refusal is passed on
    connect_timeout_s: float = 5.0
    retry_after_s: int = 5
    served_model_name: str | None = None  # /v1/models answers this while no pod is ready
    max_request_body_bytes: int = BodyLimits().max_request_body_bytes
    max_held_bytes: int = BodyLimits().max_held_bytes  # bodies of held requests, together
    max_buffered_bytes: int = BodyLimits().max_buffered_bytes  # every body in memory at once
    api_keys: tuple[str, ...] = ()  # empty: the router lets the pods check credentials
    signals_interval_s: float = 1.0
    signals_stale_after_s: float = 5.0
    # KV events (kv_events.py): None follows no pod's events; the prefix policy is then served-based only.
    kv_index: KVIndexConfig | None = None
    kv_events_topic: str = ""
    tokenizer: str | None = None  # the model's tokenizer: prompts hash to the pods' block hashes
    tokenize_timeout_s: float = 2.0  # without a tokenizer: a pod's /tokenize, at most this long


_KIND_CODE = object()  # error_response's default: the code that goes with the status


def error_response(status: int, message: str, *, headers: dict[str, str] | None = None,
                   code: Any = _KIND_CODE) -> web.Response:
    kinds = {401: ("invalid_request_error", "invalid_api_key"), 404: ("invalid_request_error", "model_not_found"),
             405: ("invalid_request_error", "method_not_allowed"), 413: ("invalid_request_error", "request_too_large"),
             429: ("rate_limit_error", "rate_limit_exceeded"), 502: ("server_error", "bad_gateway"),
             503: ("service_unavailable_error", "service_unavailable")}
    kind, kind_code = kinds.get(status, ("server_error", None))
    body = {"error": {"message": message, "type": kind, "param": None,
                      "code": kind_code if code is _KIND_CODE else code}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json", headers=headers)


@dataclass
class Refused:
    """An attempt that a pod turned down before the client saw anything."""

    reason: str
    status: int | None = None
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    message: str = ""


class Router:
    def __init__(self, config: RouterConfig, source, *, clock=time.monotonic):
        self.config, self.source, self.clock = config, source, clock
        self.metrics = RouterMetrics()
        self.policy = PolicyState(config.policy)
        self.hold = HoldQueue(max_held=config.max_held, timeout=config.hold_timeout_s, clock=clock,
                              max_held_bytes=config.max_held_bytes)
        self.buffered = ByteBudget(config.max_buffered_bytes)  # request bodies in memory now
        self.loads = LoadPoller(interval=config.signals_interval_s, stale_after=config.signals_stale_after_s,
                                clock=clock)
        self.endpoints: dict[str, Endpoint] = {}
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.loads.in_flight = self.in_flight
        self.active = 0  # client requests being handled (held ones included)
        self.requests_total = 0
        self.last_activity = clock()
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self.kv_events: KVEventSubscriptions | None = None
        self.ranked_by_events = 0  # requests some pod's KV events placed
        self.prompt_keys: PromptKeys | None = None
        if config.kv_index is not None and config.policy.policy == "prefix":
            self.kv_events = KVEventSubscriptions(config.kv_index, topic=config.kv_events_topic, clock=clock)
            self.metrics.kv_events.source = lambda: (self.kv_events.status(), self.ranked_by_events)
            if config.tokenizer:
                self.prompt_keys = PromptKeys(load_tokenizer(config.tokenizer))

    # --- endpoints ---------------------------------------------------------------------------

    def publish(self, endpoints: list[Endpoint]) -> None:
        new = {e.name: e for e in endpoints}
        if set(new) != set(self.endpoints):
            log.info("ready pods: %s", ", ".join(sorted(new)) or "none")
        for gone in sorted(set(self.endpoints) - set(new)):
            self.metrics.retire_upstream(gone)
        for back in set(new) - set(self.endpoints):
            self.metrics.revive_upstream(back)
        if new and not self.endpoints:
            # Idle counts from when the service could serve: a service is not idle while its
            # first pod loads, and a woken one gets a full window before it may sleep again.
            self.touch()
        self.endpoints = new
        self.policy.set_pods(new)
        if self.kv_events is not None:
            self.kv_events.set_endpoints(endpoints)
        self.metrics.endpoints.set(len(new))
        self.hold.set_available(bool(new))

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        trace = aiohttp.TraceConfig()

        async def headers_sent(session, ctx, params):
            ticket = ctx.trace_request_ctx
            if isinstance(ticket, Ticket):
                ticket.sent.set()

        trace.on_request_headers_sent.append(headers_sent)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True), trace_configs=[trace],
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            auto_decompress=False)
        self._tasks = [asyncio.create_task(self.source.run(self.publish)),
                       asyncio.create_task(self.loads.run(self.session, lambda: list(self.endpoints.values())))]

    async def stop(self, app: web.Application) -> None:
        if self.kv_events is not None:
            await self.kv_events.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self.session is not None:
            await self.session.close()

    # --- the demand signal -------------------------------------------------------------------

    def touch(self) -> None:
        self.last_activity = self.clock()

    def _idle(self) -> float:
        # Not idle while a request is open, nor while no pod is ready: a service whose pods are
        # still loading (or gone) is not one nobody uses.
        if self.active or not self.endpoints:
            return 0.0
        return self.clock() - self.last_activity

    def demand(self) -> dict[str, Any]:
        """What the operator reads: held requests wake a sleeping service; a long idle time with
        nothing in flight lets it sleep."""
        return {"held": len(self.hold), "oldest_held_seconds": round(self.hold.oldest_age(), 3),
                "in_flight": self.active, "idle_seconds": round(self._idle(), 3),
                "requests_total": self.requests_total, "held_total": self.hold.held_total,
                "hold_timeouts_total": self.hold.timeouts_total, "ready_endpoints": len(self.endpoints),
                "endpoints": sorted(self.endpoints), "policy": self.config.policy.policy,
                "synced": bool(getattr(self.source, "synced", True))}

    # --- forwarding --------------------------------------------------------------------------

    def _choose(self, hashes: list[int], tried: list[str], adapter: str | None = None,
                precise: PreciseMatch | None = None) -> Choice | None:
        names = list(self.endpoints)
        loads = {n: self.loads.load(n, self.in_flight[n]) for n in names}
        return choose(self.policy, hashes, names, loads, self.clock(), exclude=tried, precise=precise,
                      adapter=adapter, adapters=self.loads.adapters() if adapter is not None else None)

    async def _remote_tokens(self, kind: str, obj: dict, headers: dict[str, str]) -> tuple[list[int], bool] | None:
        """The request's token ids from a pod's /tokenize (the least loaded): no tokenizer here."""
        request = tokenize_request(kind, obj)
        if request is None or not self.endpoints or self.session is None:
            return None
        payload, cut = request
        pod = min(self.endpoints, key=lambda n: self.loads.load(n, self.in_flight[n]).score())
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        try:
            async with self.session.post(self.endpoints[pod].url + "/tokenize", json=payload, headers=auth,
                                         timeout=aiohttp.ClientTimeout(total=self.config.tokenize_timeout_s)) as r:
                if r.status != 200:
                    return None
                tokens = (json.loads(await read_capped(r.content, self.config.max_request_body_bytes))
                          .get("tokens"))
        except (TimeoutError, aiohttp.ClientError, OSError, TooLong, ValueError, AttributeError):
            return None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return None
        return tokens, cut

    async def _precise(self, route: Route, obj: Any, adapter: str | None,
                       headers: dict[str, str]) -> PreciseMatch | None:
        """What the pods' KV events say they hold of this request (None: no pod's events to go by,
        or a request the router cannot hash as the runtime does). A LoRA adapter's request is
        hashed under the adapter id each pod's events name (runtime/lora/identity.py)."""
        events = self.kv_events
        if events is None or route.kind not in ROUTED or not isinstance(obj, dict) or not events.indexes:
            return None
        kind = route.kind
        prompt = obj.get("prompt") if kind == "completion" else None
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            got = (prompt, False)  # token ids: hashed as they are
        elif self.prompt_keys is not None:
            got = await asyncio.to_thread(self.prompt_keys.token_ids, kind, obj)  # tokenizing costs ~ms
        else:
            got = await self._remote_tokens(kind, obj, headers)
        if got is None:
            return None
        ids, cut = got
        salt = obj.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        memo: dict[tuple[int, bytes | None], list[bytes]] = {}

        def keys_for(block_size: int | None, lora_key: bytes | None = None) -> list[bytes]:
            size = block_size or self.config.policy.block_tokens
            if (size, lora_key) not in memo:
                keys = block_hashes(ids[:MAX_BLOCKS * size], size, extra_key(salt, lora_key))
                memo[size, lora_key] = keys[:-2] if cut else keys
            return memo[size, lora_key]

        precise = events.precise(keys_for, list(self.endpoints), adapter)
        if precise is not None and precise.held:
            self.ranked_by_events += 1
        return precise

    async def _wait_for_pod(self, ticket: Ticket | None, nbytes: int) -> Ticket:
        self.metrics.held.inc()
        try:
            if ticket is None:  # no ticket yet: the pods went away after this request's body was read
                ticket = self.hold.admit(nbytes)
            ticket, waited = await self.hold.wait(ticket)
        except HoldFull:
            self.metrics.holds.labels("rejected").inc()
            raise
        except HoldTimeout:
            self.metrics.holds.labels("timeout").inc()
            raise
        except BaseException:
            self.metrics.holds.labels("client_gone").inc()
            raise
        finally:
            self.metrics.held.dec()
        self.metrics.holds.labels("released").inc()
        self.metrics.hold_seconds.observe(waited)
        return ticket

    def _forward_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["X-Request-Id"] = request_id
        if request.remote:
            prior = request.headers.get("X-Forwarded-For")
            headers["X-Forwarded-For"] = f"{prior}, {request.remote}" if prior else request.remote
        return headers

    def _hold_full(self, error: HoldFull) -> web.Response:
        return error_response(503, f"No ready pod and the hold queue is full ({error}); retry later.",
                              headers={"Retry-After": str(self.config.retry_after_s)})

    async def forward(self, request: web.Request, route: Route, body: bytes, hashes: list[int], stream: bool,
                      admitted: Ticket | None = None, adapter: str | None = None,
                      obj: Any = None) -> web.StreamResponse:
        """`admitted`: the hold ticket this request took before its body was read, if any;
        `adapter`: the LoRA adapter the request names (pods with it loaded are preferred);
        `obj`: the parsed body (hashed for the pods' KV events)."""
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = self._forward_headers(request, request_id)
        tried: list[str] = []
        last: Refused | None = None
        while True:
            ticket = None
            if admitted is not None or self.hold.must_hold():
                try:
                    ticket = await self._wait_for_pod(admitted, len(body))
                except HoldFull as error:
                    return self._hold_full(error)
                except HoldTimeout as error:
                    return error_response(503, f"No pod became ready in time ({error}); the service may be "
                                          "scaling from zero, retry later.",
                                          headers={"Retry-After": str(self.config.retry_after_s)})
                finally:
                    admitted = None
            precise = await self._precise(route, obj, adapter, headers)  # after any hold: pods are known now
            choice = self._choose(hashes, tried, adapter, precise)
            if choice is None:
                if ticket is not None:
                    ticket.sent.set()
                if self.endpoints and last is not None:
                    return self._refusal_response(last)
                continue  # the pods went away between release and choice: hold again
            try:
                result = await self._attempt(request, route, body, headers, self.endpoints[choice.pod], choice,
                                             hashes, stream, ticket)
            finally:
                if ticket is not None:
                    ticket.sent.set()
            if isinstance(result, web.StreamResponse):
                return result
            last = result
            tried.append(choice.pod)
            self.metrics.retries.labels(result.reason).inc()
            more = len(tried) < self.config.max_attempts and any(p not in tried for p in self.endpoints)
            log.info("request %s: %s refused (%s); %s", request_id, choice.pod, result.message or result.reason,
                     "trying another pod" if more else "no other pod to try")
            if not more:
                return self._refusal_response(last)

    def _refusal_response(self, refused: Refused) -> web.Response:
        if refused.status is not None:  # the pod's own answer (a 503 or 429 in OpenAI's shape)
            headers = {k: v for k, v in refused.headers.items() if k.lower() not in HOP_BY_HOP}
            return web.Response(status=refused.status, body=refused.body, headers=headers)
        return error_response(503, f"No pod could take the request: {refused.message}",
                              headers={"Retry-After": str(self.config.retry_after_s)})

    async def _attempt(self, request: web.Request, route: Route, body: bytes, headers: dict[str, str],
                       endpoint: Endpoint, choice: Choice, hashes: list[int], stream: bool,
                       ticket: Ticket | None) -> web.StreamResponse | Refused:
        pod = endpoint.name
        url = endpoint.url + route.path  # the allowlist's path, never the client's
        self.in_flight[pod] += 1
        self.loads.sent(pod, self.in_flight[pod])
        self.metrics.in_flight.labels(pod).set(self.in_flight[pod])
        sent = time.monotonic()
        upstream: aiohttp.ClientResponse | None = None
        done = False
        try:
            try:
                upstream = await self.session.request(request.method, url, data=body, headers=headers,
                                                      trace_request_ctx=ticket)
            except (TimeoutError, aiohttp.ClientConnectionError, OSError) as error:
                return Refused("connect", message=f"{type(error).__name__}: {error}")
            if upstream.status in RETRY_STATUSES:
                try:
                    data = await read_capped(upstream.content, REFUSAL_LIMIT)
                except (TimeoutError, aiohttp.ClientError, OSError, TooLong) as error:
                    return Refused(f"http_{upstream.status}", message=f"HTTP {upstream.status}, then {error}")
                return Refused(f"http_{upstream.status}", upstream.status, data, dict(upstream.headers),
                               message=f"HTTP {upstream.status}")
            try:
                # Nothing goes to the client before the pod's first body bytes: until then a pod
                # that dies can still be replaced.
                first = await upstream.content.readany()
            except (TimeoutError, aiohttp.ClientError, OSError) as error:
                return Refused("disconnected", message=f"{type(error).__name__}: {error}")
            if stream and upstream.status == 200:
                self.metrics.ttft.labels(pod).observe(time.monotonic() - sent)
            if upstream.status == 200:
                self.policy.record(hashes, pod, self.clock())
                if self.kv_events is not None:
                    self.kv_events.routed(pod)
            self._count(choice)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_BY_HOP:
                    response.headers.add(key, value)
            response.headers["X-Kvserve-Pod"] = pod
            response.headers["X-Kvserve-Route"] = choice.decision
            await response.prepare(request)
            if first:
                await response.write(first)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            done = True
            return response
        finally:
            if upstream is not None:
                if done:
                    upstream.release()
                else:  # client gone, pod gone, or a refusal: never reuse a half-read connection
                    upstream.close()
            self.in_flight[pod] -= 1
            if pod in self.endpoints or self.metrics.shows(pod):  # not a series for a pod long gone
                self.metrics.in_flight.labels(pod).set(self.in_flight[pod])
            if self.in_flight[pod] <= 0:
                del self.in_flight[pod]

    def _count(self, choice: Choice) -> None:
        self.metrics.requests.labels(choice.pod, choice.decision).inc()
        if choice.total_chunks:
            self.metrics.prefix_query_chunks.inc(choice.total_chunks)
            self.metrics.prefix_matched_chunks.inc(choice.matched_chunks)
        if choice.decision == PREFIX_HIT or choice.matched_chunks:
            self.metrics.prefix_hits.inc()

    # --- /v1/models ----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> list[dict[str, Any]] | web.Response:
        """The union of every ready pod's models (pods of one service normally agree)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization",)}

        async def one(e: Endpoint):
            try:
                async with self.session.get(e.url + "/v1/models", headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return r.status, await read_capped(r.content, MODELS_LIMIT), dict(r.headers)
            except (TimeoutError, aiohttp.ClientError, OSError, TooLong):
                return None

        answers = [a for a in await asyncio.gather(*(one(e) for e in self.endpoints.values())) if a is not None]
        cards: dict[str, dict] = {}
        for status, data, _ in answers:
            if status != 200:
                continue
            try:
                for card in json.loads(data).get("data") or []:
                    cards.setdefault(card.get("id"), card)
            except (ValueError, AttributeError):
                continue
        if not cards and answers and all(s == 401 for s, _, _ in answers):
            status, data, hdrs = answers[0]
            return web.Response(status=status, body=data, content_type="application/json")
        if not cards and self.config.served_model_name:  # scaled to zero: still say what is served
            name = self.config.served_model_name
            cards[name] = {"id": name, "object": "model", "created": 0, "owned_by": "kvserve", "root": name,
                           "parent": None}
        return list(cards.values())


    # --- a client request, from its headers on -------------------------------------------------

    def _busy(self, message: str) -> web.Response:
        return error_response(503, message, headers={"Retry-After": str(self.config.retry_after_s)})

    def refusal_from_headers(self, declared: int | None) -> web.Response | None:
        """What handle() would answer at once for a body of `declared` bytes, taking nothing."""
        if declared is not None and declared > self.config.max_request_body_bytes:
            return error_response(413, f"Request body too large: Content-Length {declared} is over "
                                       f"--max-request-body-bytes {self.config.max_request_body_bytes}.")
        if self.buffered.used + (declared or 0) > self.buffered.limit:
            return self._busy(f"The router is buffering {self.buffered.used} bytes of request bodies and "
                              f"{declared} more would pass --max-buffered-bytes {self.buffered.limit}; retry later.")
        if self.hold.must_hold():
            problem = self.hold.room_for(declared or 0)
            if problem:
                return self._hold_full(HoldFull(problem))
        return None

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        """An allowlisted, authenticated request: its body read against the byte budgets (a held
        one's also against the hold queue's), then forwarded. Every check that can refuse runs
        from the headers first, so a refusal reads nothing."""
        config = self.config
        declared = request.content_length
        if declared is not None and declared > config.max_request_body_bytes:
            return self.refusal_from_headers(declared)
        if not self.buffered.take(declared or 0):
            self.metrics.body_rejections.labels("buffered").inc()
            return self._busy(f"The router is buffering {self.buffered.used} bytes of request bodies and "
                              f"{declared} more would pass --max-buffered-bytes {self.buffered.limit}; retry later.")
        charged = declared or 0
        ticket: Ticket | None = None
        self.requests_total += 1
        self.active += 1
        self.touch()
        status = 499
        try:
            if self.hold.must_hold():
                try:
                    ticket = self.hold.admit(charged)
                except HoldFull as error:
                    self.metrics.holds.labels("rejected").inc()
                    status = 503
                    return self._hold_full(error)

            def charge(n: int) -> None:  # a body without Content-Length, or longer than it said
                nonlocal charged
                if not self.buffered.take(n):
                    self.metrics.body_rejections.labels("buffered").inc()
                    raise BodyRefused(503, f"The router's request bodies would pass --max-buffered-bytes "
                                           f"{self.buffered.limit}; retry later.")
                charged += n
                if ticket is not None:
                    try:
                        self.hold.grow(ticket, n)
                    except HoldFull as error:
                        self.metrics.holds.labels("rejected").inc()
                        raise BodyRefused(503, f"No ready pod and the hold queue is full ({error}); "
                                               "retry later.") from None

            try:
                body = await read_request_body(request.content, declared=declared,
                                               limit=config.max_request_body_bytes, charge=charge)
            except BodyRefused as refused:
                status = refused.status
                if refused.status == 413:
                    return error_response(413, refused.message)
                return self._busy(refused.message)
            hashes, stream, adapter, obj = self._routing(route, body)
            response = await self.forward(request, route, body, hashes, stream, admitted=ticket, adapter=adapter,
                                          obj=obj)
            status = response.status
            return response
        finally:
            if ticket is not None:  # refused before the queue, or already gone from it (a no-op)
                self.hold.leave(ticket)
            self.buffered.give(charged)
            self.active -= 1
            self.touch()
            self.metrics.responses.labels(str(status)).inc()

    def _routing(self, route: Route, body: bytes) -> tuple[list[int], bool, str | None, Any]:
        """The prefix hashes the policy places the request by, whether it streams, the LoRA
        adapter it names (None: the base model), and the parsed body (for the KV events' hashes)."""
        if route.kind not in ROUTED:
            return [], False, None, None
        try:
            obj = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            return [], False, None, None  # the pod answers the 400 in its own words
        if not isinstance(obj, dict):
            return [], False, None, None
        policy = self.config.policy
        adapter = adapter_of(obj, self.loads.adapters())
        hashes = []
        if policy.policy == "prefix":
            hashes = chunk_hashes(routing_key(route.kind, obj), block_tokens=policy.block_tokens,
                                  chunk_chars=policy.chunk_chars, adapter=adapter)
        return hashes, obj.get("stream") is True, adapter, obj


ROUTER = web.AppKey("router", Router)


def build_app(config: RouterConfig, source) -> web.Application:
    router = Router(config, source)
    # Bodies are read by bodies.read_request_body against the router's own limits, never by
    # aiohttp's request.read(); its cap stays as a backstop.
    app = web.Application(client_max_size=config.max_request_body_bytes)
    app[ROUTER] = router

    def admission(request: web.Request) -> tuple[web.Response | None, Route | None, str | None]:
        """Allowlist, then credential, from the request line and headers alone: (a refusal, or
        None with the route and, for /v1/models/{id}, the model)."""
        try:
            route, model = resolve_route(request.method, request.raw_path)
        except RouteRefused as refused:
            router.metrics.refusals.labels(str(refused.status)).inc()
            return error_response(refused.status, refused.message, code=None), None, None
        if config.api_keys and not bearer_ok(request.headers.get("Authorization"), config.api_keys):
            router.metrics.refusals.labels("401").inc()
            return error_response(401, UNAUTHORIZED), None, None
        return None, route, model

    async def front_door(request: web.Request) -> web.StreamResponse:
        """Every request that is not one of the router's own routes."""
        refusal, route, model = admission(request)
        if refusal is not None:
            return refusal
        if route.kind == "models":
            return await models(request)
        if route.kind == "model":
            return await one_model(request, model)
        return await router.handle(request, route)

    async def expect_continue(request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` (curl sends it with bodies over 1 MB): the client waits for the
        go-ahead before sending its body, so a request the router would refuse is refused now
        and its body never crosses the network. Otherwise aiohttp's own answer (100 Continue)."""
        refusal, route, _ = admission(request)
        if refusal is None and route.kind not in ("models", "model"):
            refusal = router.refusal_from_headers(request.content_length)
        if refusal is not None:
            return refusal
        await web_urldispatcher._default_expect_handler(request)
        return None

    async def models(request: web.Request) -> web.Response:
        cards = await router.models(request)
        if isinstance(cards, web.Response):
            return cards
        return web.json_response({"object": "list", "data": cards})

    async def one_model(request: web.Request, name: str) -> web.Response:
        cards = await router.models(request)
        if isinstance(cards, web.Response):
            return cards
        for card in cards:
            if card.get("id") == name:
                return web.json_response(card)
        return error_response(404, f"The model `{name}` does not exist.")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(request: web.Request) -> web.Response:
        # Ready with zero pods too: the router holds requests then, which is the point of it.
        if getattr(router.source, "synced", True):
            return web.json_response({"status": "ready", "ready_endpoints": len(router.endpoints)})
        return web.json_response({"status": "waiting for the first pod list",
                                  "error": getattr(router.source, "last_error", None)}, status=503)

    async def metrics(request: web.Request) -> web.Response:
        router.metrics.held.set(len(router.hold))
        router.metrics.held_bytes.set(router.hold.held_bytes)
        router.metrics.buffered_bytes.set(router.buffered.used)
        if router.config.policy.policy == "prefix":
            for pod, count in router.policy.sessions.counts(router.endpoints, router.clock()).items():
                router.metrics.conversations.labels(pod).set(count)
        return web.Response(body=router.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def demand(request: web.Request) -> web.Response:
        return web.json_response(router.demand())

    async def kv_events(request: web.Request) -> web.Response:
        # Each pod's event stream as this router replica follows it (states, seqs, gaps, resyncs).
        events = router.kv_events
        return web.json_response({"enabled": events is not None, "ranked_by_events": router.ranked_by_events,
                                  "tokenizer": router.prompt_keys is not None,
                                  "pods": events.status() if events else {}})

    r = app.router
    # The router's own routes, matched exactly; everything else meets the allowlist.
    r.add_get("/health", health)
    r.add_get("/ready", ready)
    r.add_get("/metrics", metrics)
    r.add_get("/router/demand", demand)
    r.add_get("/router/kv-events", kv_events)
    r.add_route("*", "/{tail:.*}", front_door, expect_handler=expect_continue)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    return app
