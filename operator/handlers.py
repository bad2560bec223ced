"""The imperative shell: kopf handlers that reconcile InferenceServices and run the autoscaler.

Everything decided here comes from the pure modules (spec, desired, manifests, autoscaler,
status); this module only reads the cluster, applies objects, scrapes signals, writes status and
posts Events. It never writes an InferenceService's spec.

One writer per object: `Reconciler.converge` alone writes what a resource owns. It reads the
resource as it is now, renders every object from the spec and the size recorded in status
(desired.py), and server-side applies each under one field manager. The autoscale and wake
timers only decide: they record a decision in status, then call `converge`.

`build_registry(config)` returns a fresh kopf registry, so tests and `kvserve-operator run` each
get their own handlers and settings.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import kopf

from kvserve.runtime.capacity import ModelShape

from . import desired as D
from . import kvcache as K
from . import lora as L
from . import manifests as M
from . import multinode as MN
from . import netpol as N
from . import router as R
from .autoscaler import AutoscalerState, Decision, Observation, aggregate, decide
from .kube import APIError, KubeClient, NotOwned, apply, owned_by
from .metrics import OperatorMetrics
from .peering import REPEAT_SECONDS, peering_objects, watch_peering
from .reshape import converge_layouts
from .retry import handler_delay
from .scaletozero import SCALE_TO_ZERO, RouterDemand, ZeroDecision, pods_busy, zero_decision
from .sources import AgentSource, PrometheusSource, RouterDemandSource, pod_name, pod_ready, pod_terminating
from .spec import GROUP, PLURAL, VERSION, ServiceSpec, SpecError, check_name, check_servable, model_shape, parse_spec
from .status import (
    append_decision,
    condition,
    decision_record,
    degraded_conditions,
    iso,
    learned_config,
    merge_conditions,
    model_status,
    replacing,
    rollout_conditions,
    same_model,
    scaling_conditions,
    signal_fields,
    tp_note,
)

HANDLER_BACKOFF = 2.0
# Quick first retries; about a minute in all, as kopf's default, before a call gives up.
KOPF_ERROR_BACKOFFS = (0.1, 0.2, 0.5, 1, 2, 3, 5, 8, 13, 21)


@dataclass
class OperatorConfig:
    scrape_interval: float = 15.0
    scrape_timeout: float = 3.0
    scrape_concurrency: int = 16
    agent_port: int = M.AGENT_PORT
    max_sample_age: float = 10.0
    prometheus_url: str | None = None
    router_port: int = R.ROUTER_PORT  # where router pods answer /router/demand
    wake_interval: float = 2.0  # how often a service at zero asks its router whether requests wait
    connection: kopf.ConnectionInfo | None = None  # None: in-cluster service account, then KUBECONFIG
    # Not standalone: the kopf peering object's name, and where the operator serves (for the
    # missing-peering warning); None: standalone, nothing to check.
    peering_name: str | None = None
    namespaces: tuple[str, ...] = ()
    clusterwide: bool = False
    peering_check_interval: float = REPEAT_SECONDS
    # The operator's own pods, which spec.networkPolicy lets reach the agents and routers.
    operator_peer: N.OperatorPeer = field(default_factory=N.OperatorPeer)
    clock: Callable[[], float] = time.monotonic
    wallclock: Callable[[], dt.datetime] = field(default=lambda: dt.datetime.now(dt.UTC))


def read_local_config(path: str) -> Mapping[str, Any] | None:
    """config.json of a model directory the operator can see (local dev, tests), else None."""
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def read_hub_cache_config(repo: str, revision: str | None) -> Mapping[str, Any] | None:
    """config.json from a local Hugging Face cache, never the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo, "config.json", revision=revision)
    except Exception:  # a malformed repo id or cache: no shape, TP stays fixed
        return None
    return read_local_config(str(Path(found).parent)) if isinstance(found, str) else None


def shape_for(spec: ServiceSpec) -> ModelShape | None:
    """The model's shape: inline config, a local path's config.json, or the local HF cache."""
    if spec.model.config is None and spec.model.source.kind == "hf":
        config = read_hub_cache_config(spec.model.source.location, spec.model.source.revision)
        if config is not None:
            return model_shape(replace(spec, model=replace(spec.model, config=config)))
    return model_shape(spec, read_local_config)


def _memo_lock(memo: Any) -> asyncio.Lock:
    lock = getattr(memo, "kvserve_lock", None)
    if lock is None:
        lock = asyncio.Lock()
        memo.kvserve_lock = lock
    return lock


