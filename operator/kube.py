"""A small async Kubernetes REST client over aiohttp, and the apply-by-patch logic.

kopf handles the InferenceService itself; this client touches only the owned objects (GET, POST,
merge-PATCH, DELETE by name) and lists pods. It takes kopf's `ConnectionInfo`, so it talks to
whatever cluster kopf logged into (in-cluster service account, KUBECONFIG, or a test emulator).
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any, Mapping

import aiohttp
import kopf

# kind -> (API prefix, plural)
RESOURCES = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Pod": ("/api/v1", "pods"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "InferenceService": ("/apis/kvserve.dev/v1alpha1", "inferenceservices"),
}


class APIError(Exception):
    def __init__(self, status: int, method: str, path: str, message: str):
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


class NotOwned(Exception):
    """An object with the name the operator wants exists but belongs to someone else."""


class KubeClient:
    def __init__(self, info: kopf.ConnectionInfo, *, timeout: float = 30.0):
        self.info = info
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                auth = self.info.as_aiohttp_basic_auth()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self.info.as_ssl_context()),
                headers={**self.info.as_http_headers(), "User-Agent": "kvserve-operator"},
                auth=auth, timeout=self.timeout)
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> Any:
        url = self.info.server.rstrip("/") + path
        kwargs: dict[str, Any] = {"params": params or {}}
        if body is not None:
            kwargs["json"] = body
            kwargs["headers"] = {"Content-Type": content_type}
        async with self._get_session().request(method, url, **kwargs) as response:
            if response.status >= 400:
                text = await response.text()
                raise APIError(response.status, method, path, text[:500])
            if response.content_type == "application/json":
                return await response.json()
            return await response.text()

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None) -> str:
        prefix, plural = RESOURCES[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        return f"{path}/{name}" if name else path

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", self.path(kind, namespace, name))
        except APIError as error:
            if error.status == 404:
                return None
            raise

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self.request("POST", self.path(obj["kind"], meta["namespace"]), body=obj)

    async def merge_patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", self.path(kind, namespace, name), body=patch,
                                  content_type="application/merge-patch+json")

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        try:
            await self.request("DELETE", self.path(kind, namespace, name),
                               body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
            return True
        except APIError as error:
            if error.status == 404:
                return False
            raise

    async def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        data = await self.request("GET", self.path(kind, namespace), params={"labelSelector": selector})
        items = data.get("items") or []
        # Filter here too: cheap, and correct even where a server ignores labelSelector.
        return [i for i in items if all((i.get("metadata", {}).get("labels") or {}).get(k) == v
                                        for k, v in labels.items())]


def is_subset(desired: Any, live: Any) -> bool:
    """True when everything in `desired` is already in `live` (extra live fields are others')."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(desired) == len(live)
                and all(is_subset(d, v) for d, v in zip(desired, live)))
    if isinstance(desired, (int, float)) and isinstance(live, (int, float)) and not isinstance(desired, bool):
        return desired == live
    return desired == live


def merge_patch_for(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch setting only what differs; keys the operator does not set stay as they are.

    Lists (containers, ports, volumes) are the operator's own and are replaced whole when they
    differ; a merge patch cannot remove a key the operator used to set but no longer does, so
    builders always emit every key they own.
    """
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        current = live.get(key) if isinstance(live, Mapping) else None
        if is_subset(value, current):
            continue
        if isinstance(value, Mapping) and isinstance(current, Mapping):
            patch[key] = merge_patch_for(value, current)
        else:
            patch[key] = value
    return patch


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


# Optional fields the operator sets from the spec, by kind: when the spec drops one, the merge
# patch must delete it explicitly (a merge patch never removes a key it does not mention).
OPTIONAL_FIELDS = {
    "Deployment": [("spec", "template", "spec", key)
                   for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName")],
    # The Service selects the runtime pods or, with spec.router, the router pods: switching drops
    # the other side's label (a merge patch of the selector would otherwise keep both, matching none).
    "Service": [("spec", "selector", "kvserve.dev/inferenceservice"), ("spec", "selector", "kvserve.dev/router")],
}


def removals(kind: str, desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch deleting the operator's optional fields that `desired` no longer has."""
    patch: dict[str, Any] = {}
    for path in OPTIONAL_FIELDS.get(kind, ()):
        want, have = desired, live
        for key in path:
            want = want.get(key) if isinstance(want, Mapping) else None
            have = have.get(key) if isinstance(have, Mapping) else None
        if want is None and have is not None:
            node = patch
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = None
    return patch


def _merge(a: dict[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in b.items():
        if isinstance(value, Mapping) and isinstance(a.get(key), dict):
            _merge(a[key], value)
        else:
            a[key] = value
    return a


async def apply(client: KubeClient, desired: Mapping[str, Any], owner_uid: str) -> str:
    """Creates `desired` or patches the live object toward it; returns "created", "patched" or "unchanged"."""
    meta = desired["metadata"]
    kind, namespace, name = desired["kind"], meta["namespace"], meta["name"]
    live = await client.get(kind, namespace, name)
    if live is None:
        try:
            await client.create(desired)
            return "created"
        except APIError as error:
            if error.status != 409:
                raise
            live = await client.get(kind, namespace, name)
            if live is None:
                raise
    if not owned_by(live, owner_uid):
        raise NotOwned(f"{kind} {namespace}/{name} exists and is not owned by this InferenceService")
    patch = merge_patch_for(
        {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}, live)
    patch = _merge(patch, removals(kind, desired, live))
    if not patch:
        return "unchanged"
    await client.merge_patch(kind, namespace, name, patch)
    return "patched"
