"""Pure builders for the objects an InferenceService owns: Deployment, Service, PodDisruptionBudget.

Same input, same dict: the shell compares these with what is live and patches only differences,
so a reconcile that changes nothing writes nothing and never restarts pods.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from . import kvcache as K
from . import lora as L
from .spec import API_VERSION, GIB, KIND, ServiceSpec, parse_quantity

RUNTIME_PORT = 8000
AGENT_PORT = 8081
MODELS_DIR = "/models"
PVC_MOUNT = "/model-source"
INSTANCE_LABEL = "app.kubernetes.io/instance"
OWNER_LABEL = "kvserve.dev/inferenceservice"
TP_ANNOTATION = "kvserve.dev/tensor-parallel-size"
HASH_ANNOTATION = "kvserve.dev/template-hash"
# The image's `kvserve` user (Dockerfile); the operator's own Deployment runs as the same uid.
NONROOT_UID = 65532
# The per-pod admin token (docs/operator.md "Credentials"): written by an init step into memory,
# read by the runtime, the agent and their preStop hooks, gone with the pod.
ADMIN_DIR = "/var/run/kvserve/admin"
ADMIN_TOKEN_FILE = f"{ADMIN_DIR}/token"
ADMIN_VOLUME_SIZE = "1Mi"
TMP_SIZE_LIMIT = "2Gi"  # caches (Triton, torch, HOME): a runaway writer is evicted, not the node's disk
# A CPU model with no memory limit and no inline config: weights live in RAM, rarely beyond this.
DEFAULT_CPU_MODEL_SIZE_LIMIT = 64 * GIB
# Load-time quantization: the checkpoint on disk is this many times the weights in memory.
LOAD_TIME_SHRINK = {"int4": 4, "int8": 2, "fp8": 2}


ROUTER_LABEL = "kvserve.dev/router"


def selector_labels(name: str) -> dict[str, str]:
    """The immutable Deployment selector and the Service/PDB selector."""
    return {INSTANCE_LABEL: name, OWNER_LABEL: name}


def router_selector(name: str) -> dict[str, str]:
    """The router pods' selector (operator/router.py). Disjoint from the runtime pods' (those carry
    kvserve.dev/inferenceservice, these do not), so neither Deployment adopts the other's pods."""
    return {INSTANCE_LABEL: name, ROUTER_LABEL: name}


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvserve",
        "app.kubernetes.io/component": "inference",
        "app.kubernetes.io/managed-by": "kvserve-operator",
        **selector_labels(name),
    }


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": owner.get("apiVersion", API_VERSION),
        "kind": owner.get("kind", KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(name: str, namespace: str, owner: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(name),
            "ownerReferences": [owner_reference(owner)]}


def model_dir(name: str) -> str:
    return f"{MODELS_DIR}/{name}"


def _security_context(read_only_root: bool = True) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_UID,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _quantity(size: int) -> str:
    return f"{size // GIB}Gi" if size % GIB == 0 else str(size)


def model_size_limit(spec: ServiceSpec, tp: int) -> int:
    """The models emptyDir's sizeLimit: spec.model.sizeLimit, else from the spec's inline config
    (spec.checkpoint_size_limit), else what the pod could load: twice its accelerators' memory
    (or, on CPU, its memory limit) times the load-time quantization's shrink. The kubelet evicts
    a pod past it instead of letting a wrong or hostile download fill the node's disk."""
    if spec.model.size_limit is not None:
        return spec.model.size_limit
    shrink = LOAD_TIME_SHRINK.get(spec.runtime.quantization or "", 1)
    if spec.gpu.per_shard:
        return 2 * tp * spec.gpu.per_shard * spec.gpu.memory_bytes * shrink
    memory = ((spec.runtime.resources or {}).get("limits") or {}).get("memory")
    if memory is None:
        return DEFAULT_CPU_MODEL_SIZE_LIMIT
    return 2 * parse_quantity(memory, "spec.runtime.resources.limits.memory") * shrink


def _secret_env(name: str, secret: tuple[str, str]) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret[0], "key": secret[1]}}}


def admin_env(spec: ServiceSpec) -> list[dict[str, Any]]:
    """The admin credential of the runtime and the agent (and so of their preStop hooks)."""
    if spec.runtime.admin_api_key_secret:
        return [_secret_env("KVSERVE_ADMIN_API_KEY", spec.runtime.admin_api_key_secret)]
    return [{"name": "KVSERVE_ADMIN_API_KEY_FILE", "value": ADMIN_TOKEN_FILE}]


def api_key_env(spec: ServiceSpec, engine: str = "kvserve") -> list[dict[str, Any]]:
    """The user API key, from its Secret; vLLM reads it as VLLM_API_KEY."""
    if not spec.runtime.api_key_secret:
        return []
    return [_secret_env("VLLM_API_KEY" if engine == "vllm" else "KVSERVE_API_KEY", spec.runtime.api_key_secret)]