class Reconciler:
    def __init__(self, config: OperatorConfig):
        self.config = config
        self.client: KubeClient | None = None
        self.peering_task: asyncio.Task | None = None
        self.metrics = OperatorMetrics()
        self.source = (PrometheusSource(config.prometheus_url, timeout=config.scrape_timeout)
                       if config.prometheus_url else
                       AgentSource(port=config.agent_port, timeout=config.scrape_timeout,
                                   concurrency=config.scrape_concurrency))
        self.demand_source = RouterDemandSource(port=config.router_port, timeout=config.scrape_timeout)
        # What this process last applied, (uid, kind, name) -> digest, and the generation of each
        # resource's last full converge: a timer's converge skips what it would apply unchanged.
        self.applied: dict[tuple[str, str, str], str] = {}
        self.converged: dict[str, Any] = {}

    async def peering_exists(self, kind: str, namespace: str | None) -> bool:
        while self.client is None:  # startup runs before kopf's login
            await asyncio.sleep(0.2)
        return await self.client.get(kind, namespace, self.config.peering_name) is not None

    # --- reconcile ---------------------------------------------------------------------------

    def _validate(self, body: Mapping[str, Any]):
        check_name(body["metadata"]["name"])
        spec = parse_spec(body.get("spec") or {})
        learned = learned_config(body.get("status"), spec.model.uri)
        if spec.model.config is None and learned is not None:
            # What the pods' agents reported about this very model: plan TP with it.
            spec = replace(spec, model=replace(spec.model, config=dict(learned)))
        shape = shape_for(spec)
        check_servable(spec, shape)
        return spec, shape

    async def _current(self, meta) -> dict[str, Any] | None:
        """The resource as it is now (None: gone, replaced or being deleted): the handler's body
        may predate a decision a timer has recorded since."""
        current = await self.client.get("InferenceService", meta["namespace"], meta["name"])
        if (current is None or current["metadata"].get("uid") != meta["uid"]
                or current["metadata"].get("deletionTimestamp")):
            return None
        return current

    async def converge(self, current, spec: ServiceSpec, shape: ModelShape | None, *,
                       full: bool = True) -> tuple[int, int, dict[str, str]]:
        """The one writer of what `current` owns. Runs the size its status records (desired.py),
        applies every object the spec asks for and deletes those it no longer asks for; returns
        (replicas, TP, what changed). Raises NotOwned or APIError; the caller holds the lock.

        Not `full` (a timer's decision, on a generation this process has fully converged): only
        objects whose rendering differs from what this process last applied are applied, and
        nothing is looked for to delete; a size changes the Deployment alone, in 2 calls, not 11."""
        meta = current["metadata"]
        name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
        full = full or self.converged.get(uid) != meta.get("generation")
        status = current.get("status") or {}
        replicas, tp = D.recorded_size(spec, shape, status)
        if (status.get("desiredReplicas"), status.get("tensorParallelSize")) != (replicas, tp):
            # A new service, or bounds that moved: what runs is recorded before it is applied.
            await self._record_size(current, {"desiredReplicas": replicas, "tensorParallelSize": tp})
        self.metrics.observe(namespace, name, desired=replicas, tp=tp, uid=uid)
        results = {}
        wanted = D.owned_objects(current, spec, replicas=replicas, tp=tp, operator=self.config.operator_peer)
        for obj in wanted:
            if obj["kind"] == "PersistentVolumeClaim":  # a defaulted size never asks for a shrink
                obj = K.not_shrunk(obj, await self.client.get(obj["kind"], namespace, obj["metadata"]["name"]), spec)
            key, digest = (uid, *D.key(obj)), D.digest(obj)
            if not full and self.applied.get(key) == digest:
                continue
            label = self._label(obj["kind"], obj["metadata"]["name"], name)
            results[label] = await apply(self.client, MN.applied_body(obj), uid, create_with=MN.created_body(obj))
            if MN.scaled_through_subresource(obj):
                if results[label] == "created":  # at its size already; the size's owner hands over
                    await self.client.server_side_apply(MN.size_handover(obj), field_manager=MN.SIZE_MANAGER)
                else:
                    results[label] = await self._scale(obj, namespace) or results[label]
            self.applied[key] = digest
        if full:
            keep = {D.key(obj) for obj in wanted}
            for kind, obj_name in await self._owned_leftovers(meta, keep):
                await self.client.delete(kind, namespace, obj_name)
                self.applied.pop((uid, kind, obj_name), None)
                results[self._label(kind, obj_name, name)] = "deleted"
            self.converged[uid] = meta.get("generation")
        return replicas, tp, {k: v for k, v in results.items() if v != "unchanged"}

    async def _scale(self, obj: Mapping[str, Any], namespace: str) -> str | None:
        """Sets the workload's replicas through its scale subresource; "patched" when it changed."""
        kind, obj_name, replicas = obj["kind"], obj["metadata"]["name"], obj["spec"]["replicas"]
        scale = await self.client.get_scale(kind, namespace, obj_name)
        if scale is not None and (scale.get("spec") or {}).get("replicas") == replicas:
            return None
        await self.client.scale(kind, namespace, obj_name, replicas)
        return "patched"

    async def _owned_leftovers(self, meta, keep: set[tuple[str, str]]) -> list[tuple[str, str]]:
        """What the resource owns beyond `keep`, in deletion order (reverse apply order). The
        router's ServiceAccount is applied first and deleted last: without it there is no other
        router object to look for (one read, not four, for the many services without a router)."""
        name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
        candidates = [k for k in D.possible_objects(name)[::-1] if k not in keep]
        router = {(kind, R.router_name(name)) for kind in R.ROUTER_KINDS}
        if router <= set(candidates):
            account = await self.client.get("ServiceAccount", namespace, R.router_name(name))
            if account is None or not owned_by(account, uid):
                candidates = [k for k in candidates if k not in router]
        out = []
        for kind, obj_name in candidates:
            live = await self.client.get(kind, namespace, obj_name)
            if live is not None and owned_by(live, uid):
                out.append((kind, obj_name))
        return out

    @staticmethod
    def _label(kind: str, obj_name: str, name: str) -> str:
        """How Events name an object: by kind, plus its name or "router" where the kind repeats."""
        if kind == "NetworkPolicy":
            return f"NetworkPolicy {obj_name}"
        return f"router {kind}" if obj_name == R.router_name(name) else kind

    async def _record_size(self, current, fields: Mapping[str, Any]) -> None:
        """Writes `fields` (the size to run, a decision) into status before anything is applied,
        and into `current`, so the converge that follows runs it."""
        meta = current["metadata"]
        await self.client.merge_patch("InferenceService", meta["namespace"], meta["name"],
                                      {"status": json.loads(json.dumps(fields))}, status=True)
        current["status"] = {**(current.get("status") or {}), **fields}

    async def reconcile(self, body, status, patch, memo, logger, retry: int = 0) -> None:
        meta = body["metadata"]
        name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
        generation = meta.get("generation")
        now = self.config.wallclock()
        async with _memo_lock(memo):
            try:
                current = await self._current(meta)
            except APIError as error:
                raise kopf.TemporaryError(str(error), delay=handler_delay(retry)) from error
            if current is None:
                return
            generation = current["metadata"].get("generation", generation)
            try:
                spec, shape = self._validate(current)
            except SpecError as error:
                # Nothing is created (and nothing already running is touched) until it is fixed.
                patch.status["conditions"] = merge_conditions(
                    status.get("conditions"), degraded_conditions("InvalidSpec", str(error), generation), now)
                patch.status["observedGeneration"] = generation
                if memo.get("kvserve_invalid") != str(error):
                    kopf.warn(body, reason="InvalidSpec", message=str(error))
                memo["kvserve_invalid"] = str(error)
                logger.warning(f"invalid spec: {error}")
                return
            memo["kvserve_invalid"] = None
            self._report_tp_note(body, memo, tp_note(spec, shape))
            replicas, tp = await self._converge_or_degrade(body, current, spec, shape, status, patch, generation,
                                                           now, retry)
            pods = await self._pods(namespace, name)
            ready = sum(1 for p in pods if pod_ready(p))
            live_hash = M.template_hash(MN.build_workload(current, spec, replicas=replicas, tp=tp))
            rollout = any(self._pod_hash(p) != live_hash for p in pods)
            patch.status.update(self._base_status(name, namespace, generation, pods, ready))
            self.metrics.observe(namespace, name, desired=replicas, tp=tp, ready=ready, uid=uid)
            claim_conditions = await self._report_claim(body, status, memo, spec, generation)
            patch.status["conditions"] = merge_conditions(
                status.get("conditions"),
                rollout_conditions(desired=replicas, ready=ready, rollout_in_progress=rollout, generation=generation)
                + self._initial_scaling_conditions(spec, shape, status, generation) + claim_conditions,
                now)

    async def _converge_or_degrade(self, body, current, spec, shape, status, patch, generation, now,
                                   retry: int = 0, *, full: bool = True) -> tuple[int, int]:
        """`converge`, with an Event for what changed; a failure is a Degraded condition, a
        Warning and a retry (less often when the object is someone else's: a person must act)."""
        try:
            replicas, tp, changed = await self.converge(current, spec, shape, full=full)
        except NotOwned as error:
            self._degraded(body, status, patch, generation, now, "NotOwned", str(error))
            raise kopf.TemporaryError(str(error), delay=handler_delay(retry, first=5, cap=60)) from error
        except APIError as error:
            replicas, tp = D.recorded_size(spec, shape, current.get("status"))
            if error.status == 404 and MN.is_multinode(spec, tp):
                message = MN.lws_missing_message(spec, tp)
                self._degraded(body, status, patch, generation, now, "LeaderWorkerSetMissing", message)
                raise kopf.TemporaryError(message, delay=handler_delay(retry, first=30, cap=300)) from error
            self._degraded(body, status, patch, generation, now, "ApplyFailed", str(error))
            raise kopf.TemporaryError(str(error), delay=handler_delay(retry)) from error
        if changed:
            kopf.info(body, reason="Applied", message=", ".join(f"{k} {v}" for k, v in changed.items())
                      + f" ({replicas} replicas, TP {tp})")
        return replicas, tp

    async def _router_demand(self, namespace: str, name: str, errors: dict[str, str]) -> tuple[RouterDemand, int]:
        """What the service's router pods say (held requests, idle time), and how many are Ready."""
        pods = await self.client.list("Pod", namespace, M.router_selector(name))
        pods = [p for p in pods if not pod_terminating(p)]
        demand = await self.demand_source.scrape(pods, errors)
        return demand, demand.routers

    async def _record_decision(self, body, current, decision: Decision, patch_fields: Mapping[str, Any], now,
                               retry: int = 0) -> None:
        """Records a decision in status: the size to run (what `converge` applies next), the
        decision with its reason and time, and `patch_fields` (the times of a sleep or wake)."""
        status = current.get("status") or {}
        fields = {"desiredReplicas": decision.replicas, "tensorParallelSize": decision.tp,
                  "decisions": append_decision(status.get("decisions"), decision_record(decision, now)),
                  "lastScaleTime": iso(now), **patch_fields}
        try:
            await self._record_size(current, fields)
        except APIError as error:
            kopf.warn(body, reason="ScaleFailed", message=str(error))
            raise kopf.TemporaryError(str(error), delay=handler_delay(retry)) from error

    async def _sleep_or_wake(self, body, current, spec, shape, zero: ZeroDecision, replicas: int, tp: int, signals,
                             status, patch, memo, logger, now, retry: int = 0) -> None:
        """Records a sleep or wake decision, converges to it, and says so in an Event."""
        meta = current["metadata"]
        # The load history of before the sleep says nothing about after it.
        memo["kvserve_state"] = AutoscalerState()
        decision = Decision(zero.replicas, tp, zero.reason, zero.message, aggregate(signals, self.config.max_sample_age),
                            AutoscalerState(), from_replicas=replicas, from_tp=tp)
        times = {"lastScaledToZeroTime" if zero.reason == SCALE_TO_ZERO else "lastWokenTime": iso(now)}
        await self._record_decision(body, current, decision, times, now, retry)
        self.metrics.decision(meta["namespace"], meta["name"], zero.reason, uid=meta["uid"])
        kopf.info(body, reason=zero.reason, message=f"replicas {replicas} -> {zero.replicas}: {zero.message}")
        logger.info(f"{zero.reason}: replicas {replicas} -> {zero.replicas}: {zero.message}")
        await self._converge_or_degrade(body, current, spec, shape, status, patch, meta.get("generation"), now, retry,
                                        full=False)

    async def wake(self, body, status, patch, memo, logger, retry: int = 0) -> None:
        """The fast path out of zero: a short timer that only asks the router whether requests wait."""
        meta = body["metadata"]
        try:
            spec = parse_spec(body.get("spec") or {})
        except SpecError:
            return
        if not spec.router.enabled or meta.get("deletionTimestamp"):
            return
        async with _memo_lock(memo):
            current = await self._current(meta)
            if current is None:
                return
            try:
                spec, shape = self._validate(current)
            except SpecError:
                return
            replicas, tp = D.recorded_size(spec, shape, current.get("status"))
            if replicas != 0 or not spec.router.enabled:
                return
            errors: dict[str, str] = {}
            demand, routers = await self._router_demand(meta["namespace"], meta["name"], errors)
            patch.status["router"] = {"readyReplicas": routers, "heldRequests": demand.held}
            zero = zero_decision(spec, 0, demand, busy=False)
            if zero is not None:
                await self._sleep_or_wake(body, current, spec, shape, zero, 0, tp, [], status, patch, memo, logger,
                                          self.config.wallclock(), retry)

    @staticmethod
    def _report_tp_note(body, memo, note: str) -> None:
        """One Warning when TP autoscaling is enabled but cannot plan (no model shape)."""
        if note and memo.get("kvserve_tp_note") != note:
            kopf.warn(body, reason="TensorParallelUnplanned", message=note)
        memo["kvserve_tp_note"] = note

    @staticmethod
    def _initial_scaling_conditions(spec, shape, status, generation) -> list[dict[str, Any]]:
        """Scaling conditions belong to the timer; reconcile only fills them in when absent or off."""
        if not spec.autoscaling.enabled:
            return scaling_conditions(None, enabled=False, generation=generation)
        known = {c.get("type"): c for c in status.get("conditions") or []}
        active = known.get("ScalingActive")
        if active is None or active.get("reason") in ("AutoscalingDisabled", "InvalidSpec"):
            return scaling_conditions(None, enabled=True, generation=generation, note=tp_note(spec, shape))
        return []

    def _degraded(self, body, status, patch, generation, now, reason, message) -> None:
        patch.status["conditions"] = merge_conditions(
            status.get("conditions"), degraded_conditions(reason, message, generation), now)
        kopf.warn(body, reason=reason, message=message)

    @staticmethod
    def _pod_hash(pod: Mapping[str, Any]) -> str | None:
        return ((pod.get("metadata") or {}).get("annotations") or {}).get(M.HASH_ANNOTATION)

    async def _pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        pods = await self.client.list("Pod", namespace, M.selector_labels(name))
        # A LeaderWorkerSet group is one replica: its leader serves, scrapes and counts.
        return [p for p in pods if not pod_terminating(p) and MN.serving_pod(p)]

    @staticmethod
    def _base_status(name, namespace, generation, pods, ready) -> dict[str, Any]:
        """What the handlers report through their status patch. Not the size: desiredReplicas
        and tensorParallelSize are written only under the lock, before the size is applied."""
        return {"observedGeneration": generation, "replicas": len(pods), "readyReplicas": ready,
                "selector": M.selector_string(name), "url": M.service_url(name, namespace)}

    # --- autoscaling timer -----------------------------------------------------------------------

    async def autoscale(self, body, status, patch, memo, logger, retry: int = 0) -> None:
        meta = body["metadata"]
        name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
        generation = meta.get("generation")
        try:
            self._validate(body)
        except SpecError as error:
            # Re-assert what the reconcile handler reported (without another Event): a timer run
            # that started on the previous body may have just written healthy conditions.
            patch.status["conditions"] = merge_conditions(
                status.get("conditions"), degraded_conditions("InvalidSpec", str(error), generation),
                self.config.wallclock())
            return
        if meta.get("deletionTimestamp"):
            return
        async with _memo_lock(memo):
            now = self.config.wallclock()
            current = await self._current(meta)
            if current is None:
                return  # an old body of a resource that is gone or being deleted now
            try:
                spec, shape = self._validate(current)
            except SpecError:
                return  # the reconcile handler reports it
            generation = current["metadata"].get("generation", generation)
            replicas, tp = D.recorded_size(spec, shape, current.get("status"))
            want = MN.build_workload(current, spec, replicas=replicas, tp=tp)
            live = await self.client.get(want["kind"], namespace, name)
            if not self._runs(live, want, uid):
                # Deleted or edited behind the operator's back, or an apply that failed after its
                # decision was recorded: converge (level-triggered) before deciding anything.
                replicas, tp = await self._converge_or_degrade(body, current, spec, shape, status, patch,
                                                               generation, now, retry)
                return
            pods = await self._pods(namespace, name)
            current_hash = M.template_hash(want)
            rollout = any(self._pod_hash(p) != current_hash for p in pods)
            errors: dict[str, str] = {}
            models: dict[str, dict[str, Any]] = {}
            adapters: dict[str, dict[str, Any]] = {}
            signals = await self.source.scrape(namespace, name, pods, errors, models, adapters=adapters)
            self._learn_model(body, status, patch, spec, pods, models, current_hash, now)
            adapter_conditions = self._report_adapters(body, status, patch, memo, spec, adapters, generation)

            decision: Decision | None = None
            zero = None
            if spec.router.enabled:
                demand, routers = await self._router_demand(namespace, name, errors)
                patch.status["router"] = {"readyReplicas": routers, "heldRequests": demand.held}
                zero = zero_decision(spec, replicas, demand, busy=pods_busy(signals, self.config.max_sample_age),
                                     awake_seconds=awake_seconds(current, current.get("status") or {}, now))
            elif status.get("router"):
                patch.status["router"] = None
            self._report_scrape_errors(body, memo, errors)
            if zero is not None:
                await self._sleep_or_wake(body, current, spec, shape, zero, replicas, tp, signals, status, patch,
                                          memo, logger, now, retry)
                replicas = zero.replicas
            elif spec.autoscaling.enabled:
                obs = Observation(time=self.config.clock(), replicas=replicas, tp=tp, pods=tuple(signals),
                                  rollout_in_progress=rollout)
                decision = decide(spec, shape, obs, memo.get("kvserve_state") or AutoscalerState(),
                                  max_sample_age=self.config.max_sample_age)
                memo["kvserve_state"] = decision.state
                if decision.changed:
                    await self._record_decision(body, current, decision, {}, now, retry)
                    self.metrics.decision(namespace, name, decision.reason, uid=uid)
                    kopf.info(body, reason=decision.reason,
                              message=f"replicas {decision.from_replicas} -> {decision.replicas}, TP "
                                      f"{decision.from_tp} -> {decision.tp}: {decision.message}")
                    logger.info(f"{decision.reason}: replicas {decision.from_replicas} -> {decision.replicas}, "
                                f"TP {decision.from_tp} -> {decision.tp}")
                    replicas, tp = await self._converge_or_degrade(body, current, spec, shape, status, patch,
                                                                   generation, now, retry, full=False)
                self._report_limits(body, status, decision)
                if spec.devices_per_pod:  # each pod's DP x TP, changed in place (layout.py, reshape.py)
                    await converge_layouts(self, body, current, spec, shape, pods, signals, memo, patch, logger)
            ready = sum(1 for p in pods if pod_ready(p))
            patch.status.update(self._base_status(name, namespace, generation, pods, ready))
            self.metrics.observe(namespace, name, desired=replicas, tp=tp, ready=ready, uid=uid)
            patch.status.update(signal_fields(aggregate(signals, self.config.max_sample_age)))
            adapter_conditions += await self._report_claim(body, status, memo, spec, generation)
            patch.status["conditions"] = merge_conditions(
                status.get("conditions"),
                rollout_conditions(desired=replicas, ready=ready, rollout_in_progress=rollout, generation=generation)
                + (scaling_conditions(decision, enabled=spec.autoscaling.enabled, generation=generation,
                                      note=tp_note(spec, shape)) if zero is None else [])
                + adapter_conditions,
                now)

    @staticmethod
    def _runs(live: Mapping[str, Any] | None, want: Mapping[str, Any], uid: str) -> bool:
        """Whether the live Deployment is this resource's and runs the size and template wanted."""
        return (live is not None and owned_by(live, uid)
                and (live.get("spec") or {}).get("replicas") == want["spec"]["replicas"]
                and M.template_hash(live) == M.template_hash(want))

    def _learn_model(self, body, status, patch, spec, pods, models, current_hash, now) -> None:
        """Records in status.model what a pod of the current template reports about its model
        (the next runs plan TP with its config when the spec has none), with one Event."""
        current = sorted(pod_name(p) for p in pods if self._pod_hash(p) == current_hash and pod_name(p) in models)
        if not current:
            return
        record = model_status(models[current[0]], uri=spec.model.uri, pod=current[0], now=now)
        previous = status.get("model")
        if same_model(previous, record):
            return
        patch.status["model"] = replacing(previous, record)
        shape = ("TP planning uses its config" if "config" in record else
                 f"its shape cannot be read ({record.get('shapeError')}); TP stays fixed")
        weights = record.get("weightBytes")
        kopf.info(body, reason="ModelLearned", message=(
            f"pod {current[0]} serves {record.get('architecture') or record.get('modelType') or 'a model'}: "
            f"{record.get('numLayers')} layers, {record.get('numAttentionHeads')} heads / "
            f"{record.get('numKeyValueHeads')} KV heads, head dim {record.get('headDim')}, "
            f"{record.get('dtype')}{', ' + record['quantization'] if record.get('quantization') else ''}"
            f"{f', {weights / 1e9:.2f} GB of weights' if isinstance(weights, int) else ''}; {shape}"))

    @staticmethod
    def _report_adapters(body, status, patch, memo, spec, reports, generation) -> list[dict[str, Any]]:
        """status.adapters (per pod), the AdaptersReady condition, and one Warning per adapter as it
        fails (operator/lora.py). Returns the condition to merge (none without LoRA)."""
        fields = None
        if spec.lora.enabled:
            entries = L.adapters_status(reports)
            patch.status["adapters"] = entries
            fields = L.condition_fields(spec, entries)
            failed = L.failures(entries)
            previous = memo.get("kvserve_adapter_failures") or {}
            for adapter, message in sorted(failed.items()):
                if previous.get(adapter) != message:
                    kopf.warn(body, reason="AdapterFailed", message=f"adapter {adapter}: {message}")
            memo["kvserve_adapter_failures"] = failed
        elif status.get("adapters"):
            patch.status["adapters"] = None
        if fields is None:
            if any(c.get("type") == L.CONDITION for c in status.get("conditions") or []):
                return [condition(L.CONDITION, True, "LoRADisabled", "spec.adapters lists none", generation)]
            return []
        return [condition(L.CONDITION, fields[0], fields[1], fields[2], generation)]

    async def _report_claim(self, body, status, memo, spec, generation) -> list[dict[str, Any]]:
        """The KVOffloadClaimBound condition (read on every reconcile and timer run: a claim binds,
        or fails to, after it is created), and a Warning when the claim stops being bound."""
        meta = body["metadata"]
        claim = K.offload_claim(spec, meta["name"])
        if claim is None:
            if any(c.get("type") == K.CLAIM_CONDITION for c in status.get("conditions") or []):
                return [condition(K.CLAIM_CONDITION, True, "NoClaim", "the offload tier is not on a claim", generation)]
            return []
        try:
            live = await self.client.get("PersistentVolumeClaim", meta["namespace"], claim)
        except APIError:
            return []  # unknown this time: the condition stays as it was
        bound, reason, message, warn = K.claim_condition(spec, meta["name"], live, self.config.wallclock())
        if warn and memo.get("kvserve_claim") != message:
            kopf.warn(body, reason="KVOffloadClaimNotBound", message=message)
            memo["kvserve_claim"] = message
        elif bound:
            memo["kvserve_claim"] = None
        return [condition(K.CLAIM_CONDITION, bound, reason, message, generation)]

    @staticmethod
    def _report_scrape_errors(body, memo, errors: dict[str, str]) -> None:
        previous = memo.get("kvserve_scrape_errors") or {}
        for pod, error in errors.items():
            if pod not in previous:
                kopf.warn(body, reason="ScrapeFailed", message=error)
        memo["kvserve_scrape_errors"] = errors

    @staticmethod
    def _report_limits(body, status, decision: Decision) -> None:
        """One Warning as the load starts to want more than maxReplicas; resting at minReplicas is
        normal (the condition says so, no Event)."""
        before = {c.get("type"): c for c in status.get("conditions") or []}.get("ScalingLimited") or {}
        if decision.limited == "TooManyReplicas" and (before.get("status") != "True"
                                                     or before.get("reason") != decision.limited):
            kopf.warn(body, reason=decision.limited, message=decision.limited_message)

    async def write_status(self, body, patch) -> None:
        """Sends `patch`'s status (if any) as a merge patch of the status subresource, then
        removes it from `patch`. A resource that is gone needs no status."""
        new = patch.get("status")
        if not new:
            return
        meta = body["metadata"]
        payload = {"status": json.loads(json.dumps(new))}
        del patch["status"]
        try:
            await self.client.merge_patch("InferenceService", meta["namespace"], meta["name"], payload, status=True)
        except APIError as error:
            if error.status != 404:
                raise

    # --- deletion ------------------------------------------------------------------------------

    async def delete(self, body, logger, retry: int = 0) -> None:
        """Deletes what this resource owns (a real cluster's garbage collector would too), in
        reverse apply order: pods go before the policies that guard them."""
        meta = body["metadata"]
        name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
        try:
            for kind, obj_name in await self._owned_leftovers(meta, keep=set()):
                await self.client.delete(kind, namespace, obj_name)
                logger.info(f"deleted {kind} {namespace}/{obj_name}")
        except APIError as error:
            # The finalizer stays until every owned object is gone; try again in seconds.
            raise kopf.TemporaryError(str(error), delay=handler_delay(retry)) from error
        self.converged.pop(uid, None)
        self.applied = {k: v for k, v in self.applied.items() if k[0] != uid}
        self.metrics.forget(namespace, name, uid)


