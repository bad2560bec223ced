"""The autoscaling policy for replicas and tensor-parallel degree: pure, deterministic, no I/O.

`decide(spec, shape, observation, state)` takes one scrape of every pod's agent signals plus what
earlier calls remembered (`AutoscalerState`) and returns a `Decision` with the new state. The
operator's timer calls it; tests call it with made-up observations and clocks.

Replicas follow the Kubernetes HPA's algorithm, extended with Knative's panic mode:
  * per metric, desired = ceil(total load / per-replica target) over pods with fresh signals;
    the larger of the KV-utilization and queue-depth answers wins;
  * a usage ratio within `tolerance` of 1 keeps the current size;
  * pods without fresh signals (unready, stale, not yet started) count as idle when scaling up
    and as exactly at target when scaling down, so they can never cause a scale-down;
  * every recommendation is remembered: a scale-up takes the lowest recommendation of the short
    up window, a scale-down the highest of the long down window, and only once history covers
    the whole down window (after an operator restart too);
  * panic: when the load asks for `panicThreshold` x the ready pods, scale up at once (no up
    window, step cap of doubling) and refuse to scale down until the panic window has passed;
  * a step cap per decision, then the min/max bounds.

TP (when enabled and the model's shape is known) uses `kvserve.runtime.capacity`:
  * up one valid degree when the replicas are at max and the load still asks for more, or when
    KV is saturated while few requests run (long contexts one replica at this TP cannot hold),
    either sustained for the scale-up window;
  * down one valid degree when, for the TP scale-down window, nothing queues and the KV in use
    would fit the current replicas at the lower degree under target;
  * never during a rollout, and never in the same decision as a replica change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvserve.runtime.capacity import ModelShape, dtype_bytes, plan_capacity

from .spec import ServiceSpec, dtype_for_capacity, kv_dtype_size_for_capacity, weight_format_for_capacity

DEFAULT_MAX_SAMPLE_AGE = 10.0


@dataclass(frozen=True)
class PodSignals:
    """One pod's agent answer (`GET /v1/signals`), plus whether Kubernetes calls the pod Ready."""

    name: str
    ready: bool = True
    stale: bool = False
    sample_age_seconds: float = 0.0
    kv_cache_utilization: float = 0.0
    queue_depth: float = 0.0
    requests_running: float = 0.0
    kv_cache_capacity_tokens: int = 0
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None  # kvserve's engines per pod (spec.parallelism.devicesPerPod)
    itl_seconds_sum: float = 0.0  # the engine's inter-token latency histogram totals (TPOT)
    itl_seconds_count: float = 0.0

    @classmethod
    def from_json(cls, name: str, data: Mapping[str, Any], *, pod_ready: bool = True) -> PodSignals:
        def num(key: str, default: float = 0.0) -> float:
            value = data.get(key, default)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

        tp = data.get("tensor_parallel_size")
        dp = data.get("data_parallel_size")
        return cls(
            name=name,
            ready=pod_ready and bool(data.get("ready", True)),
            stale=bool(data.get("stale", False)),
            sample_age_seconds=num("sample_age_seconds"),
            kv_cache_utilization=min(1.0, max(0.0, num("kv_cache_utilization"))),
            queue_depth=max(0.0, num("queue_depth")),
            requests_running=max(0.0, num("requests_running")),
            kv_cache_capacity_tokens=int(num("kv_cache_capacity_tokens")),
            tensor_parallel_size=int(tp) if isinstance(tp, int) and tp > 0 else None,
            data_parallel_size=int(dp) if isinstance(dp, int) and dp > 0 else None,
            itl_seconds_sum=max(0.0, num("inter_token_latency_seconds_sum")),
            itl_seconds_count=max(0.0, num("inter_token_latency_seconds_count")),
        )

    def fresh(self, max_age: float) -> bool:
        return self.ready and not self.stale and self.sample_age_seconds <= max_age


@dataclass(frozen=True)
class Observation:
    time: float  # seconds on any monotonic-enough clock; only differences matter
    replicas: int  # the size the Deployment is set to now
    tp: int  # the TP of the Deployment's pod template now
    pods: tuple[PodSignals, ...] = ()
    rollout_in_progress: bool = False  # pods from an older template still exist


@dataclass(frozen=True)
class AutoscalerState:
    recommendations: tuple[tuple[float, int], ...] = ()
    history_start: float | None = None  # first observation with data since the operator started
    panic_until: float | None = None
    tp_high_since: float | None = None
    tp_low_since: float | None = None
    last_tp_change: float | None = None


