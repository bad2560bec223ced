"""Each pod's load as its agent reports it (`/v1/signals`), or read off the runtime's `/metrics`.

Polled on an interval; a pod whose answer is older than `stale_after` counts as unknown (the
policy then relies on the router's own in-flight count). Parsing is pure (`load_from_signals`,
`load_from_metrics`); the poller is the I/O around it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from .bodies import METRICS_LIMIT, SIGNALS_LIMIT, TooLong, read_capped
from .endpoints import Endpoint
from .policy import EndpointLoad


@dataclass(frozen=True)
class Sample:
    running: float
    queue_depth: float
    kv_cache_utilization: float
    ok: bool  # the agent says its engine sample is fresh and the engine ready
    at: float
    adapters: frozenset[str] = frozenset()  # LoRA adapters the pod has loaded (affinity)


def _num(data: Mapping[str, Any], key: str) -> float:
    value = data.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


# A pod holds at most --max-cpu-loras adapters; a longer list is a broken or hostile answer, and
# keeping it would grow the router's memory per pod.
MAX_ADAPTERS = 1024


def _adapters(value: Any) -> frozenset[str]:
    if not isinstance(value, list):
        return frozenset()
    return frozenset(v for v in value[:MAX_ADAPTERS] if isinstance(v, str) and 0 < len(v) <= 256)


def load_from_signals(data: Mapping[str, Any], at: float) -> Sample:
    return Sample(running=max(0.0, _num(data, "requests_running")), queue_depth=max(0.0, _num(data, "queue_depth")),
                  kv_cache_utilization=min(1.0, max(0.0, _num(data, "kv_cache_utilization"))),
                  ok=not data.get("stale", False) and data.get("ready", True) is not False, at=at,
                  adapters=_adapters(data.get("lora_adapters")))


def load_from_metrics(text: str, at: float) -> Sample:
    from kvserve.runtime.agent.signals import standardize

    s = standardize(text)
    return Sample(running=s.requests_running or 0.0, queue_depth=s.queue_depth or 0.0,
                  kv_cache_utilization=min(1.0, max(0.0, s.kv_cache_utilization or 0.0)), ok=True, at=at,
                  adapters=_adapters(list(s.lora_adapters or ())))


def current_load(sample: Sample | None, in_flight: int, now: float, stale_after: float,
                 own_at_sample: float | None = None) -> EndpointLoad:
    if sample is None or not sample.ok or now - sample.at > stale_after:
        return EndpointLoad(in_flight=in_flight)
    return EndpointLoad(in_flight=in_flight, running=sample.running, queue_depth=sample.queue_depth,
                        kv_cache_utilization=sample.kv_cache_utilization, fresh=True, own_at_sample=own_at_sample)


class LoadPoller:
    def __init__(self, *, interval: float = 1.0, timeout: float = 1.0, stale_after: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.interval, self.timeout, self.stale_after, self.clock = interval, timeout, stale_after, clock
        self.samples: dict[str, Sample] = {}
        self.errors: dict[str, str] = {}
        # This router's requests open to each pod (the router's own counter, read at each answer),
        # the most of them open since the pod's previous answer, and that peak as of its last
        # answer: what the sample may count of this router's own (EndpointLoad.own_at_sample).
        self.in_flight: Mapping[str, int] | None = None  # None: the agent's counts are taken as they are
        self._peak: dict[str, int] = {}
        self._own: dict[str, int] = {}

    def load(self, name: str, in_flight: int) -> EndpointLoad:
        return current_load(self.samples.get(name), in_flight, self.clock(), self.stale_after,
                            self._own.get(name, 0) if self.in_flight is not None else None)

    def sent(self, name: str, in_flight: int) -> None:
        """This router opened a request to the pod (`in_flight` now open)."""
        self._peak[name] = max(self._peak.get(name, 0), in_flight)

    def _answered(self, name: str) -> None:
        # The window of the next answer starts with what is open now.
        if self.in_flight is None:
            return
        now = self.in_flight.get(name, 0)
        self._own[name] = max(self._peak.get(name, 0), now)
        self._peak[name] = now

    def adapters(self) -> dict[str, frozenset[str]]:
        """pod -> the LoRA adapters its last answer listed. Not aged out like the load: a pod's
        adapters change only when the operator loads or unloads one, and a pod that went away
        leaves with its sample."""
        return {name: s.adapters for name, s in self.samples.items() if s.adapters}

    async def poll_once(self, session: aiohttp.ClientSession, endpoints: Iterable[Endpoint]) -> None:
        endpoints = [e for e in endpoints if e.signals_url]

        async def one(e: Endpoint) -> None:
            try:
                async with session.get(e.signals_url, timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                    if r.status != 200:
                        raise ValueError(f"HTTP {r.status}")
                    if e.signals_url.endswith("/metrics"):
                        text = (await read_capped(r.content, METRICS_LIMIT)).decode("utf-8", "replace")
                        sample = load_from_metrics(text, self.clock())
                    else:
                        data = json.loads(await read_capped(r.content, SIGNALS_LIMIT))
                        if not isinstance(data, dict):
                            raise ValueError("not a JSON object")
                        sample = load_from_signals(data, self.clock())
                self.samples[e.name] = sample
                self._answered(e.name)
                self.errors.pop(e.name, None)
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError, RecursionError, TooLong) as error:
                self.errors[e.name] = f"{e.signals_url}: {type(error).__name__}: {error}"

        await asyncio.gather(*(one(e) for e in endpoints))
        names = {e.name for e in endpoints}
        for gone in [n for n in self.samples if n not in names]:
            del self.samples[gone]

        for gone in [n for n in self.errors if n not in names]:
            del self.errors[gone]
        for gone in [n for n in (*self._peak, *self._own) if n not in names]:
            self._peak.pop(gone, None)
            self._own.pop(gone, None)

    async def run(self, session: aiohttp.ClientSession, endpoints: Callable[[], list[Endpoint]]) -> None:
        while True:
            started = self.clock()
            await self.poll_once(session, endpoints())
            await asyncio.sleep(max(0.05, self.interval - (self.clock() - started)))
