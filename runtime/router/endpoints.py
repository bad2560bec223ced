"""Where the router's pods come from: a fixed list of URLs, or the Kubernetes API (watched).

`KubeEndpoints` lists the InferenceService's pods and then watches them (relisting after every
watch ends or fails, with backoff), and publishes the Ready ones: Running, condition Ready True,
not terminating, with an IP. A pod that starts draining turns unready in Kubernetes (its
readiness probe fails) before it stops, so the router stops sending it new requests then.
The pure part (which pods count, what their URLs are) is `endpoints_from_pods`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger("kvserve.router")

# The labels the operator puts on an InferenceService's runtime pods (operator/manifests.py).
INSTANCE_LABEL = "app.kubernetes.io/instance"
OWNER_LABEL = "kvserve.dev/inferenceservice"
# A pod's KV events publisher port (its replay socket listens on the next port), when it differs
# from the router's --kv-events-port; the operator sets it on every runtime pod.
EVENTS_PORT_ANNOTATION = "kvserve.dev/kv-events-port"


def inferenceservice_selector(name: str) -> dict[str, str]:
    return {INSTANCE_LABEL: name, OWNER_LABEL: name}


@dataclass(frozen=True)
class Endpoint:
    name: str  # pod name, or host:port for a fixed URL
    url: str  # the runtime's base URL (OpenAI routes)
    signals_url: str | None  # the agent's /v1/signals, or the runtime's /metrics; None: none
    # The pod's KV events: (PUB endpoint, replay endpoint), e.g. tcp://10.0.0.5:5557 and :5558.
    events: tuple[str, str] | None = None


def events_endpoints(host: str, port: int | None) -> tuple[str, str] | None:
    if not port:
        return None
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"


def parse_endpoints(text: str, *, agent_port: int | None, events_port: int | None = None) -> list[Endpoint]:
    """`--endpoints http://a:8000,http://b:8000`. The load of each comes from an agent on the same
    host at `agent_port`, or (agent_port 0) from the runtime's own /metrics."""
    out: list[Endpoint] = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        url = raw if "://" in raw else f"http://{raw}"
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoints: {raw!r} is not an http(s)://host:port URL")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"endpoints: {raw!r} has an invalid port") from None
        base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        name = f"{parts.hostname}:{port}"
        out.append(Endpoint(name, base, _signals_url(parts.scheme, parts.hostname, base, agent_port),
                            events_endpoints(parts.hostname, events_port)))
    if not out:
        raise ValueError("endpoints: no URL given (expected http://host:port[,http://host:port...])")
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise ValueError(f"endpoints: {sorted(n for n in set(names) if names.count(n) > 1)[0]} is listed twice")
    return out


def _signals_url(scheme: str, host: str, base: str, agent_port: int | None) -> str | None:
    if agent_port is None:
        return None
    if agent_port == 0:
        return f"{base}/metrics"
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{agent_port}/v1/signals"


def pod_ready(pod: Mapping[str, Any]) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    if status.get("phase") not in (None, "Running"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pod_events_port(pod: Mapping[str, Any], default: int | None) -> int | None:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(EVENTS_PORT_ANNOTATION)
    try:
        port = int(raw) if raw is not None else default
    except ValueError:
        return default
    return port if port and 0 < port < 65535 else None


def endpoints_from_pods(pods: Iterable[Mapping[str, Any]], *, selector: Mapping[str, str], runtime_port: int,
                        agent_port: int | None, events_port: int | None = None) -> list[Endpoint]:
    """The Ready pods that carry every selector label, as endpoints (sorted by name)."""
    out = []
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()) or not pod_ready(pod):
            continue
        ip = pod["status"]["podIP"]
        host = f"[{ip}]" if ":" in ip else ip
        base = f"http://{host}:{runtime_port}"
        out.append(Endpoint(pod["metadata"]["name"], base, _signals_url("http", ip, base, agent_port),
                            events_endpoints(ip, pod_events_port(pod, events_port))))
    return sorted(out, key=lambda e: e.name)


Listener = Callable[[list[Endpoint]], None]