@dataclass(frozen=True)
class Signals:
    """The aggregate behind a decision (recorded in status and Events)."""

    pods: int = 0
    kv_cache_utilization: float = 0.0  # mean over fresh pods
    queue_depth: float = 0.0  # total
    requests_running: float = 0.0  # total
    # Inter-token latency (TPOT) histogram totals over the pods (seconds, tokens): the layout
    # policy takes differences between decisions (operator/layout.py).
    itl_seconds_sum: float = 0.0
    itl_seconds_count: float = 0.0

    def as_status(self) -> dict[str, Any]:
        return {"pods": self.pods, "kvCacheUtilization": round(self.kv_cache_utilization, 4),
                "queueDepth": round(self.queue_depth, 2), "requestsRunning": round(self.requests_running, 2)}


@dataclass(frozen=True)
class Decision:
    replicas: int
    tp: int
    reason: str
    message: str
    signals: Signals
    state: AutoscalerState
    metrics_available: bool = True
    limited: str | None = None  # ScalingLimited reason, None when not limited
    limited_message: str = ""
    from_replicas: int = 0
    from_tp: int = 0

    @property
    def changed(self) -> bool:
        return self.replicas != self.from_replicas or self.tp != self.from_tp


@dataclass(frozen=True)
class _Capacity:
    """KV tokens per replica at each valid TP degree, anchored on what pods report."""

    degrees: tuple[int, ...]
    tokens: Mapping[int, float] = field(default_factory=dict)


def valid_degrees(spec: ServiceSpec, shape: ModelShape) -> list[int]:
    """TP degrees the spec allows, the heads can be split by, and the GPU memory can hold."""
    dsize = dtype_bytes(dtype_for_capacity(spec))
    out = []
    for tp in shape.valid_tp_degrees(spec.tensor.max):
        if tp < spec.tensor.min:
            continue
        plan = plan_capacity(shape, dtype_size=dsize, block_size=spec.runtime.block_size, tp=tp,
                             gpu_memory_bytes=spec.gpu.memory_bytes,
                             gpu_memory_utilization=spec.runtime.gpu_memory_utilization,
                             weight_format=weight_format_for_capacity(spec, dsize),
                             kv_dtype_size=kv_dtype_size_for_capacity(spec), pp=spec.pipeline)
        if plan.fits:
            out.append(tp)
    return out


