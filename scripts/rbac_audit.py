"""Check the API requests the operator really made against the RBAC rules we ship.

The demo (and tests/test_demo.py) run the real operator against the kmock emulator, which records
every request. Those made by the operator (kopf's and kvserve's clients, told apart by their
User-Agent) are turned into RBAC (verb, group, resource) triples and checked against a
ClusterRole's rules: anything denied would fail in a real cluster; grants never used are shown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

OPERATOR_AGENTS = ("kopf/", "kvserve-operator")
APPLY = "application/apply-patch"
_VERBS = {("GET", "list"): "list", ("GET", "watch"): "watch", ("GET", "fetch"): "get",
          ("POST", "create"): "create", ("PATCH", "update"): "patch", ("PUT", "update"): "update",
          ("DELETE", "delete"): "delete"}

Triple = tuple[str, str, str]  # (verb, apiGroup, resource[/subresource])


def from_kmock(requests: Iterable[Any], agents: tuple[str, ...] = OPERATOR_AGENTS) -> list[Triple]:
    """(verb, group, resource) of each request to a resource in a kmock request log made by a
    client whose User-Agent starts with one of `agents` (the operator's, by default)."""
    out = []
    for r in requests:
        agent = (r.headers or {}).get("User-Agent", "")
        if (r.resource is None or r.action is None or not r.resource.plural
                or not agent.startswith(agents)):
            continue  # discovery (/api, /apis/...) needs no RBAC
        method, action = str(r.method.value).upper(), str(r.action.value).lower()
        verb = _VERBS.get((method, action))
        if verb is None:
            verb = f"{method.lower()}?{action}"
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        out.append((verb, r.resource.group or "", resource))
        if verb == "patch" and (r.headers or {}).get("Content-Type", "").startswith(APPLY):
            # A server-side apply of an object that does not exist creates it, and the API
            # server then authorizes the request as create as well.
            out.append(("create", r.resource.group or "", resource))
    return out


def allowed(rules: Iterable[Mapping[str, Any]], verb: str, group: str, resource: str) -> bool:
    return any(group in rule.get("apiGroups", []) and resource in rule.get("resources", [])
               and verb in rule.get("verbs", []) for rule in rules)


def audit(used: Iterable[Triple], rules: list[Mapping[str, Any]]) -> tuple[set[Triple], set[Triple]]:
    """(denied: used but not granted, unused: granted but not used in this run)."""
    used = set(used)
    denied = {t for t in used if not allowed(rules, *t)}
    granted = {(v, g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    return denied, granted - used
