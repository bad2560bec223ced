"""One writer per owned object: what `converge` renders (pure tables), and the real Reconciler
against the API emulator over HTTP (its server-side apply: tests/operator/server_side_apply.py).

Without kopf: the handlers' methods are called as kopf would call them, so two timers can be
made to fire at the same instant.
"""

from __future__ import annotations

import asyncio
import copy
import logging

import kopf
import pytest
from aiohttp import web
from kopf._core.engines.posting import settings_var
from test_operator_e2e import TINY, defaulted

from kvserve.operator import desired as D
from kvserve.operator import manifests as M
from kvserve.operator import router as R
from kvserve.operator.handlers import OperatorConfig, Reconciler
from kvserve.operator.kube import KubeClient
from kvserve.operator.spec import model_shape, parse_spec
from kvserve.testing.e2e_harness import NAMESPACE, Api
from kvserve.testing.kube_emulator import EmulatorThread

pytestmark = pytest.mark.timeout(60)

ROUTED = copy.deepcopy(TINY)
ROUTED["metadata"]["name"] = "chat"
ROUTED["spec"]["parallelism"] = {"tensor": {"min": 1, "max": 1}}
ROUTED["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 60}
ROUTED["spec"]["router"] = {"enabled": True}


def owner(obj: dict) -> dict:
    return {**obj, "metadata": {**obj["metadata"], "uid": "uid-1"}}


# --- what converge renders: pure ---------------------------------------------------------------


def spec_of(obj: dict, **changes):
    obj = copy.deepcopy(defaulted(obj))
    for path, value in changes.items():
        node = obj["spec"]
        *parents, last = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return obj, parse_spec(obj["spec"])


@pytest.mark.parametrize("base, changes, status, expected", [
    # Nothing recorded yet: the initial size (a service that may sleep starts awake).
    (TINY, {}, {}, (1, 1)),
    (ROUTED, {}, {}, (1, 1)),
    # The autoscaler's recorded decision is what runs.
    (TINY, {}, {"desiredReplicas": 3, "tensorParallelSize": 2}, (3, 2)),
    (ROUTED, {}, {"desiredReplicas": 0, "tensorParallelSize": 1}, (0, 1)),
    # Bounds that moved under a recorded decision hold it within them.
    (TINY, {"autoscaling__maxReplicas": 2}, {"desiredReplicas": 3, "tensorParallelSize": 2}, (2, 2)),
    (TINY, {"autoscaling__minReplicas": 2}, {"desiredReplicas": 1, "tensorParallelSize": 1}, (2, 1)),
    # TP autoscaling off: the spec's TP, whatever was recorded.
    (TINY, {"autoscaling__tensorParallel": {"enabled": False}}, {"desiredReplicas": 2, "tensorParallelSize": 2},
     (2, 1)),
    # Autoscaling off: the manual size, whatever was recorded.
    (TINY, {"autoscaling__enabled": False, "replicas": 2}, {"desiredReplicas": 3, "tensorParallelSize": 2}, (2, 1)),
    # A recorded value that is not a count is ignored.
    (TINY, {}, {"desiredReplicas": "3", "tensorParallelSize": True}, (1, 1)),
])
def test_recorded_size(base, changes, status, expected):
    obj, spec = spec_of(base, **changes)
    assert D.recorded_size(spec, model_shape(spec), status) == expected


@pytest.mark.parametrize("base, changes, kinds", [
    (TINY, {}, [("NetworkPolicy", "tiny"), ("Service", "tiny"), ("PodDisruptionBudget", "tiny"),
                ("Deployment", "tiny")]),
    (TINY, {"networkPolicy": {"enabled": False}}, [("Service", "tiny"), ("PodDisruptionBudget", "tiny"),
                                                   ("Deployment", "tiny")]),
    (ROUTED, {}, [("NetworkPolicy", "chat"), ("NetworkPolicy", "chat-router"), ("Service", "chat"),
                  ("PodDisruptionBudget", "chat"), ("Deployment", "chat"), ("ServiceAccount", "chat-router"),
                  ("Role", "chat-router"), ("RoleBinding", "chat-router"), ("Deployment", "chat-router")]),
])
def test_owned_objects_in_apply_order_and_all_of_them_possible(base, changes, kinds):
    obj, spec = spec_of(base, **changes)
    objects = D.owned_objects(owner(obj), spec, replicas=2, tp=1)
    assert [D.key(o) for o in objects] == kinds
    possible = D.possible_objects(obj["metadata"]["name"])
    assert [k for k in possible if k in kinds] == kinds  # the same order: deletes run it backwards
    for o in objects:
        assert o["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    deployment = next(o for o in objects if D.key(o) == ("Deployment", obj["metadata"]["name"]))
    assert deployment["spec"]["replicas"] == 2
    assert objects == D.owned_objects(owner(obj), spec, replicas=2, tp=1)  # same input, same objects


# --- the Reconciler against the emulator -------------------------------------------------------


@pytest.fixture
def emulator():
    emu = EmulatorThread().start()
    yield emu
    emu.stop()


class Demand:
    """A router pod's /router/demand, on 127.0.0.1 (the pod's IP in the emulator)."""

    def __init__(self, held: int):
        self.held = held
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> Demand:
        app = web.Application()
        app.router.add_get("/router/demand", lambda _: web.json_response(
            {"held": self.held, "in_flight": self.held, "idle_seconds": 0}))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()


def reconciler_for(url: str, router_port: int = 1) -> Reconciler:
    reconciler = Reconciler(OperatorConfig(router_port=router_port, scrape_timeout=2.0,
                                           connection=kopf.ConnectionInfo(server=url)))
    reconciler.client = KubeClient(reconciler.config.connection)
    return reconciler


class Kopf:
    """What kopf hands a handler for one resource: its body, status, a patch and the memo."""

    def __init__(self, api: Api, name: str, memo: kopf.Memo | None = None):
        self.body = api.get_isvc(name)
        self.memo = memo if memo is not None else kopf.Memo()
        self.patch = kopf.Patch()

    def args(self):
        return (self.body, self.body.get("status") or {}, self.patch, self.memo, logging.getLogger("test"))


@pytest.fixture(autouse=True)
def no_events():
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # kopf.info/warn outside an operator: nothing to post to
    token = settings_var.set(settings)
    yield
    settings_var.reset(token)


def applies_to(emulator: EmulatorThread, path: str | None = None) -> int:
    """Server-side applies the emulator received (to `path`; None: to anything)."""
    return sum(1 for r in list(emulator.emulator)
               if str(r.method.value).upper() == "PATCH" and (path is None or r.url.path == path)
               and (r.headers or {}).get("Content-Type", "").startswith("application/apply-patch"))


def test_a_field_dropped_from_the_rendering_disappears_from_the_live_object(emulator):
    api = Api(emulator.url)
    obj = copy.deepcopy(TINY)
    obj["spec"]["gpu"].update(nodeSelector={"pool": "inference"}, tolerations=[{"key": "gpu", "operator": "Exists"}],
                              priorityClassName="high")
    api.apply_isvc(defaulted(obj))
    reconciler = reconciler_for(emulator.url)

    async def reconcile():
        await reconciler.reconcile(*Kopf(api, "tiny").args())

    try:
        asyncio.run(reconcile())
        pod = api.get("Deployment", "tiny")["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": "inference"} and pod["tolerations"] and pod["priorityClassName"]
        status = api.get_isvc("tiny")["status"]
        assert (status["desiredReplicas"], status["tensorParallelSize"]) == (1, 1)  # recorded before applied
        managed = api.get("Deployment", "tiny")["metadata"]["managedFields"]
        assert [m["manager"] for m in managed] == ["kvserve-operator"]

        # A person edits a field the operator renders, and adds one it does not.
        api.call("PATCH", "/apis/apps/v1/namespaces/default/deployments/tiny",
                 {"spec": {"minReadySeconds": 7, "revisionHistoryLimit": 1}}, "application/merge-patch+json")
        api.patch_spec("tiny", {"gpu": {"nodeSelector": None, "tolerations": None, "priorityClassName": None}})
        asyncio.run(reconcile())
        dep = api.get("Deployment", "tiny")
        pod = dep["spec"]["template"]["spec"]
        assert not {"nodeSelector", "tolerations", "priorityClassName"} & set(pod)
        assert dep["spec"]["revisionHistoryLimit"] == 5  # the operator's field is the operator's
        assert dep["spec"]["minReadySeconds"] == 7  # what it never rendered is not its business

        # Applying again changes nothing: no new version, no rollout.
        version = dep["metadata"]["resourceVersion"]
        asyncio.run(reconcile())
        assert api.get("Deployment", "tiny")["metadata"]["resourceVersion"] == version
    finally:
        asyncio.run(reconciler.client.close())


def test_the_service_selector_follows_the_router_switch_label_by_label(emulator):
    """With the router the Service selects the router pods, without it the runtime pods; a label
    of the other side left behind would select no pod at all."""
    api = Api(emulator.url)
    api.apply_isvc(defaulted(ROUTED))
    reconciler = reconciler_for(emulator.url)

    async def reconcile():
        await reconciler.reconcile(*Kopf(api, "chat").args())

    try:
        asyncio.run(reconcile())
        assert api.get("Service", "chat")["spec"]["selector"] == M.router_selector("chat")
        api.patch_spec("chat", {"router": {"enabled": False}, "autoscaling": {"minReplicas": 1}})
        asyncio.run(reconcile())
        assert api.get("Service", "chat")["spec"]["selector"] == M.selector_labels("chat")
        for kind in R.ROUTER_KINDS:
            assert api.get(kind, "chat-router") is None
        assert api.get("NetworkPolicy", "chat-router") is None and api.get("NetworkPolicy", "chat")
    finally:
        asyncio.run(reconciler.client.close())


def test_two_timers_firing_together_make_one_decision_and_one_write(emulator):
    """At zero with a request held, the wake timer and the autoscale timer both want to wake the
    service. One records the decision and converges; the other, under the same lock, reads the
    recorded size and finds nothing to do: one WakeOnDemand, one write of the Deployment."""
    api = Api(emulator.url)
    api.apply_isvc(defaulted(ROUTED))
    demand = Demand(held=2)

    async def scenario():
        await demand.start()
        reconciler = reconciler_for(emulator.url, router_port=demand.port)
        memo = kopf.Memo()  # kopf keeps one memo per resource, shared by its handlers
        try:
            await reconciler.reconcile(*Kopf(api, "chat", memo).args())
            # Asleep: the decision recorded, then converged, as the autoscale timer would.
            current = api.get_isvc("chat")
            await reconciler._record_size(current, {"desiredReplicas": 0})
            spec, shape = reconciler._validate(current)
            await reconciler.converge(current, spec, shape)
            assert api.get("Deployment", "chat")["spec"]["replicas"] == 0
            api.call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "chat-router-0", "namespace": NAMESPACE, "labels": M.router_selector("chat")},
                "status": {"phase": "Running", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "True"}]}})
            path = "/apis/apps/v1/namespaces/default/deployments/chat"
            before, before_all = applies_to(emulator, path), applies_to(emulator)
            version = api.get("Deployment", "chat")["metadata"]["resourceVersion"]
            wake, autoscale = Kopf(api, "chat", memo), Kopf(api, "chat", memo)
            await asyncio.gather(reconciler.wake(*wake.args()), reconciler.autoscale(*autoscale.args()))
            # A size changes the Deployment alone: the other objects' renderings did not change.
            assert applies_to(emulator) - before_all == 1
            return before, applies_to(emulator, path), version
        finally:
            await reconciler.client.close()
            await reconciler.demand_source.close()
            await reconciler.source.close()
            await demand.stop()

    before, after, version = asyncio.run(scenario())
    dep = api.get("Deployment", "chat")
    assert dep["spec"]["replicas"] == 1
    assert after - before == 1, "one timer applied the wake; the other found it done"
    assert int(dep["metadata"]["resourceVersion"]) > int(version)
    status = api.get_isvc("chat")["status"]
    assert [d["reason"] for d in status["decisions"]].count("WakeOnDemand") == 1
    assert status["desiredReplicas"] == 1 and status["lastWokenTime"]