def _capacity(spec: ServiceSpec, shape: ModelShape, tp: int, observed: list[int]) -> _Capacity:
    dsize = dtype_bytes(dtype_for_capacity(spec))
    degrees = valid_degrees(spec, shape)
    model = {}
    for d in set(degrees) | {tp}:
        try:
            model[d] = plan_capacity(shape, dtype_size=dsize, block_size=spec.runtime.block_size, tp=d,
                                     gpu_memory_bytes=spec.gpu.memory_bytes,
                                     gpu_memory_utilization=spec.runtime.gpu_memory_utilization,
                                     weight_format=weight_format_for_capacity(spec, dsize),
                                     kv_dtype_size=kv_dtype_size_for_capacity(spec), pp=spec.pipeline).kv_tokens
        except ValueError:
            model[d] = 0
    # Pods know their real pool size; the model only supplies the ratio between degrees.
    anchor = sorted(observed)[len(observed) // 2] if observed else 0
    scale = anchor / model[tp] if anchor and model.get(tp) else 1.0
    return _Capacity(tuple(degrees), {d: model[d] * scale for d in model})


def aggregate(pods: Iterable[PodSignals], max_sample_age: float = DEFAULT_MAX_SAMPLE_AGE) -> Signals:
    """Mean KV utilization and totals over the pods with fresh signals."""
    return _aggregate([p for p in pods if p.fresh(max_sample_age)])


def _aggregate(fresh: list[PodSignals]) -> Signals:
    if not fresh:
        return Signals()
    return Signals(pods=len(fresh),
                   kv_cache_utilization=sum(p.kv_cache_utilization for p in fresh) / len(fresh),
                   queue_depth=sum(p.queue_depth for p in fresh),
                   requests_running=sum(p.requests_running for p in fresh),
                   itl_seconds_sum=sum(p.itl_seconds_sum for p in fresh),
                   itl_seconds_count=sum(p.itl_seconds_count for p in fresh))


def _proposal(load: float, target: float, ready: int, total: int, current: int, tolerance: float) -> int:
    """HPA's per-metric recommendation with its treatment of pods that have no fresh data."""
    ratio = load / (ready * target)
    if abs(ratio - 1.0) <= tolerance:
        return current
    missing = total - ready
    if ratio > 1.0:
        adjusted = load / (total * target)  # missing pods as idle
        if adjusted <= 1.0 + tolerance:
            return current
    else:
        adjusted = (load + missing * target) / (total * target)  # missing pods as at target
        if adjusted >= 1.0 - tolerance:
            return current
    return math.ceil(adjusted * total - 1e-9)


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def decide(spec: ServiceSpec, shape: ModelShape | None, obs: Observation, state: AutoscalerState,
           *, max_sample_age: float = DEFAULT_MAX_SAMPLE_AGE) -> Decision:
    a = spec.autoscaling
    now, cur, tp = obs.time, obs.replicas, obs.tp
    # minReplicas 0 is reached only by scale to zero (scaletozero.py, on the router's word that
    # nobody is asking); the load alone never takes a running service below one replica.
    lo, hi = (a.min_replicas if cur == 0 else max(1, a.min_replicas)), a.max_replicas
    fresh = [p for p in obs.pods if p.fresh(max_sample_age)]
    signals = _aggregate(fresh)
    base = dict(from_replicas=cur, from_tp=tp, signals=signals)

    if not fresh:
        bounded = _clamp(cur, lo, hi)
        if bounded != cur:
            return Decision(bounded, tp, "OutsideBounds", f"no fresh signals; {cur} replicas moved into "
                            f"[{lo}, {hi}]", state=state, metrics_available=False, **base)
        return Decision(cur, tp, "NoMetrics", f"no fresh signals from {len(obs.pods)} pod(s); holding "
                        f"{cur} replicas", state=state, metrics_available=False, **base)

    ready = len(fresh)
    total = max(cur, ready)
    kv_load = sum(p.kv_cache_utilization for p in fresh)
    queue = signals.queue_depth
    raw = max(_proposal(kv_load, a.target_kv_utilization, ready, total, cur, a.tolerance),
              _proposal(queue, a.target_queue_depth, ready, total, cur, a.tolerance))

    window = max(a.scale_up_window_seconds, a.scale_down_window_seconds)
    recs = tuple((t, r) for t, r in state.recommendations if t >= now - window) + ((now, raw),)
    history_start = state.history_start if state.history_start is not None else now
    panic_until = state.panic_until
    if raw > cur and raw >= a.panic_threshold * ready:
        panic_until = now + a.panic_window_seconds
    panicking = panic_until is not None and now < panic_until

    desired, reason = cur, "WithinTolerance"
    if raw > cur and cur >= hi:
        reason = "AtMaxReplicas"  # nothing to do but report it (ScalingLimited below)
    elif raw < cur and cur <= lo:
        reason = "AtMinReplicas"  # idle at the floor is the normal resting state, not a wait
    elif raw > cur:
        up_recs = [r for t, r in recs if t >= now - a.scale_up_window_seconds]
        target = raw if panicking else min(up_recs)
        step = max(a.max_scale_up_step, cur) if panicking else a.max_scale_up_step
        if target > cur:
            desired = min(target, cur + step)
            reason = "PanicScaleUp" if panicking else "ScaleUp"
        else:
            reason = "ScaleUpStabilizing"
    elif raw < cur:
        down_recs = [r for t, r in recs if t >= now - a.scale_down_window_seconds]
        if panicking:
            reason = "PanicHold"
        elif obs.rollout_in_progress:
            reason = "RolloutInProgress"
        elif now - history_start < a.scale_down_window_seconds:
            reason = "ScaleDownStabilizing"
        else:
            target = max(down_recs)
            if target < cur:
                desired = max(target, cur - a.max_scale_down_step)
                reason = "ScaleDown"
            else:
                reason = "ScaleDownStabilizing"

    limited, limited_message = None, ""
    bounded = _clamp(desired, lo, hi)
    if raw > hi and bounded >= hi:
        limited, limited_message = "TooManyReplicas", f"the load asks for {raw} replicas; maxReplicas is {hi}"
    elif raw < lo and bounded <= lo:
        limited, limited_message = "TooFewReplicas", f"the load asks for {raw} replicas; minReplicas is {lo}"
    clamp = ""
    if bounded != desired:
        # A move the bounds only shorten keeps its direction's reason; the clamp goes in the message.
        if desired > cur and bounded > cur:
            clamp = f"; clamped at maxReplicas {hi}"
        elif desired < cur and bounded < cur:
            clamp = f"; clamped at minReplicas {lo}"
        elif bounded == cur:
            reason = "AtMaxReplicas" if desired > cur else "AtMinReplicas"
        else:
            reason = "OutsideBounds"  # the bounds themselves moved (a spec edit), not the load
    desired = bounded

    new_state = replace(state, recommendations=recs, history_start=history_start,
                        panic_until=panic_until if panicking else None)
    message = (f"kv {signals.kv_cache_utilization:.2f} (target {a.target_kv_utilization:.2f}), queue "
               f"{queue:g} (target {a.target_queue_depth:g}/replica) over {ready} fresh pod(s) of {total}; "
               f"recommend {raw}{clamp}")

    decision = Decision(desired, tp, reason, message, state=new_state, limited=limited,
                        limited_message=limited_message, **base)
    # With devicesPerPod the pods' layout changes in place instead (layout.py), never by a rollout.
    if a.tensor.enabled and shape is not None and desired == cur and spec.devices_per_pod is None:
        decision = _decide_tp(spec, shape, obs, decision, fresh, raw)
    return decision


def _decide_tp(spec: ServiceSpec, shape: ModelShape, obs: Observation, decision: Decision,
               fresh: list[PodSignals], raw: int) -> Decision:
    a, ta = spec.autoscaling, spec.autoscaling.tensor
    now, tp, cur = obs.time, obs.tp, obs.replicas
    state = decision.state
    stale_tp = any(p.tensor_parallel_size not in (None, tp) for p in obs.pods)
    if obs.rollout_in_progress or stale_tp:
        return replace(decision, state=replace(state, tp_high_since=None, tp_low_since=None))
    if state.last_tp_change is not None and now - state.last_tp_change < a.scale_up_window_seconds:
        return decision

    cap = _capacity(spec, shape, tp, [p.kv_cache_capacity_tokens for p in fresh if p.kv_cache_capacity_tokens])
    higher = [d for d in cap.degrees if d > tp]
    lower = [d for d in cap.degrees if d < tp]
    s = decision.signals
    used_tokens = sum(p.kv_cache_utilization * (p.kv_cache_capacity_tokens or cap.tokens.get(tp, 0))
                      for p in fresh)
    per_request = used_tokens / s.requests_running if s.requests_running else 0.0
    demand = used_tokens + s.queue_depth * per_request
    saturated_at_max = cur >= a.max_replicas and raw > a.max_replicas
    long_context = (s.kv_cache_utilization >= ta.kv_saturation
                    and s.requests_running / len(fresh) <= ta.few_running_requests)

    if (saturated_at_max or long_context) and higher:
        since = state.tp_high_since if state.tp_high_since is not None else now
        state = replace(state, tp_high_since=since, tp_low_since=None)
        if now - since >= a.scale_up_window_seconds:
            new_tp = higher[0]
            why = ("TensorParallelUpAtMaxReplicas" if saturated_at_max else "TensorParallelUpLongContext")
            cause = (f"replicas at max ({a.max_replicas}) and still saturated" if saturated_at_max
                     else "KV saturated while few requests run")
            message = (f"{cause}; "
                       f"TP {tp} -> {new_tp} (KV tokens per replica {cap.tokens.get(tp, 0):.0f} -> "
                       f"{cap.tokens.get(new_tp, 0):.0f}); {decision.message}")
            return replace(decision, tp=new_tp, reason=why, message=message,
                           state=replace(state, tp_high_since=None, last_tp_change=now))
        return replace(decision, state=state)
    state = replace(state, tp_high_since=None)

    if lower:
        new_tp = lower[-1]
        room = a.target_kv_utilization * (1 - a.tolerance) * cur * cap.tokens.get(new_tp, 0)
        if s.queue_depth == 0 and demand <= room and not long_context:
            since = state.tp_low_since if state.tp_low_since is not None else now
            state = replace(state, tp_low_since=since)
            if now - since >= ta.scale_down_window_seconds:
                message = (f"load low for {now - since:.0f}s: {used_tokens:.0f} KV tokens in use fit "
                           f"{cur} replica(s) at TP {new_tp} under target; TP {tp} -> {new_tp}")
                return replace(decision, tp=new_tp, reason="TensorParallelDownLowLoad", message=message,
                               state=replace(state, tp_low_since=None, last_tp_change=now))
            return replace(decision, state=state)
    return replace(decision, state=replace(state, tp_low_since=None))


def hold(spec: ServiceSpec, replicas: int, tp: int) -> tuple[int, int]:
    """Replicas and TP for a reconcile outside the timer: manual size, or current within bounds."""
    if not spec.autoscaling.enabled:
        return (spec.replicas if spec.replicas is not None else max(replicas, 1)), spec.tensor.initial
    tp = tp if spec.autoscaling.tensor.enabled else spec.tensor.initial
    lo = spec.autoscaling.min_replicas if replicas == 0 else max(1, spec.autoscaling.min_replicas)
    return _clamp(replicas, lo, spec.autoscaling.max_replicas), \
        _clamp(tp, spec.tensor.min, spec.tensor.max)
