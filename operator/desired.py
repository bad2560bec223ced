"""What an InferenceService should own, computed from its spec and its recorded size: pure.

The operator has one writer for the objects it owns (handlers.Reconciler.converge). It runs
the size the resource's status records (status.desiredReplicas and status.tensorParallelSize,
written when the autoscaler or the scale-to-zero logic decides, with the decision's reason and
time in status.decisions), held within the spec's bounds, and renders every object from that.
Same input, same objects: applying them again changes nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvserve.runtime.capacity import ModelShape

from . import kvcache as K
from . import lora as L
from . import manifests as M
from . import multinode as MN
from . import netpol as N
from . import router as R
from .autoscaler import hold
from .spec import ServiceSpec


def _count(value: Any, least: int) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= least else None


def recorded_size(spec: ServiceSpec, shape: ModelShape | None, status: Mapping[str, Any] | None) -> tuple[int, int]:
    """(replicas, TP) to run: the recorded decision within the spec's bounds, the manual size
    when autoscaling is off, the initial size when nothing is recorded yet. A new service starts
    awake, even with minReplicas 0: it sleeps once it has been idle."""
    status = status or {}
    replicas = _count(status.get("desiredReplicas"), 0)
    if replicas is None:
        replicas = max(1, spec.autoscaling.min_replicas) if spec.autoscaling.enabled else (spec.replicas or 1)
    tp = _count(status.get("tensorParallelSize"), 1) or spec.tensor.initial
    if spec.devices_per_pod:
        tp = spec.tensor.initial  # the template's layout; the live one changes in place (layout.py)
    replicas, tp = hold(spec, replicas, tp)
    if shape is not None and shape.tp_error(tp):
        tp = spec.tensor.initial  # a model change made the recorded degree impossible
    return replicas, tp


def owned_objects(owner: Mapping[str, Any], spec: ServiceSpec, *, replicas: int, tp: int,
                  operator: N.OperatorPeer | None = None) -> list[dict[str, Any]]:
    """Every object the resource should own, in apply order: the NetworkPolicies first (no pod is
    ever reachable from more than they allow), the router's identity before its pods, the
    Deployment (or LeaderWorkerSet: operator/multinode.py) after the Service and PDB that select its pods."""
    objects = N.build_network_policies(owner, spec, operator)
    if spec.lora.enabled:  # before the Deployment: its pods mount it
        objects.append(L.build_configmap(owner, spec))
    if K.creates_claim(spec):  # before the Deployment: its pods mount it
        objects.append(K.build_claim(owner, spec))
    objects += [M.build_service(owner, spec), M.build_pdb(owner),
                MN.build_workload(owner, spec, replicas=replicas, tp=tp)]
    if spec.router.enabled:
        objects += R.build_router_objects(owner, spec)
    return objects


def possible_objects(name: str) -> list[tuple[str, str]]:
    """(kind, name) of everything any spec could make the resource own, in apply order: what the
    current spec does not ask for is deleted (in reverse order) when it exists and is ours. The
    offload tier's claim is not here: a persistent tier outlives a spec that stops using it (the
    API deletes it with the service)."""
    return ([("NetworkPolicy", N.runtime_policy_name(name)), ("NetworkPolicy", N.router_policy_name(name)),
             ("ConfigMap", L.configmap_name(name)), ("Service", name), ("PodDisruptionBudget", name),
             ("Deployment", name), (MN.LWS_KIND, name)]
            + [(kind, R.router_name(name)) for kind in R.ROUTER_KINDS])


def key(obj: Mapping[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def digest(obj: Mapping[str, Any]) -> str:
    """Tells two renderings of an object apart (what was applied last, what would be now)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