def awake_seconds(body: Mapping[str, Any], status: Mapping[str, Any], now: dt.datetime) -> float | None:
    """Seconds since the resource was created or last woken from zero (None: unknown)."""
    times = [t for t in (status.get("lastWokenTime"), body["metadata"].get("creationTimestamp")) if t]
    parsed = []
    for t in times:
        try:
            parsed.append(dt.datetime.fromisoformat(str(t).replace("Z", "+00:00")))
        except ValueError:
            continue
    return (now - max(parsed)).total_seconds() if parsed else None


def _drop_unchanged_status(patch: Any, status: Mapping[str, Any]) -> None:
    """Keep only status fields that change: a steady resource costs no API writes per tick."""
    new = patch.get("status")
    if not new:
        return
    for key in [k for k, v in new.items() if status.get(k) == v]:
        del new[key]
    if not new:
        del patch["status"]


def build_registry(config: OperatorConfig | None = None) -> tuple[kopf.OperatorRegistry, Reconciler]:
    config = config or OperatorConfig()
    registry = kopf.OperatorRegistry()
    reconciler = Reconciler(config)
    resource = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_):
        settings.posting.loggers = False  # Events come from explicit kopf.info/warn calls only
        settings.posting.reporting_component = "kvserve-operator"
        settings.persistence.finalizer = "kvserve.dev/operator"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvserve.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="kvserve.dev", key="last-handled-configuration")
        settings.watching.server_timeout = 120
        # A deletion waits for a running autoscale timer to exit; look again every second, not
        # every minute (kopf's default), so deleting a resource is not held up for a minute.
        settings.background.cancellation_polling = 1
        # kopf's own calls (watches, status and finalizer patches, Events) retry 5xx and 429 by
        # themselves; start in fractions of a second instead of kopf's 1, 1, 2, 3, 5 ... 21 s.
        settings.networking.error_backoffs = KOPF_ERROR_BACKOFFS
        settings.networking.request_timeout = 30

    @kopf.on.login(registry=registry)
    async def login(**kwargs):
        info = (config.connection or kopf.login_with_service_account(**kwargs)
                or kopf.login_with_kubeconfig(**kwargs))
        if info is None:
            raise kopf.LoginError("no in-cluster service account and no KUBECONFIG or ~/.kube/config")
        # kopf logs in again when its credentials stop working (a rotated token): follow it.
        previous, reconciler.client = reconciler.client, KubeClient(info)
        if previous is not None:
            asyncio.get_running_loop().create_task(previous.close())
        return info

    @kopf.on.startup(registry=registry)
    async def start_peering_watch(**_):
        targets = peering_objects(config.peering_name or "", config.namespaces, config.clusterwide)
        if config.peering_name and targets:
            reconciler.peering_task = asyncio.get_running_loop().create_task(watch_peering(
                reconciler.peering_exists, config.peering_name, targets, interval=config.peering_check_interval))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_):
        if reconciler.peering_task is not None:
            reconciler.peering_task.cancel()
        if reconciler.client is not None:
            await reconciler.client.close()
        await reconciler.source.close()
        await reconciler.demand_source.close()

    async def counted(step, body, status, patch, memo, logger, retry, *, own_status=False):
        """Runs a reconcile or autoscale step: its failures are counted, and status fields it
        left unchanged are not written. With `own_status`, the status is written here, through
        the operator's retrying client, and kopf is left nothing to patch."""
        try:
            await step(body, status, patch, memo, logger, retry)
        except Exception:
            meta = body["metadata"]
            reconciler.metrics.error(meta["namespace"], meta["name"], meta.get("uid"))
            raise
        finally:
            _drop_unchanged_status(patch, status)
            if own_status:
                await reconciler.write_status(body, patch)

    # `backoff`: an unexpected error (not a kopf.TemporaryError with its own delay) is retried
    # in seconds, not after kopf's default minute.
    @kopf.on.create(**resource, id="reconcile", backoff=HANDLER_BACKOFF)
    @kopf.on.update(**resource, id="reconcile", field="spec", backoff=HANDLER_BACKOFF)
    @kopf.on.resume(**resource, id="reconcile", backoff=HANDLER_BACKOFF)
    async def reconcile(body, status, patch, memo, logger, retry, **_):
        await counted(reconciler.reconcile, body, status, patch, memo, logger, retry)

    @kopf.on.delete(**resource, id="cleanup", backoff=HANDLER_BACKOFF)
    async def delete(body, logger, retry, **_):
        await reconciler.delete(body, logger, retry)

    @kopf.timer(**resource, id="autoscale", interval=config.scrape_interval,
                initial_delay=config.scrape_interval, backoff=HANDLER_BACKOFF)
    async def autoscale(body, status, patch, memo, logger, retry, **_):
        # A failed patch after a timer run ends kopf's timer for good (kopf 1.45 lets the
        # error kill the timer's task): this handler writes its own status, with retries.
        await counted(reconciler.autoscale, body, status, patch, memo, logger, retry, own_status=True)

    def sleeping(spec, status, **_) -> bool:
        return bool((spec or {}).get("router", {}).get("enabled")) and (status or {}).get("desiredReplicas") == 0

    @kopf.timer(**resource, id="wake", interval=config.wake_interval, when=sleeping, backoff=HANDLER_BACKOFF)
    async def wake(body, status, patch, memo, logger, retry, **_):
        await counted(reconciler.wake, body, status, patch, memo, logger, retry, own_status=True)

    return registry, reconciler
