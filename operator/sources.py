"""Where the autoscaler's per-pod signals come from: each pod's agent, or Prometheus.

I/O lives here; parsing a pod or a Prometheus answer into `PodSignals` is kept in small pure
functions. A pod that is not Ready is never scraped; a scrape that fails or times out gives a
stale entry, which the autoscaler never scales down on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp

from .autoscaler import PodSignals
from .manifests import AGENT_PORT

SIGNAL_METRICS = {
    "kvserve_kv_cache_utilization": "kv_cache_utilization",
    "kvserve_queue_depth": "queue_depth",
    "kvserve_requests_running": "requests_running",
    "kvserve_kv_cache_capacity_tokens": "kv_cache_capacity_tokens",
    "kvserve_tensor_parallel_size": "tensor_parallel_size",
    "kvserve_data_parallel_size": "data_parallel_size",
    # The TPOT gate (operator/layout.py) differences these totals between scrapes.
    "kvserve_inter_token_latency_seconds_sum": "inter_token_latency_seconds_sum",
    "kvserve_inter_token_latency_seconds_count": "inter_token_latency_seconds_count",
    "kvserve_engine_sample_age_seconds": "sample_age_seconds",
    "kvserve_engine_up": "engine_up",
}


# An agent's /v1/signals is a few KiB (numbers and the model's config.json); a router's
# /router/demand less. Past this the answer is refused unread: a broken or hostile pod must not
# make the operator buffer an endless body (its memory limit is 512Mi, for every service at once).
MAX_AGENT_ANSWER_BYTES = 1024 * 1024
# A Prometheus instant query for one service's pods: a few series per pod.
MAX_PROMETHEUS_ANSWER_BYTES = 16 * 1024 * 1024


class AnswerTooLarge(ValueError):
    pass


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of `response`, read only up to `limit` bytes: a larger declared length is refused
    before reading, a longer body as soon as it passes the limit."""
    declared = response.content_length
    if declared is not None and declared > limit:
        raise AnswerTooLarge(f"answer of {declared} bytes is over the {limit}-byte limit")
    body = bytearray()
    while True:
        chunk = await response.content.read(min(64 * 1024, limit + 1 - len(body)))
        if not chunk:
            break
        body += chunk
        if len(body) > limit:
            raise AnswerTooLarge(f"answer is over the {limit}-byte limit")
    return bytes(body)


async def read_json_capped(response: aiohttp.ClientResponse, limit: int) -> Any:
    body = await read_capped(response, limit)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"answer is not JSON: {error}") from None


def pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Running"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pod_terminating(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def pod_ip(pod: Mapping[str, Any]) -> str | None:
    return (pod.get("status") or {}).get("podIP")


def pod_name(pod: Mapping[str, Any]) -> str:
    return pod["metadata"]["name"]


def unready(pod: Mapping[str, Any]) -> PodSignals:
    return PodSignals(pod_name(pod), ready=False, stale=True)


class _HttpSource:
    """One aiohttp session per event loop (kopf's handlers and the tests' loops differ), made on
    first use and closed with the source."""

    timeout: float
    _session: aiohttp.ClientSession | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


class AgentSource(_HttpSource):
    """Scrapes `GET http://<podIP>:<port>/v1/signals` of every Ready pod, a few at a time."""

    def __init__(self, *, port: int = AGENT_PORT, timeout: float = 3.0, concurrency: int = 16,
                 max_answer_bytes: int = MAX_AGENT_ANSWER_BYTES):
        self.port, self.timeout, self.concurrency = port, timeout, concurrency
        self.max_answer_bytes = max_answer_bytes

    async def scrape(self, namespace: str, name: str, pods: Iterable[Mapping[str, Any]],
                     errors: dict[str, str] | None = None,
                     models: dict[str, dict[str, Any]] | None = None,
                     adapters: dict[str, dict[str, Any]] | None = None) -> list[PodSignals]:
        """Signals for every pod, in order; failures are also put in `errors` (pod -> message),
        what each agent reports about its model in `models` (pod -> the agent's `model`) and
        about its LoRA adapters in `adapters` (pod -> the agent's `adapters`)."""
        semaphore = asyncio.Semaphore(self.concurrency)
        errors = {} if errors is None else errors
        models = {} if models is None else models

        async def one(pod: Mapping[str, Any]) -> PodSignals:
            if not pod_ready(pod) or not pod_ip(pod):
                return unready(pod)
            url = f"http://{pod_ip(pod)}:{self.port}/v1/signals"
            async with semaphore:
                try:
                    async with self._get_session().get(url) as response:
                        if response.status != 200:
                            raise ValueError(f"HTTP {response.status}")
                        data = await read_json_capped(response, self.max_answer_bytes)
                    if not isinstance(data, dict):
                        raise ValueError("answer is not a JSON object")
                    if isinstance(data.get("model"), dict):
                        models[pod_name(pod)] = data["model"]
                    if adapters is not None and isinstance(data.get("adapters"), dict):
                        adapters[pod_name(pod)] = data["adapters"]
                    return PodSignals.from_json(pod_name(pod), data, pod_ready=True)
                except (TimeoutError, aiohttp.ClientError, ValueError) as error:
                    errors[pod_name(pod)] = f"{url}: {type(error).__name__}: {error}"
                    return PodSignals(pod_name(pod), ready=True, stale=True)

        return list(await asyncio.gather(*(one(p) for p in pods)))


