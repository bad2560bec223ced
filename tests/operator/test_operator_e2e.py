"""End to end: the real operator (kopf) against the Kubernetes API emulator over HTTP.

Pods are played by the test (see e2e_harness.Kubelet): each is a real `kvserve agent serve`
process on its own loopback address, in front of a stub engine whose load the test sets.
"""

from __future__ import annotations

import copy
import time

import pytest

from kvserve.operator import crd
from kvserve.operator import manifests as M
from kvserve.operator.handlers import OperatorConfig
from kvserve.testing.e2e_harness import (  # noqa: F401  (TINY_CONFIG, DOWN_WINDOW: other tests import them from here)
    DOWN_WINDOW,
    TINY,
    TINY_CONFIG,
    TP_DOWN_WINDOW,
    Api,
    Kubelet,
    Load,
    OperatorThread,
    condition,
    defaulted,
    free_port_on_all,
    wait_for,
)
from kvserve.testing.kube_emulator import EmulatorThread

pytestmark = pytest.mark.timeout(180)

@pytest.fixture(scope="module")
def cluster():
    emulator = EmulatorThread().start()
    ips = [f"127.0.0.{i}" for i in range(2, 40)]
    agent_port = free_port_on_all(ips)
    engine_port = free_port_on_all(ips)
    load = Load()
    kubelet = Kubelet(emulator.url, agent_port, engine_port, load)
    import asyncio

    task = asyncio.run_coroutine_threadsafe(kubelet.run(), emulator.loop)
    yield emulator, Api(emulator.url), kubelet, load
    kubelet.stopped = True
    task.result(30)
    emulator.stop()


def operator(emulator, kubelet) -> OperatorThread:
    import kopf

    config = OperatorConfig(scrape_interval=0.3, scrape_timeout=2.0, agent_port=kubelet.agent_port,
                            max_sample_age=3.0, connection=kopf.ConnectionInfo(server=emulator.url))
    return OperatorThread(emulator.url, config).start()