def _cache_env() -> list[dict[str, str]]:
    # The root filesystem is read-only: every cache goes to the /tmp emptyDir.
    return [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/.triton"},
        {"name": "HF_HOME", "value": f"{MODELS_DIR}/.hf-home"},
    ]


def runtime_command(name: str, spec: ServiceSpec, tp: int) -> list[str]:
    rt = spec.runtime
    program = ["kvserve", "serve"] if rt.engine == "kvserve" else ["vllm", "serve"]
    command = [*program, model_dir(name), "--host", "0.0.0.0", "--port", str(RUNTIME_PORT),
               "--served-model-name", spec.model.served_name,
               "--tensor-parallel-size", str(tp),
               *(["--pipeline-parallel-size", str(spec.pipeline)] if spec.pipeline > 1 else []),
               *(["--data-parallel-size", str(spec.devices_per_pod // tp)] if spec.devices_per_pod else []),
               # Spare worker interpreters only where ranks have devices of their own: on CPU pods
               # they would compete with serving for the same cores.
               *(["--reshape-spare-workers"] if spec.devices_per_pod and spec.gpu.per_shard else []),
               "--block-size", str(rt.block_size),
               "--dtype", rt.dtype,
               "--gpu-memory-utilization", str(rt.gpu_memory_utilization),
               "--enable-prefix-caching" if rt.enable_prefix_caching else "--no-enable-prefix-caching"]
    if rt.max_model_len:
        command += ["--max-model-len", str(rt.max_model_len)]
    if rt.max_num_seqs:
        command += ["--max-num-seqs", str(rt.max_num_seqs)]
    if rt.quantization:
        command += ["--quantization", rt.quantization]
    if rt.kv_cache_dtype != "auto":
        command += ["--kv-cache-dtype", rt.kv_cache_dtype]
    if rt.engine == "kvserve":
        command += ["--drain-timeout", str(rt.drain_timeout_seconds)]
        if spec.gpu.per_shard == 0:
            command += ["--device", "cpu"]
    return command + L.runtime_args(spec) + K.runtime_args(spec) + list(rt.args)


def _http_probe(path: str, **timing: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, **timing}


def runtime_probes(engine: str) -> dict[str, Any]:
    """Startup, liveness and readiness probes of the runtime container.

    kvserve listens at once and loads the model behind `/live` (200 while loading or serving, 500
    once the load failed or the engine died), so the startup probe only waits for the process to
    listen and liveness catches a dead engine even during a long load; `/ready` takes the pod out
    of the Service while loading or draining. (`/health` keeps vLLM's meaning, "can serve", for
    clients and gateways that wait on it.) vLLM listens only once its model is loaded and has
    only `/health`: the startup probe gives the load up to 30 minutes.
    """
    if engine == "kvserve":
        return {"startupProbe": _http_probe("/live", periodSeconds=2, failureThreshold=150),
                "livenessProbe": _http_probe("/live", periodSeconds=10, timeoutSeconds=5, failureThreshold=3),
                "readinessProbe": _http_probe("/ready", periodSeconds=5, timeoutSeconds=3, failureThreshold=2)}
    return {"startupProbe": _http_probe("/health", periodSeconds=5, failureThreshold=360),
            "livenessProbe": _http_probe("/health", periodSeconds=10, timeoutSeconds=5, failureThreshold=3),
            "readinessProbe": _http_probe("/health", periodSeconds=5, timeoutSeconds=3, failureThreshold=2)}


def _fetch_source(name: str, spec: ServiceSpec) -> str:
    source = spec.model.source
    if source.kind == "pvc":
        return f"{PVC_MOUNT}/{source.sub_path}".rstrip("/")
    if source.kind == "path":
        return source.location
    return spec.model.uri


def _gpu_resources(spec: ServiceSpec, tp: int) -> dict[str, Any]:
    requests = dict((spec.runtime.resources or {}).get("requests") or {})
    limits = dict((spec.runtime.resources or {}).get("limits") or {})
    # devicesPerPod: the pod owns G devices whatever its live layout, so the template never changes.
    gpus = (spec.devices_per_pod or tp) * spec.pipeline * spec.gpu.per_shard
    if gpus:
        # Extended resources must have request == limit.
        requests[spec.gpu.resource_name] = str(gpus)
        limits[spec.gpu.resource_name] = str(gpus)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def pod_template(name: str, spec: ServiceSpec, tp: int) -> dict[str, Any]:
    rt = spec.runtime
    drain = ["kvserve", "agent", "drain", "--agent-url", f"http://127.0.0.1:{AGENT_PORT}",
             "--timeout", str(rt.drain_timeout_seconds)]
    mounts = [{"name": "models", "mountPath": MODELS_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    per_pod_token = rt.admin_api_key_secret is None
    admin_mount = [{"name": "admin-token", "mountPath": ADMIN_DIR, "readOnly": True}] if per_pod_token else []
    runtime_mounts = list(mounts)
    if (spec.devices_per_pod or tp) > 1:
        runtime_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    # vLLM's image has no admin route and no kvserve to read the token with.
    runtime_admin = rt.engine == "kvserve"
    if runtime_admin:
        runtime_mounts += admin_mount
    runtime_mounts += L.runtime_mounts(spec) + K.runtime_mounts(spec)
    fetch_env = _cache_env()
    if spec.model.hf_token_secret:
        # Only the step that downloads needs it: the serving containers never see it.
        fetch_env.append(_secret_env("HF_TOKEN", spec.model.hf_token_secret))
    fetch_mounts = list(mounts)
    if spec.model.source.kind == "pvc":
        fetch_mounts.append({"name": "model-source", "mountPath": PVC_MOUNT, "readOnly": True})

    runtime = {
        "name": "runtime",
        "image": rt.image,
        "imagePullPolicy": rt.image_pull_policy,
        "command": runtime_command(name, spec, tp),
        "env": _cache_env() + api_key_env(spec, rt.engine) + (admin_env(spec) if runtime_admin else [])
        + L.runtime_env(spec) + [{"name": k, "value": v} for k, v in rt.env],
        "ports": [{"name": "http", "containerPort": RUNTIME_PORT, "protocol": "TCP"}] + K.runtime_ports(spec),
        "resources": K.with_offload_memory(_gpu_resources(spec, tp), spec, tp),
        "volumeMounts": runtime_mounts,
        "securityContext": _security_context(),
        **runtime_probes(rt.engine),
    }
    if rt.engine == "kvserve":
        # vLLM's image has no kvserve binary; it drains on SIGTERM by itself.
        runtime["lifecycle"] = {"preStop": {"exec": {"command": drain}}}
    agent = {
        "name": "agent",
        "image": rt.agent_image,
        "imagePullPolicy": rt.image_pull_policy,
        "command": ["kvserve", "agent", "serve", "--engine-url", f"http://127.0.0.1:{RUNTIME_PORT}",
                    "--port", str(AGENT_PORT), "--engine", rt.engine,
                    "--tensor-parallel-size", str(tp),
                    "--drain-timeout", str(rt.drain_timeout_seconds),
                    # Reported in /v1/signals: the operator learns the model's shape from it.
                    "--model-dir", model_dir(name)] + L.agent_args(spec),
        # The agent calls only the runtime's /metrics, /ready and (admin) /drain: no user key.
        "env": L.agent_env(spec, _cache_env() + admin_env(spec)),
        "ports": [{"name": "agent", "containerPort": AGENT_PORT, "protocol": "TCP"}],
        # 512Mi: reading a GGUF file's metadata runs the GGUF reader (and torch) in a short child.
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}] + admin_mount + L.agent_mounts(spec),
        "securityContext": _security_context(),
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "agent"}, "periodSeconds": 5},
        # tcp, not /ready: a dead engine must not get the agent restarted.
        "livenessProbe": {"tcpSocket": {"port": "agent"}, "periodSeconds": 10},
        # The agent stays up until the drain it forwards is done.
        "lifecycle": {"preStop": {"exec": {"command": drain}}},
    }
    fetch = {
        "name": "fetch-model",
        "image": rt.agent_image,
        "imagePullPolicy": rt.image_pull_policy,
        "command": ["kvserve", "agent", "fetch", _fetch_source(name, spec), model_dir(name)],
        "env": fetch_env,
        "volumeMounts": fetch_mounts,
        "securityContext": _security_context(),
    }
    init = [fetch]
    if per_pod_token:
        init.insert(0, {
            "name": "admin-token",
            "image": rt.agent_image,
            "imagePullPolicy": rt.image_pull_policy,
            "command": ["kvserve", "agent", "admin-token", "--out", ADMIN_TOKEN_FILE],
            "env": [{"name": "HOME", "value": "/tmp"}],
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
            "volumeMounts": [{"name": "admin-token", "mountPath": ADMIN_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
            "securityContext": _security_context(),
        })
    volumes: list[dict[str, Any]] = [
        {"name": "models", "emptyDir": {"sizeLimit": _quantity(model_size_limit(spec, tp))}},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}}] + L.volumes(name, spec) + K.volumes(spec, tp, name)
    if per_pod_token:
        # In memory: the token never reaches the node's disk.
        volumes.append({"name": "admin-token", "emptyDir": {"medium": "Memory", "sizeLimit": ADMIN_VOLUME_SIZE}})
    if (spec.devices_per_pod or tp) > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if spec.model.source.kind == "pvc":
        volumes.append({"name": "model-source",
                        "persistentVolumeClaim": {"claimName": spec.model.source.location, "readOnly": True}})
    pod_spec: dict[str, Any] = {
        "initContainers": init,
        "containers": [runtime, agent],
        "volumes": volumes,
        "securityContext": {"runAsNonRoot": True, "runAsUser": NONROOT_UID, "runAsGroup": NONROOT_UID,
                            "fsGroup": NONROOT_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": rt.drain_timeout_seconds + 30,
    }
    if spec.gpu.node_selector:
        pod_spec["nodeSelector"] = dict(spec.gpu.node_selector)
    if spec.gpu.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.gpu.tolerations]
    if spec.gpu.affinity:
        pod_spec["affinity"] = dict(spec.gpu.affinity)
    if spec.gpu.priority_class_name:
        pod_spec["priorityClassName"] = spec.gpu.priority_class_name
    pod_labels = labels(name)
    if spec.gpu.gpus_per_node is not None:
        # Set with gpusPerNode only (so other services' templates, and pods, stay as they were):
        # the Service then selects leaders, and a LeaderWorkerSet's workers say "worker".
        pod_labels["kvserve.dev/role"] = "leader"
    template = {
        "metadata": {
            "labels": pod_labels,
            "annotations": {TP_ANNOTATION: str(tp), "kvserve.dev/engine": rt.engine,
                            "prometheus.io/scrape": "true", "prometheus.io/port": str(AGENT_PORT),
                            **K.pod_annotations(spec)},
        },
        "spec": pod_spec,
    }
    # Pods carry the hash of the template they came from: pods with another hash mean a rollout
    # is still under way (the autoscaler then holds scale-downs and TP changes).
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
    template["metadata"]["annotations"][HASH_ANNOTATION] = digest
    return template


def build_deployment(owner: Mapping[str, Any], spec: ServiceSpec, *, replicas: int, tp: int) -> dict[str, Any]:
    """The Deployment at `replicas` x TP `tp`.

    maxUnavailable 0 with a surge of one: a rollout (a TP change included) starts a new pod and
    only retires an old one once the new one is Ready, so serving capacity never dips.
    """
    name, namespace = owner["metadata"]["name"], owner["metadata"].get("namespace", "default")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**_metadata(name, namespace, owner),
                     "annotations": {TP_ANNOTATION: str(tp)}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "revisionHistoryLimit": 5,
            # Model loading can take long; mark a rollout failed only after 30 minutes.
            "progressDeadlineSeconds": 1800,
            "template": pod_template(name, spec, tp),
        },
    }


