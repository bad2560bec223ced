"""End to end, spec.router and scale to zero: the real operator against the API emulator, with the
router pods played by real `kvserve router` processes (logged in to the emulator) and the runtime
pods by stub engines behind real agents (e2e_harness.Kubelet)."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
import time
import urllib.request

import kopf
import pytest
import yaml
from test_operator_e2e import TINY, VERBS, assert_operator_calls_are_documented

from kvserve.operator import crd
from kvserve.operator import manifests as M
from kvserve.operator import router as R
from kvserve.operator.handlers import OperatorConfig
from kvserve.testing.e2e_harness import Api, Kubelet, Load, OperatorThread, condition, free_port_on_all, wait_for
from kvserve.testing.kube_emulator import EmulatorThread

pytestmark = pytest.mark.timeout(300)

IDLE = 2.0
ROUTED = copy.deepcopy(TINY)
ROUTED["metadata"]["name"] = "chat"
ROUTED["spec"]["parallelism"] = {"tensor": {"min": 1, "max": 1}}
ROUTED["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": IDLE,
                                 "scaleUpStabilizationSeconds": 1, "scaleDownStabilizationSeconds": 60}
ROUTED["spec"]["router"] = {"enabled": True, "holdTimeoutSeconds": 60}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    emulator = EmulatorThread().start()
    ips = [f"127.0.0.{i}" for i in range(2, 40)]
    agent_port, engine_port, router_port = (free_port_on_all(ips) for _ in range(3))
    kubeconfig = tmp_path_factory.mktemp("router-e2e") / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": emulator.url}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "router"}}],
        "users": [{"name": "router", "user": {"token": "router"}}]}))
    load = Load()
    load.kv, load.queue, load.running = 0.05, 0, 0  # idle pods: only the router's word keeps them up
    kubelet = Kubelet(emulator.url, agent_port, engine_port, load, router_port=router_port,
                      kubeconfig=str(kubeconfig))
    task = asyncio.run_coroutine_threadsafe(kubelet.run(), emulator.loop)
    yield emulator, Api(emulator.url), kubelet, load
    kubelet.stopped = True
    task.result(30)
    emulator.stop()


def start_operator(emulator, kubelet) -> OperatorThread:
    config = OperatorConfig(scrape_interval=0.3, scrape_timeout=2.0, agent_port=kubelet.agent_port,
                            router_port=kubelet.router_port, wake_interval=0.3, max_sample_age=3.0,
                            connection=kopf.ConnectionInfo(server=emulator.url))
    return OperatorThread(emulator.url, config).start()


def ready_endpoints(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=5) as r:
            return json.loads(r.read())["ready_endpoints"]
    except OSError:
        return None


def post_completion(url: str, out: list, timeout: float = 60) -> None:
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": "tiny", "prompt": "wake up"}).encode(),
                                 headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out.append((r.status, json.loads(r.read()), time.monotonic() - started))
    except Exception as error:  # the test asserts on what came back
        out.append((getattr(error, "code", 0), str(error), time.monotonic() - started))


# The router's RBAC, as operator/router.py grants it; every call a router made must be in it.
ROUTER_RBAC = {("", "pods"): {"get", "list", "watch"}}


def router_calls(emulator) -> set:
    used = set()
    for request in list(emulator.emulator):
        if (request.headers or {}).get("User-Agent", "") != "kvserve-router" or request.resource is None:
            continue
        used.add((request.resource.group or "", request.resource.plural, VERBS.get(str(request.action.value).lower(), "?")))
    return used


def test_router_objects_scale_to_zero_and_wake_on_a_held_request(cluster):
    emulator, api, kubelet, load = cluster
    op = start_operator(emulator, kubelet)
    try:
        assert crd.validate(ROUTED) == []
        isvc = api.apply_isvc(crd.apply_defaults(ROUTED, crd.openapi_schema()))
        uid = isvc["metadata"]["uid"]
        # The router's objects, owned by the resource; the Service points at the router.
        for kind in R.ROUTER_KINDS:
            obj = wait_for(lambda: api.get(kind, "chat-router"), timeout=60, what=f"router {kind}")
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        role = api.get("Role", "chat-router")
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
        binding = api.get("RoleBinding", "chat-router")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "default"}]
        dep = api.get("Deployment", "chat-router")
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "chat-router"
        assert wait_for(lambda: api.get("Service", "chat"), what="Service")["spec"]["selector"] == \
            M.router_selector("chat")
        # It starts awake, then sleeps once idle for scaleToZeroAfterSeconds.
        assert api.get("Deployment", "chat")["spec"]["replicas"] == 1
        wait_for(lambda: any(p.name.startswith("chat-router") for p in kubelet.pods.values()), timeout=60,
                 what="router pod")
        wait_for(lambda: api.get("Deployment", "chat")["spec"]["replicas"] == 0, timeout=60, what="scale to zero")
        # The decision is recorded before it is applied, the conditions after: wait for both.
        isvc = wait_for(lambda: (o := api.get_isvc("chat")) and o["status"].get("lastScaledToZeroTime")
                        and condition(o, "Ready").get("reason") == "ScaledToZero" and o,
                        timeout=60, what="status after sleeping")
        slept = isvc["status"]["decisions"][-1]
        assert slept["reason"] == "ScaleToZero" and (slept["fromReplicas"], slept["toReplicas"]) == (1, 0)
        idle = float(re.search(r"no request through the router for (\d+)s", slept["message"]).group(1))
        assert idle >= IDLE  # the router's own count of idle seconds, not the test's clock
        assert condition(isvc, "Ready")["reason"] == "ScaledToZero"
        wait_for(lambda: not [p for p in kubelet.pods if p.startswith("chat-") and "router" not in p],
                 timeout=60, what="runtime pods gone")

        # A request while at zero is held by the router, wakes the service, and is answered.
        router = next(p for p in kubelet.pods.values() if p.name.startswith("chat-router"))
        # The router's pod watch may trail the kubelet by a moment; a request sent before it saw
        # the last pod go would be proxied there and never held.
        wait_for(lambda: ready_endpoints(f"http://{router.ip}:{router.port}") == 0, timeout=30,
                 what="the router to see no pod")
        answers: list = []
        served_before = load.completions
        client = threading.Thread(target=post_completion, args=(f"http://{router.ip}:{router.port}", answers))
        client.start()
        wait_for(lambda: api.get("Deployment", "chat")["spec"]["replicas"] == 1, timeout=60, what="wake")
        client.join(90)
        (status, body, waited), = answers
        assert status == 200, body
        assert body["choices"][0]["text"].startswith(" from chat-") and load.completions == served_before + 1
        isvc = wait_for(lambda: (o := api.get_isvc("chat")) and o["status"].get("lastWokenTime") and o,
                        timeout=60, what="status after waking")
        reasons = [d["reason"] for d in isvc["status"]["decisions"]]
        woke = reasons.index("WakeOnDemand")
        assert woke > 0 and reasons[woke - 1] == "ScaleToZero"  # (it may sleep again once idle)
        events = {e["reason"] for e in api.events() if e["involvedObject"].get("name") == "chat"}
        assert {"ScaleToZero", "WakeOnDemand"} <= events
        print(f"held request answered after {waited:.1f}s (wake, pod start, router release)")

        # Every API call of the operator and of the router was within their documented RBAC.
        assert_operator_calls_are_documented(emulator)
        used = router_calls(emulator)
        assert used and all(verb in ROUTER_RBAC.get((g, r), set()) for g, r, verb in used), used

        # Router off (and minReplicas back to 1): its objects go, the Service points at the pods.
        api.patch_spec("chat", {"router": {"enabled": False}, "autoscaling": {"minReplicas": 1}})
        for kind in R.ROUTER_KINDS:
            wait_for(lambda: api.get(kind, "chat-router") is None, timeout=60, what=f"router {kind} removed")
        assert wait_for(lambda: (s := api.get("Service", "chat")) and s["spec"]["selector"] == M.selector_labels("chat")
                        and s, timeout=60, what="Service back on the pods")

        api.delete_isvc("chat")
        wait_for(lambda: api.get_isvc("chat") is None, timeout=60, what="resource gone")
        assert api.get("Deployment", "chat") is None
    finally:
        op.stop()


def test_min_replicas_zero_without_router_is_refused_and_nothing_is_made(cluster):
    emulator, api, kubelet, load = cluster
    bad = copy.deepcopy(ROUTED)
    bad["metadata"]["name"] = "nodoor"
    bad["spec"]["router"] = {"enabled": False}
    assert crd.validate(bad) == ["<root>.spec: spec.autoscaling.minReplicas 0 (scale to zero) needs "
                                 "spec.router.enabled: true"]
    op = start_operator(emulator, kubelet)
    try:
        api.apply_isvc(bad)  # the emulator does not validate; the operator must refuse it itself
        isvc = wait_for(lambda: (o := api.get_isvc("nodoor")) and condition(o, "Degraded").get("status") == "True"
                        and o, timeout=60, what="Degraded")
        assert condition(isvc, "Degraded")["reason"] == "InvalidSpec"
        assert "spec.autoscaling.minReplicas: 0 (scale to zero) needs spec.router.enabled" in \
            condition(isvc, "Degraded")["message"]
        time.sleep(1)
        for kind in ("Deployment", "Service", "PodDisruptionBudget"):
            assert api.get(kind, "nodoor") is None
        api.delete_isvc("nodoor")
        wait_for(lambda: api.get_isvc("nodoor") is None, what="resource gone")
    finally:
        op.stop()


def test_kv_offload_and_kv_events_reach_the_cluster(cluster):
    """spec.runtime.kvOffload and the router's KV events, through the real operator into the API:
    the tier's claim the operator creates (owned by the service, kept when the tier is turned off),
    the runtime Deployment's tier flags, volume and events ports, its pods' events annotation, and
    the router Deployment's subscription flag, which the router's own parser takes."""
    from kvserve.operator import kvcache as K
    from kvserve.operator.spec import parse_spec
    from kvserve.runtime.cli import build_parser
    from kvserve.runtime.kv_events import KVEventsConfig

    emulator, api, kubelet, load = cluster
    obj = copy.deepcopy(TINY)
    obj["metadata"]["name"] = "cached"
    obj["spec"]["parallelism"] = {"tensor": {"min": 1, "max": 1}}
    obj["spec"]["router"] = {"enabled": True}
    obj["spec"]["runtime"] = {"kvOffload": {"size": "1Gi", "medium": "pvc", "storageClassName": "nfs-rwx"}}
    assert crd.validate(obj) == []  # claimSize has a default
    op = start_operator(emulator, kubelet)
    try:
        api.apply_isvc(crd.apply_defaults(obj, crd.openapi_schema()))
        dep = wait_for(lambda: api.get("Deployment", "cached"), timeout=60, what="runtime Deployment")
        template = dep["spec"]["template"]
        runtime = next(c for c in template["spec"]["containers"] if c["name"] == "runtime")
        command = runtime["command"]
        assert command[command.index("--kv-offload-bytes") + 1] == str(1024**3)
        assert command[command.index("--kv-offload-dir") + 1] == K.OFFLOAD_DIR
        assert KVEventsConfig.parse(command[command.index("--kv-events-config") + 1]).active
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == K.OFFLOAD_VOLUME)
        assert volume["persistentVolumeClaim"]["claimName"] == "cached-kv-offload"
        claim = api.get("PersistentVolumeClaim", "cached-kv-offload")
        assert claim["spec"]["storageClassName"] == "nfs-rwx" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert claim["metadata"]["ownerReferences"][0]["uid"] == api.get_isvc("cached")["metadata"]["uid"]
        spec = parse_spec(crd.apply_defaults(obj, crd.openapi_schema())["spec"])
        assert claim["spec"]["resources"]["requests"]["storage"] == str(K.default_claim_bytes(spec))
        assert {p["name"] for p in runtime["ports"]} >= {"kv-events", "kv-replay"}
        assert template["metadata"]["annotations"][K.EVENTS_PORT_ANNOTATION] == str(K.EVENTS_PORT)
        router = wait_for(lambda: api.get("Deployment", "cached-router"), timeout=60, what="router Deployment")
        router_command = router["spec"]["template"]["spec"]["containers"][0]["command"]
        assert build_parser().parse_args(router_command[1:]).kv_events_port == K.EVENTS_PORT
        isvc = wait_for(lambda: (o := api.get_isvc("cached")) and o.get("status", {}).get("conditions") and o,
                        timeout=60, what="status")
        assert condition(isvc, "Ready")  # the service reports its state with the tier on
        # No volume is bound to the claim yet (the emulator has no provisioner): the service says
        # so, and says so again once the claim binds.
        isvc = wait_for(lambda: (o := api.get_isvc("cached")) and condition(o, K.CLAIM_CONDITION) and o,
                        timeout=60, what="claim condition")
        assert (condition(isvc, K.CLAIM_CONDITION)["status"], condition(isvc, K.CLAIM_CONDITION)["reason"]) == \
            ("False", "ClaimPending")
        from kvserve.operator.kube import KubeClient
        from kvserve.testing.e2e_harness import NAMESPACE

        api.call("PATCH", KubeClient.path("PersistentVolumeClaim", NAMESPACE, "cached-kv-offload") + "/status",
                 {"status": {"phase": "Bound"}}, "application/merge-patch+json")
        wait_for(lambda: condition(api.get_isvc("cached"), K.CLAIM_CONDITION).get("status") == "True",
                 timeout=60, what="claim bound")
        # The tier off: the pods lose the volume, the claim (its prefixes) stays until the service goes.
        api.patch_spec("cached", {"runtime": {"kvOffload": None}})
        wait_for(lambda: "--kv-offload-bytes" not in next(
            c for c in api.get("Deployment", "cached")["spec"]["template"]["spec"]["containers"]
            if c["name"] == "runtime")["command"], timeout=60, what="tier off")
        assert api.get("PersistentVolumeClaim", "cached-kv-offload") is not None
        api.delete_isvc("cached")
        wait_for(lambda: api.get_isvc("cached") is None, timeout=60, what="resource gone")
        # A claim of that name that is someone else's: Degraded (NotOwned) and a Warning, and no pods
        # that would mount it (the claim is applied before the Deployment).
        api.call("POST", KubeClient.path("PersistentVolumeClaim", NAMESPACE), {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "squat-kv-offload", "namespace": NAMESPACE},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
        obj["metadata"]["name"] = "squat"
        api.apply_isvc(crd.apply_defaults(obj, crd.openapi_schema()))
        isvc = wait_for(lambda: (o := api.get_isvc("squat")) and condition(o, "Degraded").get("reason") == "NotOwned"
                        and o, timeout=60, what="Degraded NotOwned")
        assert "PersistentVolumeClaim" in condition(isvc, "Degraded")["message"]
        assert any(e.get("reason") == "NotOwned" and e.get("type") == "Warning" for e in api.events())
        assert api.get("Deployment", "squat") is None
        api.delete_isvc("squat")
        wait_for(lambda: api.get_isvc("squat") is None, timeout=60, what="resource gone")
    finally:
        op.stop()
