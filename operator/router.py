"""Pure builders for an InferenceService's router (spec.router): its Deployment, ServiceAccount,
Role and RoleBinding. With the router enabled the service's own Service selects the router pods,
so clients keep the URL in status.url; the router reaches the runtime pods by their IPs, which it
watches through the API with the least it needs: get/list/watch pods in its own namespace.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from . import kvcache as K
from . import manifests as M
from .spec import ServiceSpec

ROUTER_LABEL = M.ROUTER_LABEL
ROUTER_PORT = 8000  # the same port as a runtime's: a Service can point at either
ROUTER_KINDS = ("ServiceAccount", "Role", "RoleBinding", "Deployment")
ROUTER_TMP_SIZE = "256Mi"
ROUTER_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def router_name(name: str) -> str:
    return f"{name}-router"


def router_selector(name: str) -> dict[str, str]:
    return M.router_selector(name)


def router_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvserve", "app.kubernetes.io/component": "router",
            "app.kubernetes.io/managed-by": "kvserve-operator", **router_selector(name)}


def _metadata(owner: Mapping[str, Any]) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    return {"name": router_name(name), "namespace": owner["metadata"].get("namespace", "default"),
            "labels": router_labels(name), "ownerReferences": [M.owner_reference(owner)]}


def router_command(name: str, namespace: str, spec: ServiceSpec) -> list[str]:
    r = spec.router
    return ["kvserve", "router", "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--inferenceservice", name, "--namespace", namespace,
            "--runtime-port", str(M.RUNTIME_PORT), "--agent-port", str(M.AGENT_PORT),
            "--policy", r.policy, "--hold-timeout", str(r.hold_timeout_seconds),
            "--block-size", str(spec.runtime.block_size),
            "--served-model-name", spec.model.served_name] + K.router_args(spec)


def build_router_deployment(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    namespace = owner["metadata"].get("namespace", "default")
    r = spec.router
    container = {
        "name": "router",
        "image": spec.runtime.agent_image,  # always a kvserve image, whatever engine the pods run
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": router_command(name, namespace, spec),
        # The pods' key: the router checks it before reading a body, then forwards it unchanged.
        "env": [{"name": "HOME", "value": "/tmp"}] + M.api_key_env(spec),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": M._security_context(),
        # Ready as soon as it has listed the pods, with or without a ready one: holding requests
        # while the service is at zero is its job.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5,
                           "timeoutSeconds": 3, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                          "timeoutSeconds": 5, "failureThreshold": 3},
    }
    template = {
        "metadata": {"labels": router_labels(name),
                     "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT)}},
        "spec": {
            "serviceAccountName": router_name(name),
            "automountServiceAccountToken": True,  # it watches pods through the API
            "enableServiceLinks": False,
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": ROUTER_TMP_SIZE}}],
            "securityContext": {"runAsNonRoot": True, "runAsUser": M.NONROOT_UID, "runAsGroup": M.NONROOT_UID,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            # Open streams finish, and held requests get their answer or their 503, before exit.
            "terminationGracePeriodSeconds": 60,
        },
    }
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
    template["metadata"]["annotations"][M.HASH_ANNOTATION] = digest
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(owner),
        "spec": {"replicas": r.replicas, "selector": {"matchLabels": router_selector(name)},
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                 "revisionHistoryLimit": 5, "template": template},
    }


def build_router_serviceaccount(owner: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner),
            "automountServiceAccountToken": True}


def build_router_role(owner: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _metadata(owner),
            "rules": [dict(rule) for rule in ROUTER_RULES]}


def build_router_rolebinding(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = _metadata(owner)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": meta["name"]},
            "subjects": [{"kind": "ServiceAccount", "name": meta["name"], "namespace": meta["namespace"]}]}


def build_router_objects(owner: Mapping[str, Any], spec: ServiceSpec) -> list[dict[str, Any]]:
    """In apply order: the identity and its rights before the pods that use them."""
    return [build_router_serviceaccount(owner), build_router_role(owner), build_router_rolebinding(owner),
            build_router_deployment(owner, spec)]
