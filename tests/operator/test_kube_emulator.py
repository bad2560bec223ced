"""The test-side emulator's watch semantics, which the operator's tests and `make demo` rely on.

Regression (`make demo` exited 2 about once in four runs): kopf lists InferenceServices, then
watches from the list's resourceVersion. The emulator used to stream only events that happened
after the watch request arrived, so an InferenceService created between kopf's list and its watch
(the demo applies one right after the operator's liveness endpoint answers, while kopf is still
starting its watches) was never seen: no Deployment, and the demo gave up after 30 s. A real API
server replays from the given resourceVersion; so does the emulator now.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from kvserve.testing import server_side_apply as ssa
from kvserve.testing.kube_emulator import EmulatorThread

PATH = "/apis/kvserve.dev/v1alpha1/namespaces/default/inferenceservices"


@pytest.fixture
def emulator():
    emu = EmulatorThread().start()
    yield emu
    emu.stop()


def isvc(name: str, finalizers: list[str] | None = None) -> dict:
    meta = {"name": name, "namespace": "default", **({"finalizers": finalizers} if finalizers else {})}
    return {"apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService", "metadata": meta, "spec": {}}


async def watch(url: str, since: str, count: int, timeout: float = 5.0) -> list[dict]:
    """The first `count` events of a watch from `since`."""
    events = []
    async with aiohttp.ClientSession() as http:
        async with http.get(url + PATH, params={"watch": "true", "resourceVersion": since}) as r:
            async with asyncio.timeout(timeout):
                async for line in r.content:
                    if line.strip():
                        events.append(json.loads(line))
                        if len(events) == count:
                            return events
    return events


async def call(url: str, method: str, path: str, body=None) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url + path, json=body) as r:
            return await r.json()


def test_an_object_created_between_list_and_watch_is_not_lost(emulator):
    async def scenario():
        listing = await call(emulator.url, "GET", PATH)
        since = listing["metadata"]["resourceVersion"]
        await call(emulator.url, "POST", PATH, isvc("early"))  # before the watch starts
        return await watch(emulator.url, since, 1)

    (event,) = emulator.call(scenario())
    assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "early")


def test_a_resumed_watch_gets_every_change_after_its_version_once_and_in_order(emulator):
    async def scenario():
        first = await call(emulator.url, "POST", PATH, isvc("a"))
        since = first["metadata"]["resourceVersion"]
        await call(emulator.url, "PATCH", f"{PATH}/a", {"spec": {"x": 1}})
        await call(emulator.url, "POST", PATH, isvc("b", finalizers=["kvserve.dev/operator"]))
        await call(emulator.url, "DELETE", f"{PATH}/a")
        await call(emulator.url, "DELETE", f"{PATH}/b")  # held by its finalizer: a change, not a deletion
        live_b = await call(emulator.url, "GET", f"{PATH}/b")
        events = await watch(emulator.url, since, 4)
        return events, live_b

    events, live_b = emulator.call(scenario())
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("MODIFIED", "a"), ("ADDED", "b"), ("DELETED", "a"), ("MODIFIED", "b")]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(set(versions))  # each event its own, increasing version
    # The deletionTimestamp change is a new version of the stored object too (kopf's JSON patches
    # test it: an event's version the object does not have would fail every patch with 422).
    assert events[-1]["object"]["metadata"]["deletionTimestamp"]
    assert live_b["metadata"]["resourceVersion"] == events[-1]["object"]["metadata"]["resourceVersion"]


def test_a_version_older_than_the_history_is_gone(emulator, monkeypatch):
    from kvserve.testing import kube_emulator

    monkeypatch.setattr(kube_emulator, "HISTORY", 3)

    async def scenario():
        for i in range(6):
            await call(emulator.url, "POST", PATH, isvc(f"o{i}"))
        return await watch(emulator.url, "1", 1)

    (event,) = emulator.call(scenario())
    assert event["type"] == "ERROR" and event["object"]["code"] == 410


# --- server-side apply -------------------------------------------------------------------------

DEPLOY = "/apis/apps/v1/namespaces/default/deployments"


def deployment(**spec) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": "default"},
            "spec": spec}


@pytest.mark.parametrize("live, applied, manager, want", [
    # Nothing live: the applied object, its fields owned by the applier.
    (None, {"spec": {"replicas": 2}}, "op", {"spec": {"replicas": 2}}),
    # A field the manager stops applying goes; one it keeps stays; a map left empty goes too.
    ({"spec": {"replicas": 2, "template": {"nodeSelector": {"gpu": "a"}}}},
     {"spec": {"replicas": 2}}, "op", {"spec": {"replicas": 2}}),
    # A list is one field: replaced whole, removed whole.
    ({"spec": {"tolerations": [{"key": "a"}, {"key": "b"}], "replicas": 1}},
     {"spec": {"tolerations": [{"key": "c"}], "replicas": 1}}, "op",
     {"spec": {"tolerations": [{"key": "c"}], "replicas": 1}}),
    # Labels are fields of their own: switching one label for another drops the old one.
    ({"spec": {"selector": {"a": "x"}}}, {"spec": {"selector": {"b": "x"}}}, "op", {"spec": {"selector": {"b": "x"}}}),
    # An empty map is a field (a podSelector that selects all pods).
    ({"spec": {"podSelector": {"matchLabels": {"a": "x"}}}}, {"spec": {"podSelector": {}}}, "op",
     {"spec": {"podSelector": {}}}),
])
def test_apply_merges_and_removes_what_the_manager_stopped_applying(live, applied, manager, want):
    if live is not None:
        live = ssa.apply(None, live, manager, force=True)  # owned by the same manager before
    out = ssa.apply(live, applied, manager, force=True)
    assert {k: v for k, v in out.items() if k != "metadata"} == want
    assert ssa.managers(out) == {manager: ssa.leaf_paths(applied)}


def test_a_field_another_manager_owns_stays_and_a_conflict_needs_force():
    live = ssa.apply(None, {"spec": {"replicas": 2, "paused": False}}, "op", force=True)
    live = ssa.apply(live, {"spec": {"minReadySeconds": 5}}, "person", force=True)
    # "op" stops applying paused and minReadySeconds was never its own: only paused goes.
    out = ssa.apply(live, {"spec": {"replicas": 2}}, "op", force=True)
    assert out["spec"] == {"replicas": 2, "minReadySeconds": 5}
    # Another value for a field another manager owns: refused without force, nothing lost.
    with pytest.raises(ssa.ApplyConflict, match="person.*minReadySeconds"):
        ssa.apply(out, {"spec": {"replicas": 2, "minReadySeconds": 9}}, "op", force=False)
    forced = ssa.apply(out, {"spec": {"replicas": 2, "minReadySeconds": 9}}, "op", force=True)
    assert forced["spec"]["minReadySeconds"] == 9
    assert ssa.managers(forced) == {"op": {("spec", "replicas"), ("spec", "minReadySeconds")}}
    # The same value is no conflict: both own it, and it stays until neither applies it.
    shared = ssa.apply(live, {"spec": {"replicas": 2, "minReadySeconds": 5}}, "op", force=False)
    assert ssa.managers(shared)["person"] == {("spec", "minReadySeconds")}
    assert ssa.apply(shared, {"spec": {"replicas": 2}}, "op", force=False)["spec"]["minReadySeconds"] == 5


def test_fields_v1_round_trip():
    paths = {("spec", "replicas"), ("spec", "template", "spec", "containers"), ("metadata", "labels", "a")}
    fields = ssa.to_fields_v1(paths)
    assert fields["f:spec"]["f:replicas"] == {} and ssa.from_fields_v1(fields) == paths


async def apply_over_http(url: str, body: dict, manager: str = "op", force: bool = True):
    async with aiohttp.ClientSession() as http:
        async with http.patch(f"{url}{DEPLOY}/{body['metadata']['name']}", data=json.dumps(body),
                              params={"fieldManager": manager, **({"force": "true"} if force else {})},
                              headers={"Content-Type": "application/apply-patch+yaml"}) as r:
            return r.status, await r.json()


def test_the_emulator_creates_applies_and_removes_dropped_fields_over_http(emulator):
    async def scenario():
        created = await apply_over_http(emulator.url, deployment(replicas=2, template={"spec": {
            "nodeSelector": {"gpu": "a100"}, "containers": [{"name": "c"}]}}))
        again = await apply_over_http(emulator.url, deployment(replicas=2, template={"spec": {
            "nodeSelector": {"gpu": "a100"}, "containers": [{"name": "c"}]}}))
        dropped = await apply_over_http(emulator.url, deployment(replicas=3, template={"spec": {
            "containers": [{"name": "c"}]}}))
        no_manager = await apply_over_http(emulator.url, deployment(replicas=1), manager="")
        return created, again, dropped, no_manager, await call(emulator.url, "GET", f"{DEPLOY}/web")

    created, again, dropped, no_manager, live = emulator.call(scenario())
    assert created[0] == 201 and created[1]["metadata"]["uid"] and created[1]["metadata"]["generation"] == 1
    # A no-op apply changes nothing, not even the version (no watch event, no rollout).
    assert again == (200, created[1])
    assert dropped[0] == 200 and "nodeSelector" not in dropped[1]["spec"]["template"]["spec"]
    assert int(dropped[1]["metadata"]["resourceVersion"]) > int(created[1]["metadata"]["resourceVersion"])
    assert dropped[1]["metadata"]["generation"] == 2 and dropped[1]["metadata"]["uid"] == created[1]["metadata"]["uid"]
    assert no_manager[0] == 422
    assert live == dropped[1]
    assert live["metadata"]["managedFields"][0]["manager"] == "op"