def signals_from_prometheus(result: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> list[PodSignals]:
    """Maps an instant-query vector of kvserve_* series (labelled `pod`) onto the given pods."""
    values: dict[str, dict[str, float]] = {}
    for series in result:
        metric = series.get("metric") or {}
        field = SIGNAL_METRICS.get(metric.get("__name__", ""))
        pod = metric.get("pod")
        if field is None or pod is None:
            continue
        try:
            values.setdefault(pod, {})[field] = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
    out = []
    for pod in pods:
        name = pod_name(pod)
        v = values.get(name)
        if not pod_ready(pod):
            out.append(unready(pod))
        elif v is None or "kv_cache_utilization" not in v:
            out.append(PodSignals(name, ready=True, stale=True))
        else:
            data = dict(v)
            data["stale"] = v.get("engine_up", 1.0) < 1.0
            for size in ("tensor_parallel_size", "data_parallel_size"):
                if size in data:
                    data[size] = int(data[size])
            out.append(PodSignals.from_json(name, data, pod_ready=True))
    return out


class PrometheusSource:
    """Reads the agents' kvserve_* gauges from Prometheus (one instant query per resource)."""

    def __init__(self, url: str, *, timeout: float = 5.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    async def close(self) -> None:
        pass

    @staticmethod
    def query(namespace: str, pods: Iterable[Mapping[str, Any]]) -> str:
        # Pod names are DNS names: only "." is special in a regex. PromQL strings take Go
        # escapes, so the regex's backslash is itself escaped.
        names = "|".join(pod_name(p).replace(".", "\\\\.") for p in pods) or "^$"
        metrics = "|".join(SIGNAL_METRICS)
        return f'{{__name__=~"{metrics}",namespace="{namespace}",pod=~"{names}"}}'

    async def scrape(self, namespace: str, name: str, pods: Iterable[Mapping[str, Any]],
                     errors: dict[str, str] | None = None,
                     models: dict[str, dict[str, Any]] | None = None,
                     adapters: dict[str, dict[str, Any]] | None = None) -> list[PodSignals]:
        # Prometheus carries numbers only: no model (or adapter) reports through this source.
        pods = list(pods)
        errors = {} if errors is None else errors
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session:
                async with session.get(f"{self.url}/api/v1/query",
                                       params={"query": self.query(namespace, pods), "time": str(time.time())}) as r:
                    body = await read_json_capped(r, MAX_PROMETHEUS_ANSWER_BYTES)
            if body.get("status") != "success":
                raise ValueError(body.get("error") or "query failed")
            return signals_from_prometheus(body["data"]["result"], pods)
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as error:
            errors["prometheus"] = f"{self.url}: {type(error).__name__}: {error}"
            return [PodSignals(pod_name(p), ready=pod_ready(p), stale=True) for p in pods]


async def fetch_url_signals(session: aiohttp.ClientSession, url: str, name: str) -> PodSignals:
    """Signals from an agent (`/v1/signals`) or straight from a runtime's `/metrics` (for `plan`)."""
    base = url.rstrip("/")
    if not base.endswith("/metrics"):
        target = base if base.endswith("/v1/signals") else f"{base}/v1/signals"
        async with session.get(target) as response:
            if response.status == 200:
                return PodSignals.from_json(name, await read_json_capped(response, MAX_AGENT_ANSWER_BYTES))
            if base.endswith("/v1/signals"):
                raise ValueError(f"{target}: HTTP {response.status}")
        base = f"{base}/metrics"
    async with session.get(base) as response:
        if response.status != 200:
            raise ValueError(f"{base}: HTTP {response.status}")
        text = (await read_capped(response, MAX_PROMETHEUS_ANSWER_BYTES)).decode(errors="replace")
    from kvserve.runtime.agent.signals import standardize

    sample = standardize(text)
    data = {k: v for k, v in sample.as_dict().items() if v is not None}
    if "tensor_parallel_size" in data:
        data["tensor_parallel_size"] = int(data["tensor_parallel_size"])
    return PodSignals.from_json(name, data)


class RouterDemandSource(_HttpSource):
    """Reads `GET http://<podIP>:<port>/router/demand` of every Ready router pod of a service."""

    def __init__(self, *, port: int, timeout: float = 3.0, max_answer_bytes: int = MAX_AGENT_ANSWER_BYTES):
        self.port, self.timeout, self.max_answer_bytes = port, timeout, max_answer_bytes

    async def scrape(self, pods: Iterable[Mapping[str, Any]], errors: dict[str, str] | None = None):
        from .scaletozero import aggregate_demand, parse_demand

        errors = {} if errors is None else errors
        ready = [p for p in pods if pod_ready(p) and not pod_terminating(p) and pod_ip(p)]

        async def one(pod: Mapping[str, Any]):
            url = f"http://{pod_ip(pod)}:{self.port}/router/demand"
            try:
                async with self._get_session().get(url) as response:
                    if response.status != 200:
                        raise ValueError(f"HTTP {response.status}")
                    answer = parse_demand(await read_json_capped(response, self.max_answer_bytes))
                if answer is None:
                    raise ValueError("not a router's demand answer")
                return answer
            except (TimeoutError, aiohttp.ClientError, ValueError) as error:
                errors[pod_name(pod)] = f"{url}: {type(error).__name__}: {error}"
                return None

        return aggregate_demand(len(ready), await asyncio.gather(*(one(p) for p in ready)))