class StaticEndpoints:
    """A fixed list: all of them count as ready; a dead one is found out per request (retry)."""

    def __init__(self, endpoints: list[Endpoint]):
        self.endpoints = endpoints
        self.synced = True

    async def run(self, publish: Listener) -> None:
        publish(list(self.endpoints))
        await asyncio.Event().wait()


@dataclass
class KubeConnection:
    server: str
    headers: dict[str, str]
    ssl: Any  # ssl.SSLContext | None


def kube_login() -> KubeConnection:
    """In-cluster service account first, then KUBECONFIG / ~/.kube/config (kopf's own login
    helpers, as the operator uses). Read again at every relist: a rotated token is picked up."""
    import warnings

    import kopf

    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise RuntimeError("no in-cluster service account and no KUBECONFIG or ~/.kube/config")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        headers = dict(info.as_http_headers())
    headers["User-Agent"] = "kvserve-router"
    return KubeConnection(info.server.rstrip("/"), headers, info.as_ssl_context())


class KubeEndpoints:
    """Lists and watches one namespace's pods with the selector; publishes the Ready ones."""

    def __init__(self, namespace: str, selector: Mapping[str, str], *, runtime_port: int, agent_port: int | None,
                 login: Callable[[], KubeConnection] = kube_login, watch_timeout: int = 60,
                 max_backoff: float = 10.0, events_port: int | None = None):
        self.namespace, self.selector = namespace, dict(selector)
        self.runtime_port, self.agent_port, self.events_port = runtime_port, agent_port, events_port
        self.login, self.watch_timeout, self.max_backoff = login, watch_timeout, max_backoff
        self.pods: dict[str, dict] = {}
        self.synced = False  # a first list succeeded
        self.last_error: str | None = None

    @property
    def _path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    def _publish(self, publish: Listener) -> None:
        publish(endpoints_from_pods(self.pods.values(), selector=self.selector, runtime_port=self.runtime_port,
                                    agent_port=self.agent_port, events_port=self.events_port))

    async def run(self, publish: Listener) -> None:
        backoff = 0.2
        selector = ",".join(f"{k}={v}" for k, v in self.selector.items())
        while True:
            try:
                conn = await asyncio.to_thread(self.login)
                timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.watch_timeout + 15)
                async with aiohttp.ClientSession(headers=conn.headers, timeout=timeout,
                                                 connector=aiohttp.TCPConnector(ssl=conn.ssl)) as session:
                    async with session.get(conn.server + self._path, params={"labelSelector": selector}) as r:
                        if r.status != 200:
                            raise RuntimeError(f"list pods: HTTP {r.status}: {(await r.text())[:200]}")
                        listing = await r.json()
                    self.pods = {p["metadata"]["name"]: p for p in listing.get("items") or []}
                    self.synced, self.last_error = True, None
                    self._publish(publish)
                    backoff = 0.2
                    version = (listing.get("metadata") or {}).get("resourceVersion") or ""
                    params = {"labelSelector": selector, "watch": "true", "resourceVersion": version,
                              "timeoutSeconds": str(self.watch_timeout), "allowWatchBookmarks": "true"}
                    async with session.get(conn.server + self._path, params=params) as r:
                        if r.status != 200:
                            raise RuntimeError(f"watch pods: HTTP {r.status}: {(await r.text())[:200]}")
                        try:
                            async for line in r.content:
                                if line.strip():
                                    self._apply(json.loads(line), publish)
                        except TimeoutError:
                            pass  # a quiet watch the server did not end at timeoutSeconds: relist
            except asyncio.CancelledError:
                raise
            except Exception as error:  # API restarts, token rotation, network: relist after a pause
                message = f"{type(error).__name__}: {error}"
                if message != self.last_error:
                    log.warning("pod watch in %s failed (%s); relisting", self.namespace, message)
                self.last_error = message
                await asyncio.sleep(backoff)
                backoff = min(self.max_backoff, backoff * 2)

    def _apply(self, event: Mapping[str, Any], publish: Listener) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":  # e.g. 410 Gone: the version is too old; relist
            raise RuntimeError(f"watch error: {obj.get('message') or obj}")
        name = (obj.get("metadata") or {}).get("name")
        if kind not in ("ADDED", "MODIFIED", "DELETED") or not name:
            return  # BOOKMARK
        if kind == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = dict(obj)
        self._publish(publish)