def build_service(owner: Mapping[str, Any], spec: ServiceSpec | None = None) -> dict[str, Any]:
    """The service's address (status.url): its runtime pods, or its router when spec.router is on."""
    name, namespace = owner["metadata"]["name"], owner["metadata"].get("namespace", "default")
    routed = spec is not None and spec.router.enabled
    selector = router_selector(name) if routed else selector_labels(name)
    if not routed and spec is not None and spec.gpu.gpus_per_node is not None:
        from .multinode import ROLE_LABEL

        # A LeaderWorkerSet's workers serve nothing; every pod of a Deployment is a "leader".
        selector = {**selector, ROLE_LABEL: "leader"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_pdb(owner: Mapping[str, Any]) -> dict[str, Any]:
    """At most one pod evicted at a time; never blocks a node drain of a one-replica service."""
    name, namespace = owner["metadata"]["name"], owner["metadata"].get("namespace", "default")
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


def service_url(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc:{RUNTIME_PORT}/v1"


def build_all(owner: Mapping[str, Any], spec: ServiceSpec, *, replicas: int, tp: int) -> list[dict[str, Any]]:
    return [build_deployment(owner, spec, replicas=replicas, tp=tp), build_service(owner, spec), build_pdb(owner)]


def _pod_template_of(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Deployment's pod template, or a LeaderWorkerSet's leader template (operator/multinode.py)."""
    spec = workload.get("spec") or {}
    if "leaderWorkerTemplate" in spec:
        return spec["leaderWorkerTemplate"].get("leaderTemplate") or {}
    return spec.get("template") or {}


def template_hash(deployment: Mapping[str, Any] | None) -> str | None:
    if not deployment:
        return None
    return _pod_template_of(deployment).get("metadata", {}).get("annotations", {}).get(HASH_ANNOTATION)


def template_tp(deployment: Mapping[str, Any] | None) -> int | None:
    """The TP the live Deployment's pod template runs, if it says."""
    if not deployment:
        return None
    value = _pod_template_of(deployment).get("metadata", {}).get("annotations", {}).get(TP_ANNOTATION)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
