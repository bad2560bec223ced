"""The operator's client for the objects it owns, and the apply-by-patch policy.

kopf handles the InferenceService itself (watch, finalizer, status patches). The objects an
InferenceService owns go through `kubernetes_asyncio`, the maintained async port of the official
Kubernetes client: its typed APIs, auth headers, TLS and error objects. `KubeClient` logs in the
way kopf did (kopf's `ConnectionInfo`), so both talk to the same cluster as the same identity.

What stays ours: the retry policy (operator/retry.py) and apply-by-patch (`apply` below).
kubernetes_asyncio 36 has a `Configuration.retries` field that nothing reads (its aiohttp
transport never retries), and the sync client's urllib3 retries would block kopf's event loop,
so each call here retries transient failures itself: 429/5xx, a conflicting write, a dropped
connection or a timeout, with jittered exponential backoff that honours Retry-After, bounded in
attempts and seconds. Whatever is left is raised as `APIError`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import aiohttp
import kopf
from kubernetes_asyncio import client as k8s

from .retry import RetryPolicy, next_delay, parse_retry_after, retryable

log = logging.getLogger("kvserve.operator.kube")
USER_AGENT = "kvserve-operator"


@dataclass(frozen=True)
class Kind:
    """Where a kind lives: its REST path (tests and the RBAC audit use it) and its typed API."""

    prefix: str
    plural: str
    api: type | None = None  # kubernetes_asyncio API class; None: a custom resource
    suffix: str = ""  # the typed API's method suffix, e.g. "namespaced_deployment"

    @property
    def group_version(self) -> tuple[str, str]:
        parts = self.prefix.strip("/").split("/")
        return (parts[1], parts[2]) if parts[0] == "apis" else ("", parts[1])


KINDS: dict[str, Kind] = {
    "Deployment": Kind("/apis/apps/v1", "deployments", k8s.AppsV1Api, "namespaced_deployment"),
    "Service": Kind("/api/v1", "services", k8s.CoreV1Api, "namespaced_service"),
    "PodDisruptionBudget": Kind("/apis/policy/v1", "poddisruptionbudgets", k8s.PolicyV1Api,
                                "namespaced_pod_disruption_budget"),
    "Pod": Kind("/api/v1", "pods", k8s.CoreV1Api, "namespaced_pod"),
    # The router's identity and rights (spec.router).
    "ServiceAccount": Kind("/api/v1", "serviceaccounts", k8s.CoreV1Api, "namespaced_service_account"),
    "Role": Kind("/apis/rbac.authorization.k8s.io/v1", "roles", k8s.RbacAuthorizationV1Api, "namespaced_role"),
    "RoleBinding": Kind("/apis/rbac.authorization.k8s.io/v1", "rolebindings", k8s.RbacAuthorizationV1Api,
                        "namespaced_role_binding"),
    # spec.networkPolicy: who may reach the pods (operator/netpol.py).
    "NetworkPolicy": Kind("/apis/networking.k8s.io/v1", "networkpolicies", k8s.NetworkingV1Api,
                          "namespaced_network_policy"),
    "InferenceService": Kind("/apis/kvserve.dev/v1alpha1", "inferenceservices"),
    "KopfPeering": Kind("/apis/kopf.dev/v1", "kopfpeerings"),
    "ClusterKopfPeering": Kind("/apis/kopf.dev/v1", "clusterkopfpeerings"),  # cluster-scoped
}
# kind -> (API prefix, plural), for callers that build paths themselves.
RESOURCES = {kind: (k.prefix, k.plural) for kind, k in KINDS.items()}


class APIError(Exception):
    """A call that failed for good: `status` is the last HTTP status (0: no answer at all)."""

    def __init__(self, status: int, method: str, path: str, message: str, attempts: int = 1):
        super().__init__(f"{method} {path}: {f'HTTP {status}' if status else 'no answer'}: {message}"
                         + (f" (after {attempts} attempts)" if attempts > 1 else ""))
        self.status = status
        self.attempts = attempts


class NotOwned(Exception):
    """An object with the name the operator wants exists but belongs to someone else."""


class _Answer(Exception):
    """One attempt's HTTP error, with what the retry policy needs."""

    def __init__(self, status: int, body: bytes, retry_after: str | None):
        super().__init__(status)
        self.status, self.body, self.retry_after = status, body, retry_after


