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

from kube_emulator import EmulatorThread

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
    import kube_emulator

    monkeypatch.setattr(kube_emulator, "HISTORY", 3)

    async def scenario():
        for i in range(6):
            await call(emulator.url, "POST", PATH, isvc(f"o{i}"))
        return await watch(emulator.url, "1", 1)

    (event,) = emulator.call(scenario())
    assert event["type"] == "ERROR" and event["object"]["code"] == 410
