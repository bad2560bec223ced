"""The pod-side pieces of the KV cache beyond the pool (pure): the offload tier of
spec.runtime.kvOffload (flags, volume, mount, memory request, and the claim the operator creates
for medium pvc with a storageClassName) and the KV events the pods publish for the router when it
ranks them by the blocks they hold (spec.router, prefix policy).

manifests.py, router.py and netpol.py call these; nothing here talks to the API.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from .spec import ServiceSpec, parse_quantity

OFFLOAD_DIR = "/kv-offload"
OFFLOAD_VOLUME = "kv-offload"
# vLLM's default KV events ports: the publisher, and its replay socket on the next one.
EVENTS_PORT = 5557
EVENTS_REPLAY_PORT = EVENTS_PORT + 1
EVENTS_PORT_ANNOTATION = "kvserve.dev/kv-events-port"  # what the router reads (runtime/router/endpoints.py)


def _ranks(spec: ServiceSpec, tp: int) -> int:
    # The tier is per rank: a pod of G devices runs G ranks whatever its DP x TP layout.
    return spec.devices_per_pod or tp


def offload_pod_bytes(spec: ServiceSpec, tp: int) -> int:
    """What the tier takes in one pod: its size per rank times the pod's ranks (0: no tier)."""
    k = spec.runtime.kv_offload
    return 0 if k is None else k.size_bytes * _ranks(spec, tp)


# Disk the file tier takes beyond its budget, per rank: the writer's one file in flight (a block,
# under this for any model a pod serves) and the per-file header and filesystem block rounding
# (about 4 KiB a file, a few percent for the smallest blocks).
OFFLOAD_FILE_HEADROOM_PER_RANK = 64 * 1024**2
OFFLOAD_FILE_HEADROOM_FRACTION = 16  # 1/16 of the tier


def offload_volume_bytes(spec: ServiceSpec, tp: int) -> int:
    """The emptyDir sizeLimit of a file tier: the kubelet evicts a pod past it, so the tier's
    budget plus what files cost beyond their payload (0: no tier)."""
    tier = offload_pod_bytes(spec, tp)
    if tier == 0:
        return 0
    return tier + tier // OFFLOAD_FILE_HEADROOM_FRACTION + _ranks(spec, tp) * OFFLOAD_FILE_HEADROOM_PER_RANK


# -- the offload tier ----------------------------------------------------------------------------
def runtime_args(spec: ServiceSpec) -> list[str]:
    out: list[str] = []
    k = spec.runtime.kv_offload
    if k is not None:
        out += ["--kv-offload-bytes", str(k.size_bytes)]
        if k.medium != "memory":
            out += ["--kv-offload-dir", OFFLOAD_DIR]
    if events_on(spec):
        out += ["--kv-events-config", events_config()]
    return out


def volumes(spec: ServiceSpec, tp: int, name: str) -> list[dict[str, Any]]:
    k = spec.runtime.kv_offload
    if k is None or k.medium == "memory":
        return []
    if k.medium == "pvc":
        claim = claim_name(name) if creates_claim(spec) else k.claim_name
        return [{"name": OFFLOAD_VOLUME, "persistentVolumeClaim": {"claimName": claim}}]
    return [{"name": OFFLOAD_VOLUME, "emptyDir": {"sizeLimit": str(offload_volume_bytes(spec, tp))}}]


# -- the claim the operator creates (medium pvc with storageClassName) ----------------------------
def claim_name(name: str) -> str:
    return f"{name}-kv-offload"


def creates_claim(spec: ServiceSpec) -> bool:
    k = spec.runtime.kv_offload
    return k is not None and k.medium == "pvc" and k.storage_class_name is not None


