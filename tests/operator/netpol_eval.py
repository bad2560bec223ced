"""NetworkPolicy ingress semantics (networking.k8s.io/v1, as the API documents them), for tests
that ask "may this pod open a connection to that port?" of the policies we render.

No cluster here enforces policies, so this small evaluator stands in for the CNI: a pod is
isolated for ingress once any Ingress policy of its namespace selects it; it then accepts a
connection only if some rule of such a policy matches both the port and the source (a rule with
no `from` matches every source; a peer's bare podSelector means pods of the policy's namespace).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

NAMESPACE_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: Mapping[str, str] = field(default_factory=dict)
    namespace_labels: Mapping[str, str] | None = None  # default: just kubernetes.io/metadata.name

    @property
    def ns_labels(self) -> Mapping[str, str]:
        return {NAMESPACE_LABEL: self.namespace, **(self.namespace_labels or {})}


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], policy_ns: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # pod-to-pod traffic is what these tests are about
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], source.ns_labels):
            return False
    elif source.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], source.labels)


def _port_matches(rule: Mapping[str, Any], port: int, port_name: str | None) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    return any(p.get("protocol", "TCP") == "TCP" and (p.get("port") in (None, port) or
                                                       (port_name is not None and p.get("port") == port_name))
               for p in ports)


def allowed(policies: Iterable[Mapping[str, Any]], source: Pod, target: Pod, port: int,
            port_name: str | None = None) -> bool:
    """Whether `source` may connect to `target` on TCP `port` under `policies` (all namespaces)."""
    isolating = [p for p in policies
                 if p["kind"] == "NetworkPolicy" and p["metadata"]["namespace"] == target.namespace
                 and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
                 and selects(p["spec"].get("podSelector") or {}, target.labels)]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress") or []:
            if not _port_matches(rule, port, port_name):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, policy["metadata"]["namespace"], source) for peer in peers):
                return True
    return False
