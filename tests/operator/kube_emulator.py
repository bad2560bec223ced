"""kmock's KubernetesEmulator with the gaps that matter to kopf patched (see ../shared/TESTING.md).

Patched here, in a test-side subclass pinned to kmock 0.8:
  * metadata.uid, resourceVersion (monotonic), creationTimestamp and generation (bumped when
    the spec changes) are set, and generateName is honoured (kopf's Events use it);
  * a watch that gives ?resourceVersion= does not replay every object as ADDED again;
  * a JSON patch whose `test` op fails answers 422 (not 500), and JSON patches bump
    resourceVersion too;
  * labelSelector (equality terms) is applied to lists;
  * the status subresource only changes status; where a resource has one, the main resource
    never changes status.
Not patched (the operator and the tests handle these): no controllers, no garbage collection,
no schema validation or defaulting, no server-side apply.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import threading
import uuid
from typing import Any

import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import enums, k8s

CRD_RESOURCE = "kvserve.dev/v1alpha1/inferenceservices"


@attrs.define(kw_only=True)
class PatchedEmulator(kmock.KubernetesEmulator):
    _counter: Any = attrs.field(factory=lambda: itertools.count(1), init=False)

    def _next_rv(self) -> str:
        return str(next(self._counter))

    async def _handle(self, request):
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

    async def _check_json_patch(self, request) -> None:
        """A JSON patch whose `test` op fails is a 422 (kopf then re-reads), not kmock's 500."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return  # the parent answers 404
        try:
            jsonpatch.apply_patch(copy.deepcopy(self._objects[key].raw), request.data)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as error:
            raise k8s.KubernetesError(status=422, reason="Invalid", message=f"the patch cannot be applied: {error}")
        request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_rv()})

    async def _serve_list(self, request):
        payload = await super()._serve_list(request)
        payload["metadata"]["resourceVersion"] = str(next(copy.copy(self._counter)))
        selector = request.params.get("labelSelector")
        if selector:
            terms = dict(t.split("=", 1) for t in selector.split(",") if "=" in t)
            payload["items"] = [i for i in payload["items"]
                                if all((i.get("metadata", {}).get("labels") or {}).get(k) == v
                                       for k, v in terms.items())]
        return payload

    async def _serve_watch(self, request):
        if not request.params.get("resourceVersion"):
            async for event in super()._serve_watch(request):
                yield event
            return
        # The client has just listed: stream only what happens from now on.
        yield b""
        async for event in self._buses[request.resource]:
            obj = event.get("object", {}).get("metadata", {})
            if request.namespace is None or obj.get("namespace") == request.namespace:
                yield event


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

    def start(self) -> "EmulatorThread":
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