def test_the_autoscale_tick_converges_to_the_recorded_size_before_deciding(emulator):
    """Level-triggered: a decision recorded but not applied (the apply failed), or a Deployment
    scaled behind the operator's back, is put right by the next tick, from status alone."""
    api = Api(emulator.url)
    api.apply_isvc(defaulted(TINY))
    reconciler = reconciler_for(emulator.url)
    path = "/apis/apps/v1/namespaces/default/deployments/tiny"

    async def scenario():
        memo = kopf.Memo()
        try:
            await reconciler.reconcile(*Kopf(api, "tiny", memo).args())
            await reconciler._record_size(api.get_isvc("tiny"), {"desiredReplicas": 2, "tensorParallelSize": 2})
            await reconciler.autoscale(*Kopf(api, "tiny", memo).args())
            first = api.get("Deployment", "tiny")
            api.call("PATCH", path, {"spec": {"replicas": 5}}, "application/merge-patch+json")  # kubectl scale
            await reconciler.autoscale(*Kopf(api, "tiny", memo).args())
            return first, api.get("Deployment", "tiny")
        finally:
            await reconciler.client.close()
            await reconciler.source.close()
            await reconciler.demand_source.close()

    first, second = asyncio.run(scenario())
    assert first["spec"]["replicas"] == 2 and first["metadata"]["annotations"][M.TP_ANNOTATION] == "2"
    assert second["spec"]["replicas"] == 2
    assert api.get_isvc("tiny")["status"]["desiredReplicas"] == 2
