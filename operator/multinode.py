"""Replicas larger than one node: a LeaderWorkerSet instead of a Deployment (pure builders).

A replica needs TP x pipeline x gpu.perShard GPUs. When spec.gpu.gpusPerNode says that is more
than one node has, the replica is one LeaderWorkerSet group (leaderworkerset.x-k8s.io/v1, the
Kubernetes SIG Apps API llm-d and KServe use) of N = GPUs / gpusPerNode pods: the leader runs
the usual pod (fetch step, runtime with ``kvserve serve``, agent, probes, drain hook), each
worker runs the same hardened pod with ``kvserve worker`` in place of the server and no agent
(it serves nothing; runtime/executor/node_worker.py). ``RecreateGroupOnPodRestart`` restarts the
whole group when any pod of it restarts, which is what a pipeline needs: a stage cannot rejoin a
running group. The ranks authenticate with a shared key from spec.parallelism.rendezvousKeySecret.

Pods of both roles carry the service's selector labels (the PDB, the NetworkPolicy and the pod
list see them) plus ``kvserve.dev/role``; the Service and the autoscaler's scrape take leaders
only. Replicas (groups) are the LeaderWorkerSet's spec.replicas, which the operator sets through
its scale subresource (PATCH .../scale) and never applies: the applied body leaves it out
(``applied_body``), so the size has one writer path, the one an HPA or ``kubectl scale`` uses too,
and a template change never carries a stale size with it. Only the object's creation carries the
size (``created_body``): a LeaderWorkerSet created without spec.replicas would be defaulted to 1
and start a group of a service meant to have none, or one group too few until the next PATCH.
Right after that creation a second field manager (``SIZE_MANAGER``) applies spec.replicas
alone (``size_handover``), the handover Kubernetes documents for giving a field to a
controller: it co-owns the field, so the next apply without it does not remove it (which would
default it to 1 again).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from . import manifests as M
from .spec import ServiceSpec, SpecError

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
ROLE_LABEL = "kvserve.dev/role"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # set by LWS on every pod
RENDEZVOUS_PORT = 29500
LWS_MISSING = ("the LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1) is not installed in this cluster: a replica "
               "of {gpus} GPUs spans {nodes} nodes of {per_node} (spec.gpu.gpusPerNode) and runs as a LeaderWorkerSet; "
               "install LWS (https://github.com/kubernetes-sigs/lws, docs/operator.md) or fit a replica on one node")


def replica_gpus(spec: ServiceSpec, tp: int) -> int:
    return (spec.devices_per_pod or tp) * spec.pipeline * spec.gpu.per_shard


def nodes_per_replica(spec: ServiceSpec, tp: int) -> int:
    """Pods (nodes) one replica takes: 1 unless its GPUs exceed spec.gpu.gpusPerNode."""
    per_node = spec.gpu.gpus_per_node
    gpus = replica_gpus(spec, tp)
    if per_node is None or gpus <= per_node:
        return 1
    return -(-gpus // per_node)


def is_multinode(spec: ServiceSpec, tp: int) -> bool:
    return nodes_per_replica(spec, tp) > 1


def check_multinode(spec: ServiceSpec) -> None:
    """Rules for replicas that span nodes (SpecError naming the field)."""
    if spec.pipeline > 1 and spec.devices_per_pod is not None:
        raise SpecError("spec.parallelism.devicesPerPod", "live DP x TP layouts are not supported with "
                        "spec.parallelism.pipeline > 1 (one pipeline group per server process)")
    if spec.pipeline > 1 and spec.autoscaling.tensor.enabled:
        raise SpecError("spec.autoscaling.tensorParallel.enabled", "TP autoscaling is not supported with "
                        "spec.parallelism.pipeline > 1 (a TP change would move layers between stages)")
    tps = {spec.tensor.initial, spec.tensor.min, spec.tensor.max} if spec.autoscaling.tensor.enabled else {
        spec.tensor.initial}
    for tp in sorted(tps):
        nodes = nodes_per_replica(spec, tp)
        if nodes == 1:
            continue
        if spec.autoscaling.tensor.enabled:
            raise SpecError("spec.autoscaling.tensorParallel.enabled", f"TP {tp} spans {nodes} nodes: TP autoscaling "
                            "is not supported for replicas larger than one node")
        gpus = replica_gpus(spec, tp)
        if gpus % spec.gpu.gpus_per_node or (tp * spec.pipeline) % nodes:
            raise SpecError("spec.gpu.gpusPerNode", f"a replica of {gpus} GPUs (TP {tp} x pipeline {spec.pipeline} "
                            f"x perShard {spec.gpu.per_shard}) must fill whole nodes of {spec.gpu.gpus_per_node}")
        if spec.devices_per_pod is not None:
            raise SpecError("spec.parallelism.devicesPerPod", "live DP x TP layouts need the replica on one node "
                            f"({nodes} nodes here)")
        if spec.runtime.engine != "kvserve":
            raise SpecError("spec.runtime.engine", "replicas larger than one node run kvserve's own workers "
                            "(engine: kvserve)")
        if spec.rendezvous_key_secret is None:
            raise SpecError("spec.parallelism.rendezvousKeySecret", f"a replica spanning {nodes} nodes needs a Secret "
                            "with the key its ranks authenticate with (e.g. kubectl create secret generic NAME "
                            "--from-literal=key=$(openssl rand -hex 32))")


def _rendezvous_env(spec: ServiceSpec) -> list[dict[str, Any]]:
    secret, key = spec.rendezvous_key_secret  # type: ignore[misc]
    return [{"name": "KVSERVE_RENDEZVOUS_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}},
            {"name": "KVSERVE_RENDEZVOUS_PORT", "value": str(RENDEZVOUS_PORT)}]


def _node_gpus(spec: ServiceSpec, tp: int) -> dict[str, Any]:
    """The runtime container's resources on one node of the group: that node's share of GPUs."""
    resources = copy.deepcopy(M._gpu_resources(spec, tp))
    per_node = str(replica_gpus(spec, tp) // nodes_per_replica(spec, tp))
    for part in ("requests", "limits"):
        if spec.gpu.resource_name in resources.get(part, {}):
            resources[part][spec.gpu.resource_name] = per_node
    return resources


def leader_template(name: str, spec: ServiceSpec, tp: int) -> dict[str, Any]:
    template = M.pod_template(name, spec, tp)
    template["metadata"]["labels"][ROLE_LABEL] = "leader"
    runtime = template["spec"]["containers"][0]
    runtime["env"] = runtime["env"] + _rendezvous_env(spec)
    runtime["resources"] = _node_gpus(spec, tp)
    runtime["ports"] = runtime["ports"] + [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT,
                                            "protocol": "TCP"}]
    return template


def worker_template(name: str, spec: ServiceSpec, tp: int) -> dict[str, Any]:
    """The leader's pod less what only a server needs: no agent, no admin token, no probes or
    drain hook (nothing listens for them); a worker whose ranks fail exits, and LWS restarts
    the group."""
    template = M.pod_template(name, spec, tp)
    template["metadata"]["labels"][ROLE_LABEL] = "worker"
    annotations = template["metadata"]["annotations"]
    for key in ("prometheus.io/scrape", "prometheus.io/port"):
        annotations.pop(key, None)
    pod = template["spec"]
    runtime = pod["containers"][0]
    runtime["command"] = ["kvserve", "worker", "--tensor-parallel-size", str(tp),
                          "--pipeline-parallel-size", str(spec.pipeline)]
    runtime["env"] = M._cache_env() + _rendezvous_env(spec)
    runtime["resources"] = _node_gpus(spec, tp)
    runtime["volumeMounts"] = [m for m in runtime["volumeMounts"] if m["name"] != "admin-token"]
    for key in ("ports", "startupProbe", "livenessProbe", "readinessProbe", "lifecycle"):
        runtime.pop(key, None)
    pod["containers"] = [runtime]
    pod["initContainers"] = [c for c in pod["initContainers"] if c["name"] == "fetch-model"]
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "admin-token"]
    pod["terminationGracePeriodSeconds"] = 30
    return template


def build_leaderworkerset(owner: Mapping[str, Any], spec: ServiceSpec, *, replicas: int, tp: int) -> dict[str, Any]:
    """The LeaderWorkerSet of `replicas` groups, each a replica of TP `tp` x spec.pipeline ranks."""
    name, namespace = owner["metadata"]["name"], owner["metadata"].get("namespace", "default")
    leader, worker = leader_template(name, spec, tp), worker_template(name, spec, tp)
    # One hash for the group: a change to either template is a new revision of every pod.
    for t in (leader, worker):
        t["metadata"]["annotations"].pop(M.HASH_ANNOTATION, None)
    digest = hashlib.sha256(json.dumps([leader, worker], sort_keys=True).encode()).hexdigest()[:16]
    for t in (leader, worker):
        t["metadata"]["annotations"][M.HASH_ANNOTATION] = digest
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": {**M._metadata(name, namespace, owner), "annotations": {M.TP_ANNOTATION: str(tp)}},
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            # As the Deployment: a new group before an old one goes, so serving capacity never dips.
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
            "leaderWorkerTemplate": {
                "size": nodes_per_replica(spec, tp),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def build_workload(owner: Mapping[str, Any], spec: ServiceSpec, *, replicas: int, tp: int) -> dict[str, Any]:
    """What runs the replicas: a Deployment, or a LeaderWorkerSet when one replica spans nodes."""
    if is_multinode(spec, tp):
        return build_leaderworkerset(owner, spec, replicas=replicas, tp=tp)
    return M.build_deployment(owner, spec, replicas=replicas, tp=tp)


def scaled_through_subresource(obj: Mapping[str, Any]) -> bool:
    """Whether the operator sizes `obj` through its scale subresource rather than its applied body."""
    return obj.get("kind") == LWS_KIND


SIZE_MANAGER = "kvserve-operator-size"  # owns a new LeaderWorkerSet's spec.replicas (size_handover)


def created_body(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator applies to create `obj`: all of it, the size too (a LeaderWorkerSet
    created without spec.replicas would run the default 1 group until the /scale PATCH)."""
    return dict(obj)


def size_handover(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """For a workload sized through /scale: spec.replicas alone, applied under SIZE_MANAGER right
    after the creation so the field outlives the operator's next apply, which leaves it out."""
    if not scaled_through_subresource(obj):
        return None
    meta = obj["metadata"]
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "spec": {"replicas": obj["spec"]["replicas"]}}


def applied_body(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator server-side applies for `obj`: a LeaderWorkerSet without spec.replicas
    (set through /scale; a server-side apply that owned it would reset it on every template change)."""
    if not scaled_through_subresource(obj):
        return dict(obj)
    return {**obj, "spec": {k: v for k, v in obj["spec"].items() if k != "replicas"}}


def serving_pod(pod: Mapping[str, Any]) -> bool:
    """Whether a pod serves (a Deployment's pod, or a group's leader), as opposed to an LWS worker."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL) != "worker"


def lws_missing_message(spec: ServiceSpec, tp: int) -> str:
    return LWS_MISSING.format(gpus=replica_gpus(spec, tp), nodes=nodes_per_replica(spec, tp),
                              per_node=spec.gpu.gpus_per_node)
