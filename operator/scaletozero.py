"""Scale to zero and back (pure): when an InferenceService with a router sleeps, and when it wakes.

The router is the only door to the pods, so it knows what the pods cannot: that requests are
waiting while no pod runs (it holds them), and how long ago the last request came. Each router
pod answers `GET /router/demand`; the operator reads them and decides here:
  * wake: the service is at 0 replicas and some router holds requests -> max(1, minReplicas);
  * sleep: minReplicas is 0, every Ready router pod answered, none holds or serves a request,
    the last request is at least scaleToZeroAfterSeconds old, the service has been up at least
    that long since it was created or woken, and no pod reports running or waiting work (a
    client that bypasses the router still counts) -> 0.
Anything unknown (a router that does not answer, no router pod ready) never puts a service to
sleep; waking needs only one router that holds a request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .autoscaler import PodSignals
from .spec import ServiceSpec

SCALE_TO_ZERO = "ScaleToZero"
WAKE_ON_DEMAND = "WakeOnDemand"


@dataclass(frozen=True)
class RouterDemand:
    routers: int = 0  # Ready router pods
    answered: int = 0  # of those, how many answered /router/demand
    held: int = 0  # requests held for a ready pod, over all routers
    in_flight: int = 0  # requests the routers are handling (held ones included)
    idle_seconds: float = 0.0  # since the most recent request at any router

    @property
    def complete(self) -> bool:
        return self.routers > 0 and self.answered == self.routers


def parse_demand(data: Any) -> dict[str, float] | None:
    """One router's answer, or None when it is not one."""
    if not isinstance(data, Mapping):
        return None
    out = {}
    for key in ("held", "in_flight", "idle_seconds"):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            return None
        out[key] = float(value)
    return out


def aggregate_demand(routers: int, answers: Iterable[Mapping[str, float] | None]) -> RouterDemand:
    good = [a for a in answers if a is not None]
    if not good:
        return RouterDemand(routers=routers)
    return RouterDemand(routers=routers, answered=len(good), held=int(sum(a["held"] for a in good)),
                        in_flight=int(sum(a["in_flight"] for a in good)),
                        idle_seconds=min(a["idle_seconds"] for a in good))


@dataclass(frozen=True)
class ZeroDecision:
    replicas: int
    reason: str
    message: str


def pods_busy(pods: Iterable[PodSignals], max_sample_age: float) -> bool:
    return any(p.fresh(max_sample_age) and (p.requests_running > 0 or p.queue_depth > 0) for p in pods)


def zero_decision(spec: ServiceSpec, replicas: int, demand: RouterDemand | None, *, busy: bool,
                  awake_seconds: float | None = None) -> ZeroDecision | None:
    """A sleep or wake decision, or None to leave the replica count to the autoscaler.

    `awake_seconds`: since the service was created or last woken; it stays up at least
    scaleToZeroAfterSeconds from then, so a pod still loading is not put to sleep before it
    could serve anyone."""
    a = spec.autoscaling
    if not (spec.router.enabled and a.enabled):
        return None
    if replicas == 0:
        if demand is not None and demand.held > 0:
            to = max(1, a.min_replicas)
            return ZeroDecision(to, WAKE_ON_DEMAND, f"{demand.held} request(s) held at the router while no pod "
                                                    f"runs; waking to {to} replica(s)")
        return None
    if a.min_replicas > 0 or demand is None or not demand.complete or busy:
        return None
    if demand.held or demand.in_flight:
        return None
    if awake_seconds is not None and awake_seconds < a.scale_to_zero_after_seconds:
        return None
    if demand.idle_seconds >= a.scale_to_zero_after_seconds:
        return ZeroDecision(0, SCALE_TO_ZERO, f"no request through the router for {demand.idle_seconds:.0f}s "
                                              f"(scaleToZeroAfterSeconds {a.scale_to_zero_after_seconds:g}); "
                                              f"{replicas} -> 0 replicas, the router holds the next requests")
    return None
