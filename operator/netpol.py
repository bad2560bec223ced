"""Pure builders for an InferenceService's NetworkPolicies (spec.networkPolicy).

Without them every pod of the cluster reaches the runtime (the OpenAI API), the agent (its
/v1/signals and /drain) and the router (/router/demand). With them, ingress is allowed only:
- runtime port: from the service's router pods, the clients spec.networkPolicy names (its own
  namespace by default, other namespaces, gateway or endpoint-picker pods) and Prometheus;
- agent port: from the operator's pods, the service's router pods and Prometheus;
- router port (spec.router): from the clients, the operator (it reads /router/demand) and Prometheus.
Egress stays open: the fetch step downloads from the Hugging Face Hub, whose addresses no
NetworkPolicy can name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import kvcache as K
from . import manifests as M
from . import router as R
from .spec import ServiceSpec

NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kvserve-operator"}  # manifests/base, the chart
DEFAULT_OPERATOR_NAMESPACE = "kvserve-system"


@dataclass(frozen=True)
class OperatorPeer:
    """Where the operator's own pods run: they alone (with the router) reach the agents."""

    namespace: str = DEFAULT_OPERATOR_NAMESPACE
    pod_labels: Mapping[str, str] = field(default_factory=lambda: dict(OPERATOR_POD_LABELS))


def runtime_policy_name(name: str) -> str:
    return name


def router_policy_name(name: str) -> str:
    return R.router_name(name)


def _in_namespace(namespace: str, pods: Mapping[str, Any] | None = None) -> dict[str, Any]:
    peer: dict[str, Any] = {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: namespace}}}
    if pods is not None:
        peer["podSelector"] = dict(pods)
    return peer


def client_peers(spec: ServiceSpec, namespace: str) -> list[dict[str, Any]]:
    """Who may send requests: the service's namespace, the allowed namespaces, the allowed pods."""
    np = spec.network_policy
    peers: list[dict[str, Any]] = []
    if np.allow_same_namespace:
        peers.append({"podSelector": {}})
    peers += [_in_namespace(ns) for ns in np.allowed_namespaces if not (np.allow_same_namespace and ns == namespace)]
    if not np.allow_same_namespace:
        # A bare podSelector selects pods of the policy's own namespace.
        peers += [{"podSelector": dict(selector)} for selector in np.allowed_pods]
    return peers


def metrics_peers(spec: ServiceSpec) -> list[dict[str, Any]]:
    np = spec.network_policy
    return [_in_namespace(ns, np.metrics_pod_selector or None) for ns in np.metrics_namespaces]


def operator_peers(operator: OperatorPeer) -> list[dict[str, Any]]:
    return [_in_namespace(operator.namespace, {"matchLabels": dict(operator.pod_labels)})]


def _router_peer(name: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": M.router_selector(name)}}


def _rule(port: int, peers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"from": peers, "ports": [{"protocol": "TCP", "port": port}]}


def _policy(owner: Mapping[str, Any], name: str, labels: Mapping[str, str], selector: Mapping[str, str],
            rules: list[dict[str, Any]]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": meta.get("namespace", "default"), "labels": dict(labels),
                     "ownerReferences": [M.owner_reference(owner)]},
        # Ingress only: egress stays open (see the module's docstring).
        "spec": {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": ["Ingress"],
                 "ingress": [rule for rule in rules if rule["from"]]},
    }


def build_runtime_policy(owner: Mapping[str, Any], spec: ServiceSpec, operator: OperatorPeer) -> dict[str, Any]:
    name, namespace = owner["metadata"]["name"], owner["metadata"].get("namespace", "default")
    router = [_router_peer(name)] if spec.router.enabled else []
    metrics = metrics_peers(spec)
    return _policy(owner, runtime_policy_name(name), M.labels(name), M.selector_labels(name), [
        _rule(M.RUNTIME_PORT, router + client_peers(spec, namespace) + metrics),
        _rule(M.AGENT_PORT, operator_peers(operator) + router + metrics),
        # The router follows each pod's KV events (publisher and replay sockets); nobody else.
        *([_rule(K.EVENTS_PORT, router), _rule(K.EVENTS_REPLAY_PORT, router)] if K.events_on(spec)
          else []),
    ])


def build_router_policy(owner: Mapping[str, Any], spec: ServiceSpec, operator: OperatorPeer) -> dict[str, Any]:
    name, namespace = owner["metadata"]["name"], owner["metadata"].get("namespace", "default")
    return _policy(owner, router_policy_name(name), R.router_labels(name), M.router_selector(name), [
        _rule(R.ROUTER_PORT, client_peers(spec, namespace) + operator_peers(operator) + metrics_peers(spec)),
    ])


def build_network_policies(owner: Mapping[str, Any], spec: ServiceSpec,
                           operator: OperatorPeer | None = None) -> list[dict[str, Any]]:
    """The policies spec.networkPolicy asks for (none when it is disabled)."""
    if not spec.network_policy.enabled:
        return []
    operator = operator or OperatorPeer()
    policies = [build_runtime_policy(owner, spec, operator)]
    if spec.router.enabled:
        policies.append(build_router_policy(owner, spec, operator))
    return policies
