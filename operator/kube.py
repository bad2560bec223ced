"""The operator's client for the objects it owns, and the apply-by-patch policy.

kopf handles the InferenceService itself (watch, finalizer, status patches). The objects an
InferenceService owns go through `kubernetes_asyncio`, the maintained async port of the official
Kubernetes client: its typed APIs, auth headers, TLS and error objects. `KubeClient` logs in the
way kopf did (kopf's `ConnectionInfo`), so both talk to the same cluster as the same identity.

What stays ours: the retry policy (operator/retry.py) and `apply` below (server-side apply under
one field manager, after checking the object is this resource's).
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf
from kubernetes_asyncio import client as k8s

from .retry import RetryPolicy, next_delay, parse_retry_after, retryable

log = logging.getLogger("kvserve.operator.kube")
USER_AGENT = "kvserve-operator"
# Server-side apply: JSON is YAML, so the body goes out as JSON under this content type.
APPLY_PATCH = "application/apply-patch+yaml"
FIELD_MANAGER = "kvserve-operator"


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
    # spec.adapters: the LoRA adapter list the pods' agents read (operator/lora.py).
    "ConfigMap": Kind("/api/v1", "configmaps", k8s.CoreV1Api, "namespaced_config_map"),
    # spec.runtime.kvOffload with a storageClassName: the tier's claim (operator/kvcache.py).
    "PersistentVolumeClaim": Kind("/api/v1", "persistentvolumeclaims", k8s.CoreV1Api,
                                  "namespaced_persistent_volume_claim"),
    "PodDisruptionBudget": Kind("/apis/policy/v1", "poddisruptionbudgets", k8s.PolicyV1Api,
                                "namespaced_pod_disruption_budget"),
    "Pod": Kind("/api/v1", "pods", k8s.CoreV1Api, "namespaced_pod"),
    # spec.parallelism.devicesPerPod: the admin key the pods' agents check (read only).
    "Secret": Kind("/api/v1", "secrets", k8s.CoreV1Api, "namespaced_secret"),
    # The router's identity and rights (spec.router).
    "ServiceAccount": Kind("/api/v1", "serviceaccounts", k8s.CoreV1Api, "namespaced_service_account"),
    "Role": Kind("/apis/rbac.authorization.k8s.io/v1", "roles", k8s.RbacAuthorizationV1Api, "namespaced_role"),
    "RoleBinding": Kind("/apis/rbac.authorization.k8s.io/v1", "rolebindings", k8s.RbacAuthorizationV1Api,
                        "namespaced_role_binding"),
    # spec.networkPolicy: who may reach the pods (operator/netpol.py).
    "NetworkPolicy": Kind("/apis/networking.k8s.io/v1", "networkpolicies", k8s.NetworkingV1Api,
                          "namespaced_network_policy"),
    # Replicas larger than one node (operator/multinode.py); a custom resource (the LWS CRD).
    "LeaderWorkerSet": Kind("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
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
    """Owned-object calls (get, merge-patch, server-side apply, delete by name; list by
    labels), each
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

    async def merge_patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any], *,
                          status: bool = False) -> dict[str, Any]:
        """A JSON merge patch of the object, or (`status=True`) of its status subresource."""
        path = self.path(kind, namespace, name) + ("/status" if status else "")
        return await self._call("PATCH", path, self._method("patch_status" if status else "patch", kind, namespace, name),
                                dict(patch), _content_type="application/merge-patch+json")

    async def get_scale(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object's scale subresource (autoscaling/v1 Scale); None when the object is gone."""
        try:
            return await self._call("GET", self.path(kind, namespace, name) + "/scale",
                                    self._method("read_scale", kind, namespace, name))
        except APIError as error:
            if error.status == 404:
                return None
            raise

    async def scale(self, kind: str, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Sets spec.replicas through the scale subresource (a merge patch of the Scale)."""
        return await self._call("PATCH", self.path(kind, namespace, name) + "/scale",
                                self._method("patch_scale", kind, namespace, name),
                                {"spec": {"replicas": int(replicas)}}, _content_type="application/merge-patch+json")

    async def server_side_apply(self, obj: Mapping[str, Any], field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Applies `obj` (created when absent) under the operator's field manager, taking over
        fields another manager set: the operator is the one writer of what it renders."""
        kind, meta = obj["kind"], obj["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        return await self._call("PATCH", self.path(kind, namespace, name), self._method("patch", kind, namespace, name),
                                dict(obj), _content_type=APPLY_PATCH, field_manager=field_manager, force=True)

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


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


async def apply(client: KubeClient, desired: Mapping[str, Any], owner_uid: str,
                create_with: Mapping[str, Any] | None = None) -> str:
    """Server-side applies `desired`; returns "created", "patched" or "unchanged".

    The API server merges what the operator applies and removes every field the operator applied
    before and no longer does: no field list is kept here. An object of that name that exists
    and is someone else's is left alone (NotOwned): `force` only settles field conflicts on
    objects this resource owns (a person who edited a field the operator renders loses the
    edit, as the one-writer rule wants). Between the read and the apply another writer could
    still create it: the apply would then take over the fields the operator renders.
    `create_with`: what to apply instead when the object does not exist yet."""
    meta = desired["metadata"]
    kind, namespace, name = desired["kind"], meta["namespace"], meta["name"]
    live = await client.get(kind, namespace, name)
    if live is not None and not owned_by(live, owner_uid):
        raise NotOwned(f"{kind} {namespace}/{name} exists and is not owned by this InferenceService")
    result = await client.server_side_apply(desired if live is not None or create_with is None else create_with)
    if live is None:
        return "created"
    version = (result or {}).get("metadata", {}).get("resourceVersion")
    return "unchanged" if version == live["metadata"].get("resourceVersion") else "patched"