# docs/operator.md "RBAC the operator needs", for an operator serving named namespaces.
DOCUMENTED_RBAC = {
    ("kvserve.dev", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("kvserve.dev", "inferenceservices/status"): {"patch"},
    ("apps", "deployments"): {"get", "create", "patch", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "create", "patch", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets/scale"): {"get", "patch"},
    ("", "services"): {"get", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "create", "patch", "delete"},
    ("", "persistentvolumeclaims"): {"get", "create", "patch"},  # spec.runtime.kvOffload.storageClassName
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch", "delete"},
    ("", "pods"): {"get", "list", "watch"},  # get and watch only to grant them to a router
    ("", "secrets"): {"get"},  # spec.parallelism.devicesPerPod: the admin key for the pods' agents
    ("", "serviceaccounts"): {"get", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"get", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch", "delete"},
    ("", "events"): {"create"},
    ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"},
}
VERBS = {"list": "list", "watch": "watch", "fetch": "get", "create": "create", "update": "patch", "delete": "delete"}


def assert_operator_calls_are_documented(emulator: EmulatorThread) -> None:
    """Every API call the operator (kopf's client or ours) made is in the documented RBAC."""
    used = set()
    for request in list(emulator.emulator):
        agent = (request.headers or {}).get("User-Agent", "")
        if request.resource is None or not request.resource.plural or not agent.startswith(("kopf/",
                                                                                            "kvserve-operator")):
            continue  # discovery needs no RBAC; the test's own calls are not the operator's
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        used.add((request.resource.group or "", resource, VERBS.get(str(request.action.value).lower(), "?")))
    denied = {u for u in used if u[2] not in DOCUMENTED_RBAC.get(u[:2], set())}
    assert used and not denied, denied


def deployment_tp(dep: dict) -> int:
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    return int(cmd[cmd.index("--tensor-parallel-size") + 1])


def test_lifecycle_scale_tp_restart_delete(cluster):
    emulator, api, kubelet, load = cluster
    op = operator(emulator, kubelet)
    try:
        # Apply -> Deployment, Service, PDB owned by the resource; status conditions.
        isvc = api.apply_isvc(defaulted(TINY))
        uid = isvc["metadata"]["uid"]
        dep = wait_for(lambda: api.get("Deployment", "tiny"), what="Deployment")
        for kind in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"):
            obj = wait_for(lambda: api.get(kind, "tiny"), what=kind)
            (ref,) = obj["metadata"]["ownerReferences"]
            assert (ref["uid"], ref["kind"], ref["controller"]) == (uid, "InferenceService", True)
            assert obj["metadata"]["labels"]["kvserve.dev/inferenceservice"] == "tiny"
        assert dep["spec"]["replicas"] == 1 and deployment_tp(dep) == 1
        isvc = wait_for(lambda: (o := api.get_isvc("tiny")) and condition(o, "Ready").get("status") == "True" and o,
                        what="Ready")
        assert condition(isvc, "Degraded")["status"] == "False"
        assert isvc["status"]["url"] == "http://tiny.default.svc:8000/v1"
        assert condition(isvc, "ScalingActive")["status"] == "True"

        # Change the spec -> the Deployment follows (and pods roll).
        api.patch_spec("tiny", {"runtime": {"maxModelLen": 1024}})
        dep = wait_for(lambda: (d := api.get("Deployment", "tiny"))
                       and "--max-model-len" in d["spec"]["template"]["spec"]["containers"][0]["command"] and d,
                       what="Deployment to follow the spec")
        cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        assert cmd[cmd.index("--max-model-len") + 1] == "1024"
        wait_for(lambda: (api.get_isvc("tiny")["status"].get("observedGeneration") == 2), what="generation 2")

        # High KV and queues -> replicas go up to max.
        load.kv, load.queue, load.running = 0.9, 6, 8
        wait_for(lambda: api.get("Deployment", "tiny")["spec"]["replicas"] == 3, what="scale up to 3")

        # At max replicas and still saturated -> TP goes up; the pod template changes.
        dep = wait_for(lambda: (d := api.get("Deployment", "tiny")) and deployment_tp(d) == 2 and d,
                       timeout=30, what="TP 2")
        assert dep["spec"]["template"]["metadata"]["annotations"][M.TP_ANNOTATION] == "2"
        assert dep["spec"]["replicas"] == 3
        wait_for(lambda: sorted(p.tp for p in kubelet.pods.values() if p.name.startswith("tiny-")) == [2, 2, 2],
                 timeout=30, what="rollout to TP 2")
        isvc = wait_for(lambda: (o := api.get_isvc("tiny")) and condition(o, "ScalingLimited").get("status") == "True"
                        and o, what="ScalingLimited")
        assert condition(isvc, "ScalingLimited")["reason"] == "TooManyReplicas"

        # Restart the operator mid-way: it resumes with no duplicates and no reset.
        op.stop()
        op = operator(emulator, kubelet)
        time.sleep(2)
        for path in ("Deployment", "Service", "PodDisruptionBudget"):
            assert [o["metadata"]["name"] for o in api.list(path)].count("tiny") == 1
        dep = api.get("Deployment", "tiny")
        assert dep["spec"]["replicas"] == 3 and deployment_tp(dep) == 2
        assert len([p for p in api.list("Pod") if p["metadata"]["name"].startswith("tiny-")]) == 3

        # Load stops -> replicas go down, but only after the scale-down window.
        load.kv, load.queue, load.running = 0.05, 0, 1
        dropped = time.monotonic()
        wait_for(lambda: api.get("Deployment", "tiny")["spec"]["replicas"] < 3, timeout=30, what="scale down")
        assert time.monotonic() - dropped >= DOWN_WINDOW - 0.5
        wait_for(lambda: api.get("Deployment", "tiny")["spec"]["replicas"] == 1, timeout=30, what="down to 1")

        # Load stays low for the TP window -> TP comes back down (the smaller fleet is under target).
        wait_for(lambda: deployment_tp(api.get("Deployment", "tiny")) == 1, timeout=40, what="TP back to 1")
        assert time.monotonic() - dropped >= TP_DOWN_WINDOW - 0.5

        isvc = api.get_isvc("tiny")
        reasons = [d["reason"] for d in isvc["status"]["decisions"]]
        assert "TensorParallelUpAtMaxReplicas" in reasons and "ScaleDown" in reasons
        assert reasons[-1] == "TensorParallelDownLowLoad"
        assert isvc["status"]["lastScaleTime"]
        assert all("signals" in d for d in isvc["status"]["decisions"])
        event_reasons = {e["reason"] for e in api.events() if e["involvedObject"].get("name") == "tiny"}
        assert {"Applied", "TensorParallelUpAtMaxReplicas", "ScaleDown"} <= event_reasons
        # The operator's own metrics (this instance started after the scale-up, so it saw the downs).
        metrics = op.reconciler.metrics.registry
        tiny = {"namespace": "default", "inferenceservice": "tiny"}
        assert metrics.get_sample_value("kvserve_operator_scaling_decisions_total", tiny | {"reason": "ScaleDown"}) >= 1
        assert metrics.get_sample_value("kvserve_operator_desired_replicas", tiny) == 1
        assert metrics.get_sample_value("kvserve_operator_desired_tensor_parallel_size", tiny) == 1

        # The operator never wrote the spec: it is what the user applied and patched.
        expected = defaulted(TINY)["spec"]
        expected["runtime"]["maxModelLen"] = 1024
        assert isvc["spec"] == expected

        # Delete -> what the operator made goes away (kmock has no garbage collector: the operator
        # deletes its objects itself; the test's kubelet removes the pods of a gone Deployment).
        api.delete_isvc("tiny")
        for kind in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"):
            wait_for(lambda: api.get(kind, "tiny") is None, what=f"{kind} deleted")
        wait_for(lambda: api.get_isvc("tiny") is None, what="resource gone (finalizer released)")
        assert metrics.get_sample_value("kvserve_operator_desired_replicas", tiny) is None
        assert metrics.get_sample_value("kvserve_operator_scaling_decisions_total", tiny | {"reason": "ScaleDown"}) is None
        wait_for(lambda: not [p for p in api.list("Pod") if p["metadata"]["name"].startswith("tiny-")],
                 what="pods gone")
    finally:
        op.stop()
    assert op.error is None
    assert_operator_calls_are_documented(emulator)


def test_bad_resource_is_degraded_with_nothing_made_and_recovers(cluster):
    emulator, api, kubelet, load = cluster
    load.kv, load.queue = 0.3, 0
    op = operator(emulator, kubelet)
    try:
        bad = copy.deepcopy(TINY)
        bad["metadata"]["name"] = "broken"
        bad["spec"]["model"]["config"] = {**TINY_CONFIG, "num_attention_heads": 6, "num_key_value_heads": 6}
        bad["spec"]["parallelism"]["tensor"] = {"min": 1, "max": 4, "initial": 4}
        api.apply_isvc(defaulted(bad))  # valid for the schema: only the model's heads rule it out
        isvc = wait_for(lambda: (o := api.get_isvc("broken")) and condition(o, "Degraded").get("status") == "True"
                        and o, what="Degraded")
        degraded = condition(isvc, "Degraded")
        assert degraded["reason"] == "InvalidSpec"
        assert degraded["message"].startswith("spec.parallelism.tensor.initial: tensor_parallel_size 4 does not divide")
        assert condition(isvc, "Ready")["status"] == "False"
        time.sleep(1)
        for kind in ("Deployment", "Service", "PodDisruptionBudget"):
            assert api.get(kind, "broken") is None
        assert any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in api.events()
                   if e["involvedObject"].get("name") == "broken")

        # Fixing the spec recovers it.
        api.patch_spec("broken", {"parallelism": {"tensor": {"initial": 2, "max": 2}}})
        wait_for(lambda: api.get("Deployment", "broken"), what="Deployment after the fix")
        isvc = wait_for(lambda: (o := api.get_isvc("broken")) and condition(o, "Degraded").get("status") == "False"
                        and o, what="Degraded cleared")
        assert deployment_tp(api.get("Deployment", "broken")) == 2

        # An owned object deleted behind the operator's back comes back.
        api.call("DELETE", "/apis/apps/v1/namespaces/default/deployments/broken")
        wait_for(lambda: api.get("Deployment", "broken"), what="Deployment recreated")

        # A pod whose agent stops answering: a Warning Event, and its (missing) numbers count
        # for nothing: no metrics, no scaling.
        def one_pod_scraped():
            pods = [p for p in kubelet.pods.values() if p.name.startswith("broken-")]
            isvc = api.get_isvc("broken")
            ok = len(pods) == 1 and condition(isvc, "ScalingActive").get("reason") == "ValidMetrics"
            return ok and pods[0]

        pod = wait_for(one_pod_scraped, what="the recreated pod scraped")
        pod.agent.kill()
        wait_for(lambda: any(e["reason"] == "ScrapeFailed" and e["type"] == "Warning" for e in api.events()
                             if e["involvedObject"].get("name") == "broken"), what="ScrapeFailed event")
        isvc = wait_for(lambda: (o := api.get_isvc("broken"))
                        and condition(o, "ScalingActive").get("reason") == "NoMetrics" and o, what="NoMetrics")
        assert api.get("Deployment", "broken")["spec"]["replicas"] == 1

        # An engine the operator does not know (the emulator has no schema to stop it): Degraded,
        # and what already runs is left alone.
        api.patch_spec("broken", {"runtime": {"engine": "sglang"}})
        isvc = wait_for(lambda: (o := api.get_isvc("broken")) and condition(o, "Degraded").get("status") == "True"
                        and o, what="Degraded on engine")
        assert condition(isvc, "Degraded")["message"].startswith("spec.runtime.engine: unsupported value 'sglang'")
        assert api.get("Deployment", "broken") is not None
        api.patch_spec("broken", {"runtime": {"engine": "kvserve"}})
        wait_for(lambda: condition(api.get_isvc("broken"), "Degraded").get("status") == "False", what="recovered")

        # An optional field removed from the spec disappears from the Deployment too.
        api.patch_spec("broken", {"gpu": {"nodeSelector": {"pool": "inference"}}})
        wait_for(lambda: api.get("Deployment", "broken")["spec"]["template"]["spec"].get("nodeSelector")
                 == {"pool": "inference"}, what="nodeSelector set")
        api.patch_spec("broken", {"gpu": {"nodeSelector": None}})
        wait_for(lambda: "nodeSelector" not in api.get("Deployment", "broken")["spec"]["template"]["spec"],
                 what="nodeSelector removed")

        # Manual mode: the scale subresource (what `kubectl scale` patches) sizes the Deployment.
        api.patch_spec("broken", {"autoscaling": {"enabled": False}})
        api.call("PATCH", api.isvc_path("broken") + "/scale", {"spec": {"replicas": 2}},
                 "application/merge-patch+json")
        wait_for(lambda: api.get("Deployment", "broken")["spec"]["replicas"] == 2, what="kubectl scale")
        wait_for(lambda: condition(api.get_isvc("broken"), "ScalingActive").get("reason") == "AutoscalingDisabled",
                 what="ScalingActive False")

        api.delete_isvc("broken")
        wait_for(lambda: api.get_isvc("broken") is None and api.get("Deployment", "broken") is None, what="deleted")
    finally:
        op.stop()
    assert op.error is None
    assert_operator_calls_are_documented(emulator)


def test_credentials_come_from_secrets_and_policies_follow_the_switch(cluster):
    """Issue 18: a plain API key in spec.runtime.env is refused (condition + Event pointing at the
    Secret field, nothing made); with apiKeySecret the pods get it by secretKeyRef; the
    NetworkPolicy is made, removed by spec.networkPolicy.enabled false, and the spec never written."""
    emulator, api, kubelet, load = cluster
    load.kv, load.queue = 0.3, 0
    op = operator(emulator, kubelet)
    try:
        leaky = copy.deepcopy(TINY)
        leaky["metadata"]["name"] = "keyed"
        leaky["spec"]["runtime"] = {"env": [{"name": "KVSERVE_API_KEY", "value": "sk-visible-to-all"}]}
        # The emulator has no CEL (a real API server refuses this first): the operator must too.
        api.apply_isvc(crd.apply_defaults(leaky, crd.openapi_schema()))
        isvc = wait_for(lambda: (o := api.get_isvc("keyed")) and condition(o, "Degraded").get("status") == "True"
                        and o, what="Degraded")
        message = condition(isvc, "Degraded")["message"]
        assert message.startswith("spec.runtime.env[0]: KVSERVE_API_KEY") and "spec.runtime.apiKeySecret" in message
        assert "sk-visible-to-all" not in message
        assert api.get("Deployment", "keyed") is None and api.get("NetworkPolicy", "keyed") is None
        assert any(e["reason"] == "InvalidSpec" and "apiKeySecret" in e["message"] for e in api.events()
                   if e["involvedObject"].get("name") == "keyed")

        logged = len(list(emulator.emulator))
        api.patch_spec("keyed", {"runtime": {"env": [], "apiKeySecret": {"name": "llm-key", "key": "KVSERVE_API_KEY"}}})
        dep = wait_for(lambda: api.get("Deployment", "keyed"), what="Deployment after the fix")
        # The policy exists before the first pod could: it is created (applied) before the Deployment.
        applied = [r.resource.plural for r in list(emulator.emulator)[logged:]
                   if r.resource is not None and str(r.method.value).upper() == "PATCH"
                   and (r.headers or {}).get("Content-Type", "").startswith("application/apply-patch")]
        assert applied.index("networkpolicies") < applied.index("deployments"), applied
        runtime = dep["spec"]["template"]["spec"]["containers"][0]
        (key,) = [e for e in runtime["env"] if e["name"] == "KVSERVE_API_KEY"]
        assert key == {"name": "KVSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm-key",
                                                                                "key": "KVSERVE_API_KEY"}}}
        policy = wait_for(lambda: api.get("NetworkPolicy", "keyed"), what="NetworkPolicy")
        assert policy["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]

        api.patch_spec("keyed", {"networkPolicy": {"enabled": False}})
        wait_for(lambda: api.get("NetworkPolicy", "keyed") is None, what="NetworkPolicy removed by the switch")
        api.patch_spec("keyed", {"networkPolicy": {"enabled": True}})
        wait_for(lambda: api.get("NetworkPolicy", "keyed"), what="NetworkPolicy back")
        # The spec is what was applied (with the CRD's defaults) and patched: never written by the operator.
        assert api.get_isvc("keyed")["spec"]["networkPolicy"] == {"enabled": True, "allowSameNamespace": True,
                                                                  "metrics": {"namespaces": ["monitoring"]}}

        api.delete_isvc("keyed")
        wait_for(lambda: api.get_isvc("keyed") is None and api.get("NetworkPolicy", "keyed") is None, what="deleted")
    finally:
        op.stop()
    assert op.error is None
    assert_operator_calls_are_documented(emulator)


def test_peering_keeps_one_instance_active(cluster):
    """With peering, an operator pauses while a live higher-priority peer exists, then takes over."""
    import datetime as dt

    import kopf

    emulator, api, kubelet, load = cluster
    peering = "/apis/kopf.dev/v1/namespaces/default/kopfpeerings"
    api.call("POST", peering, {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
                               "metadata": {"name": "default", "namespace": "default"}})
    now = dt.datetime.now(dt.UTC).isoformat()
    api.call("PATCH", f"{peering}/default", {"status": {"other-operator": {"priority": 100, "lifetime": 60,
                                                                          "lastseen": now}}},
             "application/merge-patch+json")
    config = OperatorConfig(scrape_interval=0.3, agent_port=kubelet.agent_port,
                            connection=kopf.ConnectionInfo(server=emulator.url))
    op = OperatorThread(emulator.url, config, peering=True, priority=1).start()
    try:
        obj = copy.deepcopy(TINY)
        obj["metadata"]["name"] = "peered"
        api.apply_isvc(defaulted(obj))
        time.sleep(2)
        assert api.get("Deployment", "peered") is None  # paused in favour of the other operator
        peers = api.call("GET", f"{peering}/default")["status"]
        assert "other-operator" in peers and len(peers) == 2  # both instances are registered

        api.call("PATCH", f"{peering}/default", {"status": {"other-operator": None}},
                 "application/merge-patch+json")  # the other operator goes away
        wait_for(lambda: api.get("Deployment", "peered"), what="takeover")
        api.delete_isvc("peered")
        wait_for(lambda: api.get_isvc("peered") is None, what="deleted")
    finally:
        op.stop()
    assert op.error is None
    assert_operator_calls_are_documented(emulator)


def test_missing_peering_object_is_said_and_creating_it_resumes(cluster, caplog):
    """Regression: a non-standalone operator without its peering object sat paused in silence."""
    import logging

    import kopf

    emulator, api, kubelet, load = cluster
    config = OperatorConfig(scrape_interval=0.3, agent_port=kubelet.agent_port, peering_check_interval=0.5,
                            connection=kopf.ConnectionInfo(server=emulator.url))
    caplog.set_level(logging.WARNING, logger="kvserve.operator.peering")
    op = OperatorThread(emulator.url, config, peering=True, priority=1, peering_name="lonely").start()
    try:
        obj = copy.deepcopy(TINY)
        obj["metadata"]["name"] = "unpeered"
        api.apply_isvc(defaulted(obj))

        def said():
            return [r.getMessage() for r in caplog.records if "does not exist" in r.getMessage()]

        lines = wait_for(lambda: len(said()) >= 2 and said(), timeout=30, what="the warning, twice")
        assert lines[0] == (
            "peering object KopfPeering 'lonely' in namespace 'default' does not exist, so this operator is "
            "paused and handles no InferenceService. Create it (apiVersion kopf.dev/v1, kind KopfPeering, "
            "metadata.name 'lonely', metadata.namespace 'default'; example: manifests/namespaced/peering.yaml; "
            "CRDs: crds/kopf-peering.yaml), or run the operator with --standalone if it is the only one.")
        assert api.get("Deployment", "unpeered") is None

        api.call("POST", "/apis/kopf.dev/v1/namespaces/default/kopfpeerings",
                 {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
                  "metadata": {"name": "lonely", "namespace": "default"}})
        wait_for(lambda: api.get("Deployment", "unpeered"), timeout=30, what="work resumed")
        wait_for(lambda: any("found in namespace 'default'; the operator resumes" in r.getMessage()
                             for r in caplog.records), what="the all-clear")
        api.delete_isvc("unpeered")
        # Generous: on a loaded machine the pod's agent takes seconds to start, and kopf waits
        # for a running autoscale pass to finish before it releases the finalizer.
        wait_for(lambda: api.get_isvc("unpeered") is None, timeout=60, what="deleted")
    finally:
        op.stop()
    assert op.error is None
    assert_operator_calls_are_documented(emulator)


def test_model_shape_is_learned_from_the_agents_and_plans_tp(cluster, tmp_path):
    """An hf:// model with no spec.model.config: the pods' agents report the model (here a config
    with 4 heads / 2 KV heads), status.model records it, and TP autoscaling uses it."""
    import json

    emulator, api, kubelet, load = cluster
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **TINY_CONFIG,
                                                    "torch_dtype": "bfloat16"}))
    kubelet.model_dirs["learner"] = str(model)
    load.kv, load.queue, load.running = 0.3, 0, 2
    obj = copy.deepcopy(TINY)
    obj["metadata"]["name"] = "learner"
    del obj["spec"]["model"]["config"]
    obj["spec"]["autoscaling"].update(minReplicas=1, maxReplicas=1)
    op = operator(emulator, kubelet)
    try:
        api.apply_isvc(defaulted(obj))
        isvc = wait_for(lambda: (o := api.get_isvc("learner")) and (o.get("status") or {}).get("model", {}).get("config")
                        and o, timeout=60, what="status.model learned")  # a pod must start first
        learned = isvc["status"]["model"]
        assert {k: learned[k] for k in ("uri", "architecture", "numLayers", "numAttentionHeads", "numKeyValueHeads",
                                         "headDim", "dtype", "format")} == {
            "uri": "hf://kvserve/tiny", "architecture": "LlamaForCausalLM", "numLayers": 2, "numAttentionHeads": 4,
            "numKeyValueHeads": 2, "headDim": 16, "dtype": "bfloat16", "format": "pytorch"}
        assert learned["learnedFrom"].startswith("learner-")
        assert any(e["reason"] == "ModelLearned" for e in api.events() if e["involvedObject"].get("name") == "learner")
        wait_for(lambda: "TP planning needs" not in condition(api.get_isvc("learner"), "ScalingActive").get("message", ""),
                 what="the TP note gone")

        # Saturated at maxReplicas 1: TP goes up, planned with the learned shape.
        load.kv, load.queue, load.running = 0.95, 6, 8
        wait_for(lambda: deployment_tp(api.get("Deployment", "learner")) == 2, timeout=60, what="TP 2")
        load.kv, load.queue, load.running = 0.3, 0, 2
        api.delete_isvc("learner")
        wait_for(lambda: api.get_isvc("learner") is None, timeout=60, what="deleted")
    finally:
        op.stop()
    assert op.error is None
