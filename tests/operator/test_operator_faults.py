"""The operator under API faults: 20% of its requests answered 500/503/429/409, watches cut.

The real operator talks to the emulator through `fault_proxy.FaultProxy`; the test, the kubelet
and the pods talk to the emulator directly. Convergence, a spec change, scaling up and down and
deletion must each finish within seconds, with exactly one of each owned object, and every call
the operator made (those the proxy refused included) must be in the documented RBAC.
"""

from __future__ import annotations

import asyncio
import copy
import time

import kopf
import pytest
from test_operator_e2e import DOCUMENTED_RBAC, TINY, defaulted, deployment_tp

from kvserve.operator.handlers import OperatorConfig
from kvserve.testing.e2e_harness import Api, Kubelet, Load, OperatorThread, condition, free_port_on_all, wait_for
from kvserve.testing.fault_proxy import FaultProxy, rbac_triple
from kvserve.testing.kube_emulator import EmulatorThread

pytestmark = pytest.mark.timeout(240)

# "Within seconds" on a loaded 2-core CI machine: each step's own budget.
STEP = 30.0


@pytest.fixture(scope="module")
def faulty_cluster():
    emulator = EmulatorThread().start()
    proxy = emulator.call(FaultProxy(emulator.url, rate=0.2, seed=14).start())
    ips = [f"127.0.0.{i}" for i in range(40, 60)]
    load = Load()
    kubelet = Kubelet(emulator.url, free_port_on_all(ips), free_port_on_all(ips), load)
    kubelet.ips = iter(ips)
    task = asyncio.run_coroutine_threadsafe(kubelet.run(), emulator.loop)
    yield emulator, proxy, Api(emulator.url), kubelet, load
    kubelet.stopped = True
    task.result(30)
    emulator.call(proxy.stop())
    emulator.stop()


def timed(what: str, predicate, timeout: float = STEP):
    start = time.monotonic()
    value = wait_for(predicate, timeout=timeout, what=what)
    return value, time.monotonic() - start


def test_converges_scales_and_deletes_within_seconds_under_20_percent_faults(faulty_cluster):
    emulator, proxy, api, kubelet, load = faulty_cluster
    config = OperatorConfig(scrape_interval=0.3, scrape_timeout=2.0, agent_port=kubelet.agent_port,
                            max_sample_age=3.0, connection=kopf.ConnectionInfo(server=proxy.url))
    op = OperatorThread(proxy.url, config).start()
    timings = {}
    try:
        # Rare on so few writes, so made certain: the apply that creates the Deployment is
        # answered 500 after the server made it (applying again is harmless), the Service's
        # apply gets a 409 before it is made, a later apply and a delete get 409 conflicts.
        proxy.force("PATCH", "/deployments/flaky", 500, after=True)
        proxy.force("PATCH", "/services/flaky", 409)
        proxy.force("PATCH", "/deployments/flaky", 409)
        proxy.force("DELETE", "/deployments/flaky", 409)
        obj = copy.deepcopy(TINY)
        obj["metadata"]["name"] = "flaky"
        obj["spec"]["autoscaling"]["tensorParallel"]["enabled"] = False
        api.apply_isvc(defaulted(obj))
        _, timings["create"] = timed("Deployment, Service, PDB", lambda: all(
            api.get(kind, "flaky") for kind in ("Deployment", "Service", "PodDisruptionBudget")))
        _, timings["ready"] = timed("Ready", lambda: condition(api.get_isvc("flaky"), "Ready").get("status") == "True")

        api.patch_spec("flaky", {"runtime": {"maxModelLen": 2048}})
        _, timings["spec change"] = timed("the spec change", lambda: "2048" in
                                          api.get("Deployment", "flaky")["spec"]["template"]["spec"]["containers"][0]["command"])

        load.kv, load.queue, load.running = 0.9, 6, 8
        _, timings["scale up"] = timed("scale up to 3", lambda: api.get("Deployment", "flaky")["spec"]["replicas"] == 3)
        load.kv, load.queue, load.running = 0.05, 0, 1
        _, timings["scale down"] = timed("scale down to 1",
                                         lambda: api.get("Deployment", "flaky")["spec"]["replicas"] == 1, timeout=STEP + 15)
        assert deployment_tp(api.get("Deployment", "flaky")) == 1

        # No duplicates: one of each kind, named after the resource, and pods match the Deployment.
        for path in ("Deployment", "Service", "PodDisruptionBudget"):
            assert [o["metadata"]["name"] for o in api.list(path)].count("flaky") == 1

        api.delete_isvc("flaky")
        _, timings["delete"] = timed("deleted", lambda: api.get_isvc("flaky") is None and all(
            api.get(kind, "flaky") is None for kind in ("Deployment", "Service", "PodDisruptionBudget")))
    finally:
        op.stop()
    print(f"timings (s): { {k: round(v, 1) for k, v in timings.items()} }; faults: {proxy.faults()}; "
          f"client retries: {op.reconciler.client.retries}")
    assert op.error is None

    # The faults really happened, to the operator's own calls and to kopf's, and streams were cut.
    faults = proxy.faults()
    for kind in ("500", "503", "429", "409", "500-after", "cut"):
        assert faults.get(kind, 0) > 0, faults
    assert not proxy.forced, proxy.forced
    assert op.reconciler.client.retries > 0
    operator_calls = [e for e in proxy.log if e.user_agent.startswith(("kopf/", "kvserve-operator"))]
    assert sum(1 for e in operator_calls if e.fault) >= 0.1 * len(operator_calls)

    # Every call, refused or not, is one the documented RBAC allows.
    used = {rbac_triple(e) for e in operator_calls} - {None}
    denied = {(g, r, v) for g, r, v in used if v not in DOCUMENTED_RBAC.get((g, r), set())}
    assert used and not denied, denied
