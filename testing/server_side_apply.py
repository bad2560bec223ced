"""A minimal, honest emulation of Kubernetes server-side apply, for the test-side API emulator.

kmock 0.8 has no server-side apply. The operator applies every object it owns with
`PATCH ... Content-Type: application/apply-patch+yaml; fieldManager=kvserve-operator; force=true`
and relies on one property of it: a field that its manager applied before and no longer applies
is removed by the server. This module gives the emulator that property, in pure functions:

  * the fields a manager owns are recorded in `metadata.managedFields` in the real `FieldsV1`
    shape (`{"f:spec": {"f:replicas": {}}}`), one entry per manager, operation "Apply";
  * applying merges the applied object into the live one (maps field by field, lists and
    scalars replaced), then removes each field this manager owned before and does not apply
    now, unless another manager also owns it; maps left empty by a removal go too;
  * a field another manager owns with a different value is a conflict: without `force` the
    apply is refused (409) and nothing changes; with `force` the applier takes it over.

What it does not do (none of it matters to the operator's tests, each would to a real client):
  * every list is atomic: a real server merges `listType: map` lists (containers, ports, env,
    volumes) item by item by their keys and records `k:{...}` entries; here a list is one field;
  * writes other than apply (merge and JSON patches, creates) are not recorded as "Update"
    managers, so a field only such a writer set is never shared and never conflicts;
  * no schema: no defaulting, no `x-kubernetes-map-type: atomic` maps, no type checks, and
    `null` in an applied object removes the field (as kmock stores patches) instead of being refused.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

Path = tuple[str, ...]
IDENTITY = {("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace"),
            ("metadata", "resourceVersion"), ("metadata", "uid"), ("metadata", "managedFields"),
            ("metadata", "generation"), ("metadata", "creationTimestamp")}


class ApplyConflict(Exception):
    """Fields another manager owns with other values; `force` takes them over."""

    def __init__(self, conflicts: Iterable[tuple[str, Path]]):
        self.conflicts = sorted(conflicts)
        super().__init__("Apply failed with conflicts: " + "; ".join(
            f'conflict with "{manager}": .{".".join(path)}' for manager, path in self.conflicts))


def leaf_paths(obj: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    """The fields an applied object sets: the paths to its scalars, lists and empty maps."""
    out: set[Path] = set()
    for key, value in obj.items():
        path = prefix + (key,)
        if path in IDENTITY or (not prefix and key == "status"):
            continue
        if isinstance(value, Mapping) and value:
            out |= leaf_paths(value, path)
        else:
            out.add(path)
    return out


def to_fields_v1(paths: Iterable[Path]) -> dict[str, Any]:
    """Paths in the API's FieldsV1 form."""
    root: dict[str, Any] = {}
    for path in sorted(paths):
        node = root
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return root


def from_fields_v1(fields: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for key, child in fields.items():
        if not key.startswith("f:"):
            continue  # "." and k:/v: entries: never written by this emulation
        path = prefix + (key[2:],)
        out |= from_fields_v1(child, path) if child else {path}
    return out


def managers(live: Mapping[str, Any] | None) -> dict[str, set[Path]]:
    """The fields each apply manager owns in `live`."""
    entries = ((live or {}).get("metadata") or {}).get("managedFields") or []
    return {e["manager"]: from_fields_v1(e.get("fieldsV1") or {}) for e in entries
            if e.get("operation") == "Apply" and e.get("fieldsType") == "FieldsV1"}


def _get(obj: Any, path: Path) -> tuple[bool, Any]:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return False, None
        obj = obj[key]
    return True, obj


def _remove(obj: dict[str, Any], path: Path) -> None:
    """Deletes the field at `path`, then the maps it leaves empty."""
    parents = []
    node: Any = obj
    for key in path[:-1]:
        if not isinstance(node, dict) or key not in node:
            return
        parents.append((node, key))
        node = node[key]
    if isinstance(node, dict):
        node.pop(path[-1], None)
        if node:
            return
    for parent, key in reversed(parents):
        if parent[key] == {}:
            del parent[key]
        else:
            return


def _merge(live: dict[str, Any], applied: Mapping[str, Any]) -> None:
    for key, value in applied.items():
        if isinstance(value, Mapping) and value and isinstance(live.get(key), dict):
            _merge(live[key], value)
        else:
            live[key] = copy.deepcopy(value)


def apply(live: Mapping[str, Any] | None, applied: Mapping[str, Any], manager: str, *,
          force: bool) -> dict[str, Any]:
    """The object after `manager` applies `applied` to `live` (None: it does not exist yet).

    Raises ApplyConflict (nothing changes) when another manager owns an applied field with
    another value and `force` is false."""
    owned = managers(live)
    wanted = leaf_paths(applied)
    conflicts = set()
    for other, paths in owned.items():
        if other == manager:
            continue
        for path in paths & wanted:
            if _get(live, path) != _get(applied, path):
                conflicts.add((other, path))
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    out = copy.deepcopy(dict(live)) if live is not None else {}
    others = set().union(*(paths for other, paths in owned.items() if other != manager))
    for path in owned.get(manager, set()) - wanted:
        if path not in others:
            _remove(out, path)
    _merge(out, {k: v for k, v in applied.items() if k != "status"})
    owned[manager] = wanted
    for other, path in conflicts:  # forced: the applier owns them now (equal values stay shared)
        owned[other].discard(path)
    owned = {m: paths for m, paths in owned.items() if paths}
    meta = out.setdefault("metadata", {})
    api_version = applied.get("apiVersion", (live or {}).get("apiVersion", ""))
    meta["managedFields"] = [{"manager": m, "operation": "Apply", "apiVersion": api_version,
                              "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(paths)}
                             for m, paths in sorted(owned.items())]
    return out


def parse_body(raw: Any) -> dict[str, Any]:
    """An apply body: YAML by its content type, which includes JSON (what the operator sends)."""
    if isinstance(raw, Mapping):
        return dict(raw)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        return json.loads(text)
    except ValueError:
        return yaml.safe_load(text)