def default_claim_bytes(spec: ServiceSpec) -> int:
    """The created claim's size when claimSize is not given: what every pod's file tier takes on
    disk (offload_volume_bytes) at the largest size the spec lets the service reach (the
    autoscaler's maxReplicas, else replicas; parallelism.devicesPerPod, else tensor.max ranks a
    pod), rounded up to a GiB. The pods share the directory, each within its own budget."""
    pods = spec.autoscaling.max_replicas if spec.autoscaling.enabled else max(1, spec.replicas or 1)
    ranks = spec.devices_per_pod or spec.tensor.max
    total = offload_volume_bytes(spec, ranks) * pods
    return -(-total // 1024**3) * 1024**3


def claim_bytes(spec: ServiceSpec) -> int:
    k = spec.runtime.kv_offload
    return k.claim_size if k.claim_size is not None else default_claim_bytes(spec)


def not_shrunk(claim: dict[str, Any], live: Mapping[str, Any] | None, spec: ServiceSpec) -> dict[str, Any]:
    """A created claim whose size is the default is never rendered smaller than it is: lowering
    maxReplicas (or the TP bound) must not ask the API for a shrink it refuses. A claimSize the
    user gave is rendered as given (a shrink is then refused, and says so)."""
    if live is None or spec.runtime.kv_offload.claim_size is not None:
        return claim
    try:
        current = parse_quantity(live["spec"]["resources"]["requests"]["storage"], "storage")
    except (KeyError, TypeError, ValueError):
        return claim
    want = int(claim["spec"]["resources"]["requests"]["storage"])
    if current <= want:
        return claim
    spec_out = {**claim["spec"], "resources": {"requests": {"storage": str(current)}}}
    return {**claim, "spec": spec_out}


def offload_claim(spec: ServiceSpec, name: str) -> str | None:
    """The claim the pods' file tier is on (created or existing), or None."""
    k = spec.runtime.kv_offload
    if k is None or k.medium != "pvc":
        return None
    return claim_name(name) if creates_claim(spec) else k.claim_name


CLAIM_CONDITION = "KVOffloadClaimBound"
# A claim of a WaitForFirstConsumer StorageClass stays Pending until its first pod is scheduled:
# only a claim pending longer than this is warned about (the condition says Pending at once).
CLAIM_PENDING_GRACE_S = 120.0


def claim_condition(spec: ServiceSpec, name: str, live: Mapping[str, Any] | None,
                    now: dt.datetime | None = None) -> tuple[bool, str, str, bool] | None:
    """(status, reason, message, warn) of the KVOffloadClaimBound condition; None without a claim.
    A claim that is not Bound keeps every pod that mounts it from starting (Pending), so it is said
    here rather than only in the pods' events; `warn`: worth a Warning Event now."""
    claim = offload_claim(spec, name)
    if claim is None:
        return None
    if live is None:
        return (False, "ClaimNotFound",
                f"PersistentVolumeClaim {claim} does not exist: the pods that mount it cannot start", True)
    phase = (live.get("status") or {}).get("phase") or "Pending"
    if phase == "Bound":
        return True, "Bound", f"PersistentVolumeClaim {claim} is bound", False
    spec_ = live.get("spec") or {}
    hint = ""
    if spec_.get("storageClassName"):
        hint = (f" (StorageClass {spec_['storageClassName']!r}: does it exist, and can it provision "
                f"{(spec_.get('accessModes') or ['?'])[0]}?)")
    age = _age_seconds(live, now)
    warn = phase != "Pending" or age is None or age >= CLAIM_PENDING_GRACE_S
    return (False, f"Claim{phase}",
            f"PersistentVolumeClaim {claim} is {phase}, not bound to a volume{hint}: the pods that mount it "
            "cannot start", warn)


def _age_seconds(obj: Mapping[str, Any], now: dt.datetime | None) -> float | None:
    created = (obj.get("metadata") or {}).get("creationTimestamp")
    if now is None or not isinstance(created, str):
        return None
    try:
        when = dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return (now - when).total_seconds()


def build_claim(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    """The PersistentVolumeClaim of a file tier on a claim the operator creates. Owned by the
    InferenceService, so the API deletes it with the service (and the kubelet's PVC protection
    not before its last pod stops); the operator itself never deletes it (desired.py leaves it
    out of the kinds it cleans up): turning the tier off keeps the prefixes."""
    from .manifests import _metadata

    k = spec.runtime.kv_offload
    name, namespace = owner["metadata"]["name"], owner["metadata"].get("namespace", "default")
    meta = _metadata(name, namespace, owner)
    meta["name"] = claim_name(name)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta,
            "spec": {"accessModes": [k.access_mode], "storageClassName": k.storage_class_name,
                     "resources": {"requests": {"storage": str(claim_bytes(spec))}}}}


def runtime_mounts(spec: ServiceSpec) -> list[dict[str, Any]]:
    k = spec.runtime.kv_offload
    if k is None or k.medium == "memory":
        return []
    return [{"name": OFFLOAD_VOLUME, "mountPath": OFFLOAD_DIR}]


def with_offload_memory(resources: Mapping[str, Any], spec: ServiceSpec, tp: int) -> dict[str, Any]:
    """The runtime container's resources with a memory tier counted in: host memory it will hold,
    so the scheduler must find it on the node (request) and the limit must not kill the pod for it."""
    out = {key: dict(value) for key, value in resources.items()}
    k = spec.runtime.kv_offload
    if k is None or k.medium != "memory":
        return out
    extra = offload_pod_bytes(spec, tp)
    for kind in ("requests", "limits"):
        current = out.get(kind, {}).get("memory")
        if current is None and kind == "limits":
            continue  # no limit stays no limit
        base = 0 if current is None else parse_quantity(current, f"spec.runtime.resources.{kind}.memory")
        out.setdefault(kind, {})["memory"] = str(base + extra)
    return out


# -- KV events -----------------------------------------------------------------------------------
def events_on(spec: ServiceSpec) -> bool:
    """The router ranks pods by their KV events: it runs the prefix policy with spec.router.kvEvents,
    and the pods have a prefix cache (events name its blocks). A pod's data-parallel engines
    (parallelism.devicesPerPod) publish through one endpoint."""
    return spec.router.follows_kv_events and spec.runtime.enable_prefix_caching


def events_config() -> str:
    """--kv-events-config (vLLM's KVEventsConfig keys): every interface, replay on the next port."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{EVENTS_PORT}",
                       "replay_endpoint": f"tcp://*:{EVENTS_REPLAY_PORT}"}, separators=(",", ":"))


def runtime_ports(spec: ServiceSpec) -> list[dict[str, Any]]:
    if not events_on(spec):
        return []
    return [{"name": "kv-events", "containerPort": EVENTS_PORT, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": EVENTS_REPLAY_PORT, "protocol": "TCP"}]


def pod_annotations(spec: ServiceSpec) -> dict[str, str]:
    return {EVENTS_PORT_ANNOTATION: str(EVENTS_PORT)} if events_on(spec) else {}


def router_args(spec: ServiceSpec) -> list[str]:
    return ["--kv-events-port", str(EVENTS_PORT)] if events_on(spec) else []


# -- the capacity model --------------------------------------------------------------------------
def offload_plan(spec: ServiceSpec, shape, tp: int) -> dict[str, Any] | None:
    """What the tier holds at degree `tp` (the plan command prints it): blocks and tokens per rank
    from the model's KV bytes per token and rank, next to the pool's. None without a tier or shape."""
    k = spec.runtime.kv_offload
    if k is None or shape is None:
        return None
    from kvserve.runtime.capacity import dtype_bytes, plan_capacity

    from .spec import dtype_for_capacity, kv_dtype_size_for_capacity, weight_format_for_capacity

    dsize = dtype_bytes(dtype_for_capacity(spec))
    plan = plan_capacity(shape, dtype_size=dsize, block_size=spec.runtime.block_size, tp=tp,
                         gpu_memory_bytes=spec.gpu.memory_bytes,
                         gpu_memory_utilization=spec.runtime.gpu_memory_utilization,
                         weight_format=weight_format_for_capacity(spec, dsize),
                         kv_dtype_size=kv_dtype_size_for_capacity(spec))
    block_bytes = plan.kv_bytes_per_token_per_gpu * spec.runtime.block_size
    blocks = k.size_bytes // block_bytes if block_bytes else 0
    return {"medium": k.medium, "bytesPerRank": k.size_bytes, "bytesPerPod": offload_pod_bytes(spec, tp),
            "blocksPerRank": blocks, "tokensPerRank": blocks * spec.runtime.block_size,
            "poolTokensPerRank": plan.kv_tokens,
            "podMemoryRequestAdded": offload_pod_bytes(spec, tp) if k.medium == "memory" else 0}
