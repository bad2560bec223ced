"""End to end (issue 22): the real operator against the Kubernetes API emulator drives each pod's
DP x TP layout in place. Low -> high -> low load changes the layout through the pods' real agents
(POST /admin/parallelism with the admin key from the Secret the spec names), with
ReshapedInPlace Events and the decisions in status, and never touches the Deployment's template;
a devicesPerPod change rolls the pods."""

from __future__ import annotations

import asyncio
import base64
import copy
import time

import pytest

from kvserve.operator import crd
from kvserve.operator import manifests as M
from kvserve.operator.handlers import OperatorConfig
from kvserve.testing.e2e_harness import ADMIN_KEY, Api, Kubelet, Load, OperatorThread, free_port_on_all, wait_for
from kvserve.testing.kube_emulator import EmulatorThread

pytestmark = pytest.mark.timeout(180)

TINY_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}
SHAPED = {
    "apiVersion": "kvserve.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "shaped", "namespace": "default"},
    "spec": {
        "model": {"uri": "hf://kvserve/tiny", "servedName": "tiny", "config": TINY_CONFIG},
        "gpu": {"perShard": 0},
        "runtime": {"adminApiKeySecret": {"name": "shaped-admin", "key": "key"}},
        "parallelism": {"devicesPerPod": 2, "tensor": {"min": 1, "max": 2, "initial": 1}},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 1, "scaleUpStabilizationSeconds": 1,
                        "layout": {"stabilizationSeconds": 1, "reshapeCostMultiple": 1,
                                   "highLoadRequests": 8, "lowLoadRequests": 2}},
    },
}


@pytest.fixture(scope="module")
def cluster():
    emulator = EmulatorThread().start()
    ips = [f"127.0.0.{i}" for i in range(2, 40)]
    load = Load()
    kubelet = Kubelet(emulator.url, free_port_on_all(ips), free_port_on_all(ips), load)
    task = asyncio.run_coroutine_threadsafe(kubelet.run(), emulator.loop)
    api = Api(emulator.url)
    api.call("POST", "/api/v1/namespaces/default/secrets",
             {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "shaped-admin", "namespace": "default"},
              "data": {"key": base64.b64encode(ADMIN_KEY.encode()).decode()}})
    yield emulator, api, kubelet, load
    kubelet.stopped = True
    task.result(30)
    emulator.stop()


def pod_layouts(kubelet, name="shaped"):
    return sorted((p.dp, p.tp) for p in kubelet.pods.values() if p.name.startswith(f"{name}-"))


def test_load_drives_in_place_layout_changes_and_devices_roll_the_pods(cluster):
    import kopf

    emulator, api, kubelet, load = cluster
    config = OperatorConfig(scrape_interval=0.3, scrape_timeout=2.0, agent_port=kubelet.agent_port,
                            max_sample_age=3.0, connection=kopf.ConnectionInfo(server=emulator.url))
    op = OperatorThread(emulator.url, config).start()
    try:
        load.kv, load.queue, load.running = 0.3, 0, 1  # low
        obj = copy.deepcopy(SHAPED)
        assert crd.validate(obj) == []
        api.apply_isvc(crd.apply_defaults(obj, crd.openapi_schema()))
        dep = wait_for(lambda: api.get("Deployment", "shaped"), what="Deployment")
        template = M.template_hash(dep)
        cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        assert cmd[cmd.index("--data-parallel-size") + 1] == "2"
        wait_for(lambda: pod_layouts(kubelet) == [(2, 1)], what="the pod at the template's 2xTP1")
        created = len(kubelet.created)

        # Low load: the pod goes to 1xTP2 in place.
        wait_for(lambda: pod_layouts(kubelet) == [(1, 2)], timeout=30, what="1xTP2 at low load")
        # High load: back to 2xTP1 (throughput).
        load.kv, load.queue, load.running = 0.6, 6, 12
        wait_for(lambda: pod_layouts(kubelet) == [(2, 1)], timeout=30, what="2xTP1 at high load")
        # Low again.
        load.kv, load.queue, load.running = 0.2, 0, 1
        wait_for(lambda: pod_layouts(kubelet) == [(1, 2)], timeout=30, what="1xTP2 at low load again")

        assert [(dp, tp) for _, dp, tp in load.reshapes] == [(1, 2), (2, 1), (1, 2)]
        assert len(kubelet.created) == created  # no pod was restarted or replaced
        assert M.template_hash(api.get("Deployment", "shaped")) == template  # the template never changed
        isvc = wait_for(lambda: (o := api.get_isvc("shaped")) and o["status"].get("layout", {}).get("tensorParallel")
                        == 2 and o, what="status.layout")
        assert isvc["status"]["layout"]["devicesPerPod"] == 2 and isvc["status"]["layout"]["lastReshapeSeconds"] > 0
        moves = [(d["fromLayout"], d["toLayout"], d["reason"]) for d in isvc["status"]["decisions"] if "toLayout" in d]
        assert moves == [("2xTP1", "1xTP2", "LayoutTensorParallel"), ("1xTP2", "2xTP1", "LayoutDataParallel"),
                         ("2xTP1", "1xTP2", "LayoutTensorParallel")]
        events = [e for e in api.events() if e["involvedObject"].get("name") == "shaped"]
        reshaped = [e["message"] for e in events if e["reason"] == "ReshapedInPlace"]
        assert len(reshaped) == 3 and all("in 0.05s" in m and "no restart" in m for m in reshaped)

        # devicesPerPod is the pod's size: changing it rolls the pods (a new template).
        api.patch_spec("shaped", {"parallelism": {"devicesPerPod": 4, "tensor": {"min": 1, "max": 4, "initial": 1}}})
        dep = wait_for(lambda: (d := api.get("Deployment", "shaped")) and M.template_hash(d) != template and d,
                       what="new template")
        cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        assert cmd[cmd.index("--data-parallel-size") + 1] == "4"
        wait_for(lambda: len(kubelet.created) > created, timeout=30, what="a new pod")
        api.delete_isvc("shaped")
        wait_for(lambda: api.get_isvc("shaped") is None, what="resource gone")
    finally:
        op.stop()
    assert op.error is None


