"""kmock's KubernetesEmulator with the gaps that matter to kopf patched (see ../shared/TESTING.md).

Patched here, in a test-side subclass pinned to kmock 0.8:
  * metadata.uid, resourceVersion (monotonic), creationTimestamp and generation (bumped when
    the spec changes) are set, and generateName is honoured (kopf's Events use it);
  * a watch that gives ?resourceVersion= does not replay every object as ADDED again: it
    streams what changed after that version (kept in a per-resource history, as etcd's watch
    cache does), so a client that reconnects after a cut stream misses nothing; a version older
    than the history answers 410 Gone, as a real server does; DELETED events get a version of
    their own, a delete that only sets deletionTimestamp (finalizers) bumps the version, and a
    list's resourceVersion is the latest one given out;
  * a JSON patch whose `test` op fails answers 422 (not 500), and JSON patches bump
    resourceVersion too;
  * labelSelector (equality terms) is applied to lists;
  * the status subresource only changes status; where a resource has one, the main resource
    never changes status.
  * the scale subresource (`GET`/`PATCH .../scale`, where a resource declares one) answers an
    autoscaling/v1 Scale (spec.replicas from the object's spec, status.replicas and the selector
    from its status, as LeaderWorkerSet's CRD maps them) and a patch of it changes the object's
    spec.replicas alone; kmock itself would patch the Scale's fields into the object;
  * server-side apply (`PATCH` with `application/apply-patch+yaml`): creates or merges, records
    each manager's fields in metadata.managedFields and removes the fields a manager stops
    applying (server_side_apply.py says what that emulation leaves out).
Not patched (the operator and the tests handle these): no controllers, no garbage collection,
no schema validation or defaulting.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import itertools
import threading
import uuid
from typing import Any, ClassVar

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import aiobus, enums, k8s

from kvserve.testing import server_side_apply as ssa

CRD_RESOURCE = "kvserve.dev/v1alpha1/inferenceservices"


HISTORY = 20_000  # watch events kept per resource for resuming watches


@attrs.mutable(weakref_slot=True)
class HistoryBus(aiobus.Bus):
    """kmock's event bus, also remembering each event (with its resourceVersion) for replays."""

    history: list = attrs.field(factory=list)
    trimmed_up_to: int = 0  # versions at or below this may be missing from `history`
    stamp: Any = None  # gives out the next resourceVersion

    async def put(self, item):
        # A deletion gets a version of its own, as in a real watch (the object is gone, so no
        # stored version disagrees with it).
        item = copy.deepcopy(item)
        if self.stamp is not None and item.get("type") == "DELETED":
            item["object"].setdefault("metadata", {})["resourceVersion"] = self.stamp()
        self.history.append(item)
        if len(self.history) > HISTORY:
            dropped = self.history[: len(self.history) - HISTORY]
            del self.history[: len(dropped)]
            self.trimmed_up_to = max([self.trimmed_up_to] + [_rv(e) for e in dropped])
        await super().put(item)


def _rv(event) -> int:
    try:
        return int(event.get("object", {}).get("metadata", {}).get("resourceVersion"))
    except (TypeError, ValueError):
        return 0