# Failures of one attempt that mean "no answer": worth another attempt.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def _pem(data: str | bytes) -> bytes:
    """kubeconfig *-data fields are base64 of PEM; kopf also accepts PEM itself."""
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----BEGIN ") else base64.b64decode(raw)


def configuration_for(info: kopf.ConnectionInfo, files_dir: str | None = None) -> k8s.Configuration:
    """A kubernetes_asyncio Configuration for the cluster and TLS settings kopf logged in with.

    Certificates given as data are written under `files_dir` (the client reads only paths)."""
    config = k8s.Configuration(host=info.server.rstrip("/"))
    config.verify_ssl = not info.insecure

    def path(given, data, name):
        if given:
            return os.fsdecode(given)
        if data:
            if files_dir is None:
                raise ValueError(f"{name} given as data needs a directory to write it to")
            target = os.path.join(files_dir, name)
            with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(_pem(data))
            return target
        return None

    config.ssl_ca_cert = path(info.ca_path, info.ca_data, "ca.crt")
    config.cert_file = path(info.certificate_path, info.certificate_data, "client.crt")
    config.key_file = path(info.private_key_path, info.private_key_data, "client.key")
    if info.proxy_url:
        config.proxy = info.proxy_url
    return config


class KubeClient:
    """Owned-object calls (get, create, merge-patch, delete by name; list by labels), each
    retried under `policy`. Bodies go out and come back as plain dicts in the API's own
    (camelCase) field names: the builders and apply compare dicts, not typed models."""

    def __init__(self, info: kopf.ConnectionInfo, *, timeout: float = 10.0, policy: RetryPolicy | None = None,
                 rng: Callable[[], float] = random.random):
        self.info = info
        self.timeout = timeout
        self.policy = policy or RetryPolicy()
        self.rng = rng
        self.retries = 0  # attempts beyond the first, for logs and tests
        self._sleep = asyncio.sleep
        self._api: k8s.ApiClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._files: str | None = None

    def _client(self) -> k8s.ApiClient:
        # aiohttp sessions belong to one event loop: a client first used on another loop (a test
        # calling from its own) gets a fresh session instead of failing.
        loop = asyncio.get_running_loop()
        if self._api is None or self._loop is not loop:
            if self._files is None and (self.info.ca_data or self.info.certificate_data
                                        or self.info.private_key_data):
                self._files = tempfile.mkdtemp(prefix="kvserve-operator-")
            api = k8s.ApiClient(configuration_for(self.info, self._files))
            api.user_agent = USER_AGENT
            for header, value in self.info.as_http_headers().items():  # token or basic auth, as kopf
                api.set_default_header(header, value)
            self._api, self._loop = api, loop
        return self._api

    async def close(self) -> None:
        if self._api is not None:
            try:
                await self._api.close()
            except RuntimeError:  # its session belonged to a loop that is gone
                pass
        self._api = None
        if self._files is not None:
            shutil.rmtree(self._files, ignore_errors=True)
            self._files = None

    @staticmethod
    def path(kind: str, namespace: str | None, name: str | None = None) -> str:
        """The REST path; `namespace` None for a cluster-scoped kind."""
        k = KINDS[kind]
        path = f"{k.prefix}/namespaces/{namespace}/{k.plural}" if namespace else f"{k.prefix}/{k.plural}"
        return f"{path}/{name}" if name else path

    def _method(self, verb: str, kind: str, namespace: str, name: str | None):
        """The typed API call for (verb, kind) with its positional arguments bound."""
        k = KINDS[kind]
        api = self._client()
        if k.api is None:
            group, version = k.group_version
            custom = k8s.CustomObjectsApi(api)
            action, _, sub = verb.partition("_")
            scope = "namespaced" if namespace else "cluster"
            fn = getattr(custom, f"{'get' if action == 'read' else action}_{scope}_custom_object"
                                 + (f"_{sub}" if sub else ""))
            where = (namespace,) if namespace else ()
            return lambda *rest, **kw: fn(group, version, *where, k.plural, *((name,) if name else ()), *rest, **kw)
        action, _, sub = verb.partition("_")
        fn = getattr(k.api(api), f"{action}_{k.suffix}" + (f"_{sub}" if sub else ""))
        return lambda *rest, **kw: fn(*((name,) if name else ()), namespace, *rest, **kw)

    async def _once(self, call: Callable[[], Any]) -> Any:
        response = await call()
        try:
            body = await response.read()
            if not 200 <= response.status < 300:
                raise _Answer(response.status, body, response.headers.get("Retry-After"))
        finally:
            response.release()
        return json.loads(body) if body else None

    async def _call(self, method: str, path: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API call: attempts under the retry policy; an APIError once it gives up."""
        started = time.monotonic()
        failures = 0
        while True:
            try:
                return await self._once(lambda: call(*args, _preload_content=False,
                                                     _request_timeout=self.timeout, **kwargs))
            except _Answer as answer:
                status, detail, retry_after = answer.status, _message(answer.body), answer.retry_after
            except TRANSPORT_ERRORS as error:
                status, detail, retry_after = None, f"{type(error).__name__}: {error}".rstrip(": "), None
            failures += 1
            delay = None
            if retryable(status, method):
                delay = next_delay(self.policy, failures=failures, elapsed=time.monotonic() - started,
                                   retry_after=parse_retry_after(retry_after), rng=self.rng)
            if delay is None:
                raise APIError(status or 0, method, path, detail, attempts=failures)
            log.debug("%s %s: %s; attempt %d in %.2fs", method, path, status or detail, failures + 1, delay)
            self.retries += 1
            await self._sleep(delay)

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", self.path(kind, namespace, name), self._method("read", kind, namespace, name))
        except APIError as error:
            if error.status == 404:
                return None
            raise

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Creates `obj`; a 409 (it exists) is raised at once, for the caller to decide."""
        kind, namespace = obj["kind"], obj["metadata"]["namespace"]
        return await self._call("POST", self.path(kind, namespace), self._method("create", kind, namespace, None),
                                dict(obj))

    async def merge_patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any], *,
                          status: bool = False) -> dict[str, Any]:
        """A JSON merge patch of the object, or (`status=True`) of its status subresource."""
        path = self.path(kind, namespace, name) + ("/status" if status else "")
        return await self._call("PATCH", path, self._method("patch_status" if status else "patch", kind, namespace, name),
                                dict(patch), _content_type="application/merge-patch+json")

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Deletes by name (dependents in the background); False when it was already gone."""
        try:
            await self._call("DELETE", self.path(kind, namespace, name), self._method("delete", kind, namespace, name),
                             propagation_policy="Background")
            return True
        except APIError as error:
            if error.status == 404:
                return False
            raise

    async def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        data = await self._call("GET", self.path(kind, namespace), self._method("list", kind, namespace, None),
                                label_selector=selector)
        items = (data or {}).get("items") or []
        # Filter here too: cheap, and correct even where a server ignores labelSelector.
        return [i for i in items if all((i.get("metadata", {}).get("labels") or {}).get(k) == v
                                        for k, v in labels.items())]


def _message(body: bytes) -> str:
    """The API's Status message when the body is one, else the start of the body."""
    try:
        data = json.loads(body)
        if isinstance(data, dict) and data.get("message"):
            return str(data["message"])[:500]
    except ValueError:
        pass
    return body[:500].decode(errors="replace")


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


async def apply(client: KubeClient, desired: Mapping[str, Any], owner_uid: str, *, rounds: int = 4) -> str:
    """Creates `desired` or patches the live object toward it; returns "created", "patched" or "unchanged".

    A 409 on create means the object exists (another writer, or our own earlier create whose
    answer was lost): read it and patch it. If it is gone again by then, create once more."""
    meta = desired["metadata"]
    kind, namespace, name = desired["kind"], meta["namespace"], meta["name"]
    for _ in range(rounds):
        live = await client.get(kind, namespace, name)
        if live is None:
            try:
                await client.create(desired)
                return "created"
            except APIError as error:
                if error.status != 409:
                    raise
                continue
        if not owned_by(live, owner_uid):
            raise NotOwned(f"{kind} {namespace}/{name} exists and is not owned by this InferenceService")
        patch = merge_patch_for(
            {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}, live)
        patch = _merge(patch, removals(kind, desired, live))
        if not patch:
            return "unchanged"
        await client.merge_patch(kind, namespace, name, patch)
        return "patched"
    raise APIError(409, "POST", client.path(kind, namespace),
                   f"{kind} {name} kept answering 'already exists' but could not be read", attempts=rounds)