def test_a_tpot_slo_moves_to_tp_and_a_slower_tp_layout_is_gated(cluster):
    """spec.autoscaling.layout.tpotSloSeconds with the pods' real agents: a missed SLO moves the
    pod to TP; once TP was measured slower than DP here, the next miss is refused in place
    (LayoutTPOTGated Event) and the pod keeps its layout."""
    import threading

    import kopf

    emulator, api, kubelet, load = cluster
    config = OperatorConfig(scrape_interval=0.3, scrape_timeout=2.0, agent_port=kubelet.agent_port,
                            max_sample_age=3.0, connection=kopf.ConnectionInfo(server=emulator.url))
    tpot, stop = [0.08], threading.Event()

    def generate():  # the engines' inter-token latency totals grow as tokens are served
        while not stop.wait(0.05):
            load.itl_sum, load.itl_count = load.itl_sum + 20 * tpot[0], load.itl_count + 20

    ticker = threading.Thread(target=generate, daemon=True)
    ticker.start()
    op = OperatorThread(emulator.url, config).start()
    try:
        load.kv, load.queue, load.running = 0.3, 0, 1  # low load: the SLO alone decides
        obj = copy.deepcopy(SHAPED)
        obj["metadata"]["name"] = "gated"
        obj["spec"]["autoscaling"]["layout"]["tpotSloSeconds"] = 0.05
        assert crd.validate(obj) == []
        api.apply_isvc(crd.apply_defaults(obj, crd.openapi_schema()))
        wait_for(lambda: pod_layouts(kubelet, "gated") == [(2, 1)], what="the pod at 2xTP1")
        # 80 ms > 50 ms: TP for latency.
        wait_for(lambda: pod_layouts(kubelet, "gated") == [(1, 2)], timeout=30, what="1xTP2 for the SLO")
        tpot[0] = 0.12  # ... but TP is slower on these pods
        time.sleep(3)  # several decision intervals measured at 1xTP2 (the newest is remembered)
        load.kv, load.queue, load.running, tpot[0] = 0.6, 6, 12, 0.08  # high load: DP for throughput
        wait_for(lambda: pod_layouts(kubelet, "gated") == [(2, 1)], timeout=30, what="2xTP1 at high load")
        load.kv, load.queue, load.running = 0.2, 0, 1  # low again, SLO missed again at 2xTP1
        gated = wait_for(lambda: [e["message"] for e in api.events()
                                  if e["involvedObject"].get("name") == "gated" and e["reason"] == "LayoutTPOTGated"],
                         timeout=30, what="LayoutTPOTGated Event")
        assert "1xTP2 measured TPOT 0.1" in gated[0] and "keeping 2xTP1" in gated[0]
        assert pod_layouts(kubelet, "gated") == [(2, 1)]
        assert [(dp, tp) for name, dp, tp in load.reshapes if name.startswith("gated-")] == [(1, 2), (2, 1)]
        api.delete_isvc("gated")
        wait_for(lambda: api.get_isvc("gated") is None, what="resource gone")
    finally:
        stop.set()
        op.stop()
    assert op.error is None