@attrs.define(kw_only=True)
class PatchedEmulator(kmock.KubernetesEmulator):
    _counter: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    # API groups this cluster does not serve (a CRD not installed): every call answers 404, as
    # an API server does. kmock itself serves any path.
    UNSERVED_GROUPS: ClassVar[set[str]] = set()

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._buses = collections.defaultdict(lambda: HistoryBus(stamp=self._next_rv))

    def _next_rv(self) -> str:
        return str(next(self._counter))

    async def _handle(self, request):
        if request.resource is not None and (request.resource.group or "") in self.UNSERVED_GROUPS:
            return _status(404, "NotFound", "the server could not find the requested resource")
        if (request.resource is not None and request.subresource == "scale" and request.name is not None
                and request.action in (enums.action.FETCH, enums.action.UPDATE)):
            return await self._scale(request)
        if (request.resource is not None and request.action == enums.action.UPDATE and request.name is not None
                and (request.headers or {}).get("Content-Type", "").startswith("application/apply-patch")):
            return await self._server_side_apply(request)
        if (request.resource is not None and request.action == enums.action.DELETE
                and request.name is not None):
            # With finalizers a delete only sets deletionTimestamp: a change, so a new version.
            key = (request.resource, request.namespace, request.name)
            live = self._objects[key].raw if key in self._objects and not self._objects[key].deleted else None
            meta = (live or {}).get("metadata", {})
            if meta.get("finalizers") and not meta.get("deletionTimestamp"):
                self._objects[key].patch({"metadata": {"resourceVersion": self._next_rv()}})
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == enums.action.CREATE:
                meta = request.data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
                meta.setdefault("namespace", request.namespace)
                meta["uid"] = str(uuid.uuid4())
                meta["resourceVersion"] = self._next_rv()
                meta["generation"] = 1
                meta["creationTimestamp"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            elif request.action == enums.action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                live = self._objects[key].raw if key in self._objects and not self._objects[key].deleted else None
                if live is not None:
                    data = request.data
                    has_status = (request.resource in self._resources
                                  and "status" in self._resources[request.resource].subresources)
                    if request.subresource == "status":
                        for k in list(data):
                            if k != "status":
                                del data[k]
                    elif has_status:
                        data.pop("status", None)
                    meta = data.setdefault("metadata", {})
                    meta["resourceVersion"] = self._next_rv()
                    if "spec" in data and _merged(live.get("spec"), data["spec"]) != live.get("spec"):
                        meta["generation"] = int(live["metadata"].get("generation", 1)) + 1
        elif (request.resource is not None and isinstance(request.data, list)
              and request.action == enums.action.UPDATE and request.name is not None):
            await self._check_json_patch(request)
        return await super()._handle(request)

    async def _server_side_apply(self, request):
        """Creates the object or applies to it (see server_side_apply.py); a no-op changes nothing,
        not even the resourceVersion, as on a real server."""
        manager = request.params.get("fieldManager")
        if not manager:
            return _status(422, "Invalid", "fieldManager is required for apply requests")
        if request.subresource is not None:
            return _status(422, "Invalid", "this emulation applies to main resources only")
        try:
            applied = ssa.parse_body(request.data if request.data is not None else request.body)
        except ValueError as error:
            return _status(400, "BadRequest", f"the apply body is not YAML or JSON: {error}")
        meta = applied.get("metadata") or {}
        if meta.get("name") not in (None, request.name):
            return _status(400, "BadRequest", "the body's metadata.name differs from the URL's")
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            exists = key in self._objects and not self._objects[key].deleted
            live = copy.deepcopy(self._objects[key].raw) if exists else None
            try:
                new = ssa.apply(live, applied, manager, force=request.params.get("force") == "true")
            except ssa.ApplyConflict as error:
                return _status(409, "Conflict", str(error))
            if live is not None and new == live:
                return aiohttp.web.json_response(live)
            meta = new["metadata"]
            meta.update(name=request.name, namespace=request.namespace, resourceVersion=self._next_rv())
            if live is None:
                meta.update(uid=str(uuid.uuid4()), generation=1,
                            creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
                if key in self._objects:
                    self._objects[key].create(new)
                else:
                    self._objects[key] = new
                event = "ADDED"
            else:
                if new.get("spec") != live.get("spec"):
                    meta["generation"] = int(live["metadata"].get("generation", 1)) + 1
                self._objects[key].patch(_diff(live, new))
                event = "MODIFIED"
            raw = self._objects[key].raw
            await self._buses[request.resource].put({"type": event, "object": raw})
        return aiohttp.web.json_response(raw, status=201 if live is None else 200)

    async def _scale(self, request):
        info = self._resources.get(request.resource)
        if info is None or "scale" not in info.subresources:
            return _status(404, "NotFound", "the server could not find the requested resource")
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                return _status(404, "NotFound", f"{request.resource.plural} {request.name!r} not found")
            live = self._objects[key].raw
            if request.action == enums.action.UPDATE:
                patch = request.data if isinstance(request.data, dict) else {}
                replicas = (patch.get("spec") or {}).get("replicas")
                if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                    return _status(422, "Invalid", "spec.replicas: a Scale's replicas must be an integer >= 0")
                if (live.get("spec") or {}).get("replicas") != replicas:
                    generation = int(live["metadata"].get("generation", 1)) + 1
                    self._objects[key].patch({"spec": {"replicas": replicas},
                                              "metadata": {"resourceVersion": self._next_rv(),
                                                           "generation": generation}})
                    live = self._objects[key].raw
                    await self._buses[request.resource].put({"type": "MODIFIED", "object": live})
            meta, status = live["metadata"], live.get("status") or {}
            scale = {"apiVersion": "autoscaling/v1", "kind": "Scale",
                     "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta},
                     "spec": {"replicas": (live.get("spec") or {}).get("replicas", 0)},
                     "status": {"replicas": status.get("replicas", 0)}}
            selector = status.get("hpaPodSelector") or status.get("selector")
            if selector:
                scale["status"]["selector"] = selector
        return aiohttp.web.json_response(scale)

    async def _check_json_patch(self, request) -> None:
        """A JSON patch whose `test` op fails is a 422 (kopf then re-reads), not kmock's 500."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return  # the parent answers 404
        try:
            jsonpatch.apply_patch(copy.deepcopy(self._objects[key].raw), request.data)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as error:
            raise k8s.KubernetesError(status=422, reason="Invalid", message=f"the patch cannot be applied: {error}") from error
        request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_rv()})

    async def _serve_list(self, request):
        payload = await super()._serve_list(request)
        payload["metadata"]["resourceVersion"] = str(next(copy.copy(self._counter)) - 1)  # the latest given out
        selector = request.params.get("labelSelector")
        if selector:
            terms = dict(t.split("=", 1) for t in selector.split(",") if "=" in t)
            payload["items"] = [i for i in payload["items"]
                                if all((i.get("metadata", {}).get("labels") or {}).get(k) == v
                                       for k, v in terms.items())]
        return payload

    async def _serve_watch(self, request):
        try:
            since = int(request.params.get("resourceVersion") or "")
        except ValueError:
            since = None
        if since is None:
            async for event in super()._serve_watch(request):
                yield event
            return
        # Continue after `since`: first what the history holds after it, then the live bus.
        bus = self._buses[request.resource]
        mark = await bus.mark()  # before reading the history: nothing falls between the two
        try:
            yield b""
            if since < bus.trimmed_up_to:
                yield {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                   "reason": "Expired", "code": 410,
                                                   "message": f"too old resource version: {since}"}}
                return
            replayed = set()  # events both in the history and after the mark: send them once
            for event in list(bus.history):
                if _rv(event) > since and self._in_namespace(request, event):
                    replayed.add(id(event))
                    yield event
            async for event in mark:
                if id(event) not in replayed and self._in_namespace(request, event):
                    yield event
        finally:
            await bus.unmark(mark)

    @staticmethod
    def _in_namespace(request, event) -> bool:
        meta = event.get("object", {}).get("metadata", {})
        return request.namespace is None or meta.get("namespace") == request.namespace


def _status(code: int, reason: str, message: str):
    return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                      "code": code, "reason": reason, "message": message}, status=code)


def _diff(old: Any, new: Any) -> Any:
    """A merge patch (None deletes) turning `old` into `new`, for kmock's versioned objects."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    out = {k: None for k in old if k not in new}
    out.update({k: _diff(old.get(k), v) for k, v in new.items() if old.get(k) != v})
    return out


def _merged(base: Any, patch: Any) -> Any:
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return patch
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merged(base.get(k), v)
    return out


def declare_resources(emulator: kmock.KubernetesEmulator) -> None:
    info = kmock.ResourceInfo
    verbs = {"get", "list", "watch", "create", "patch", "delete"}
    emulator.resources[CRD_RESOURCE] = info(kind="InferenceService", singular="inferenceservice", namespaced=True,
                                            verbs=verbs, subresources={"status", "scale"})
    emulator.resources["apps/v1/deployments"] = info(kind="Deployment", singular="deployment", namespaced=True,
                                                     verbs=verbs, subresources={"status", "scale"})
    emulator.resources["v1/services"] = info(kind="Service", singular="service", namespaced=True, verbs=verbs)
    emulator.resources["v1/configmaps"] = info(kind="ConfigMap", singular="configmap", namespaced=True, verbs=verbs)
    emulator.resources["v1/persistentvolumeclaims"] = info(kind="PersistentVolumeClaim",
                                                           singular="persistentvolumeclaim", namespaced=True,
                                                           verbs=verbs, subresources={"status"})
    emulator.resources["v1/pods"] = info(kind="Pod", singular="pod", namespaced=True, verbs=verbs,
                                         subresources={"status"})
    # Discovered only: kopf waits for the resource to exist even with scanning disabled.
    emulator.resources["v1/namespaces"] = info(kind="Namespace", singular="namespace", namespaced=False,
                                               verbs=verbs)
    emulator.resources["v1/events"] = info(kind="Event", singular="event", namespaced=True, verbs=verbs)
    emulator.resources["kopf.dev/v1/kopfpeerings"] = info(kind="KopfPeering", singular="kopfpeering",
                                                          namespaced=True, verbs=verbs)
    emulator.resources["policy/v1/poddisruptionbudgets"] = info(kind="PodDisruptionBudget",
                                                                singular="poddisruptionbudget",
                                                                namespaced=True, verbs=verbs)
    # The router's identity and rights (spec.router).
    emulator.resources["v1/serviceaccounts"] = info(kind="ServiceAccount", singular="serviceaccount",
                                                    namespaced=True, verbs=verbs)
    emulator.resources["rbac.authorization.k8s.io/v1/roles"] = info(kind="Role", singular="role",
                                                                    namespaced=True, verbs=verbs)
    emulator.resources["rbac.authorization.k8s.io/v1/rolebindings"] = info(kind="RoleBinding", singular="rolebinding",
                                                                           namespaced=True, verbs=verbs)
    # spec.networkPolicy.
    emulator.resources["networking.k8s.io/v1/networkpolicies"] = info(kind="NetworkPolicy", singular="networkpolicy",
                                                                      namespaced=True, verbs=verbs)


class EmulatorThread:
    """Runs the patched emulator on 127.0.0.1:<free port> in its own thread and event loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.url: str | None = None
        self.emulator: PatchedEmulator | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with PatchedEmulator() as emulator, kmock.Server(emulator) as server:
            declare_resources(emulator)
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._started.set()
            await self._stop.wait()

    def start(self) -> EmulatorThread:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("kmock emulator did not start")
        return self

    def call(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


