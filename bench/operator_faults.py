"""The operator under API faults: how long each step of a resource's life takes, per fault rate.

    python bench/operator_faults.py                      # rates 0, 10%, 20%; retries on and off
    python bench/operator_faults.py --rates 0.2 --modes retries

The real operator (kopf, its own thread) talks to the Kubernetes API emulator through the
fault-injecting proxy of tests/operator/fault_proxy.py: that share of its requests answered
500/503/429 (409 on creates and the operator client's own writes), some writes answered with an
error after the server did them, watch streams cut every 0.3-3 s. Pods are the test kubelet's
(real `kvserve agent serve` processes in front of stub engines). Steps, each timed until the
cluster shows the result: create (Deployment, Service, PDB exist), ready, a spec change reaching
the Deployment, scale up to 3 under load, scale down to 1 after it (4 s window), delete (the
resource and its objects gone). A step that does not finish within --step-timeout is recorded
as such and the run moves on.

Modes: `retries` is the operator as shipped. `no-retries` is the same code with the client's
retry policy set to one attempt and kopf's defaults for its own backoff (1, 1, 2, 3, 5 ... s)
and for failed handlers (60 s): close to the hand-written client this replaced, which never
retried. Writes a table and bench/results/operator_faults.json.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
STEPS = ("create", "ready", "spec change", "scale up", "scale down", "delete")


def run_one(rate: float, mode: str, step_timeout: float, seed: int) -> dict:
    import kopf

    from kvserve.operator import handlers, kube
    from kvserve.operator.handlers import OperatorConfig
    from kvserve.operator.retry import RetryPolicy
    from kvserve.testing.e2e_harness import (
        TINY,
        Api,
        Kubelet,
        Load,
        OperatorThread,
        condition,
        defaulted,
        free_port_on_all,
    )
    from kvserve.testing.fault_proxy import FaultProxy
    from kvserve.testing.kube_emulator import EmulatorThread

    saved = (handlers.HANDLER_BACKOFF, handlers.KOPF_ERROR_BACKOFFS, kube.KubeClient.__init__.__kwdefaults__,
             handlers.handler_delay)
    if mode == "no-retries":
        handlers.HANDLER_BACKOFF = 60.0
        handlers.KOPF_ERROR_BACKOFFS = (1, 1, 2, 3, 5, 8, 13, 21)
        handlers.handler_delay = lambda retry, **_: 10.0  # the replaced code's fixed TemporaryError delay
        kube.KubeClient.__init__.__kwdefaults__ = {**saved[2], "policy": RetryPolicy(attempts=1)}
    emulator = EmulatorThread().start()
    proxy = emulator.call(FaultProxy(emulator.url, rate=rate, seed=seed).start())
    ips = [f"127.0.0.{i}" for i in range(60, 90)]
    load = Load()
    kubelet = Kubelet(emulator.url, free_port_on_all(ips), free_port_on_all(ips), load)
    kubelet.ips = iter(ips)
    task = asyncio.run_coroutine_threadsafe(kubelet.run(), emulator.loop)
    api = Api(emulator.url)
    config = OperatorConfig(scrape_interval=0.3, scrape_timeout=2.0, agent_port=kubelet.agent_port,
                            max_sample_age=3.0, connection=kopf.ConnectionInfo(server=proxy.url))
    timings: dict[str, float | None] = {}
    op = OperatorThread(proxy.url, config).start()
    try:
        def step(name, predicate, timeout=step_timeout):
            start = time.monotonic()
            while time.monotonic() - start < timeout:
                try:
                    if predicate():
                        timings[name] = round(time.monotonic() - start, 2)
                        return
                except (TypeError, KeyError, AssertionError):
                    pass
                time.sleep(0.1)
            timings[name] = None

        obj = copy.deepcopy(TINY)
        obj["metadata"]["name"] = "bench"
        obj["spec"]["autoscaling"]["tensorParallel"]["enabled"] = False
        api.apply_isvc(defaulted(obj))
        step("create", lambda: all(api.get(k, "bench") for k in ("Deployment", "Service", "PodDisruptionBudget")))
        step("ready", lambda: condition(api.get_isvc("bench"), "Ready").get("status") == "True")
        api.patch_spec("bench", {"runtime": {"maxModelLen": 2048}})
        step("spec change", lambda: "2048" in api.get("Deployment", "bench")["spec"]["template"]["spec"]
             ["containers"][0]["command"])
        load.kv, load.queue, load.running = 0.9, 6, 8
        step("scale up", lambda: api.get("Deployment", "bench")["spec"]["replicas"] == 3)
        load.kv, load.queue, load.running = 0.05, 0, 1
        step("scale down", lambda: api.get("Deployment", "bench")["spec"]["replicas"] == 1)
        api.delete_isvc("bench")
        step("delete", lambda: api.get_isvc("bench") is None and all(
            api.get(k, "bench") is None for k in ("Deployment", "Service", "PodDisruptionBudget")))
        duplicates = {k: [o["metadata"]["name"] for o in api.list(k)].count("bench")
                      for k in ("Deployment", "Service", "PodDisruptionBudget")}
    finally:
        op.stop()
        kubelet.stopped = True
        task.result(60)
        emulator.call(proxy.stop())
        emulator.stop()
        (handlers.HANDLER_BACKOFF, handlers.KOPF_ERROR_BACKOFFS, kube.KubeClient.__init__.__kwdefaults__,
         handlers.handler_delay) = saved
    operator_calls = [e for e in proxy.log if e.user_agent.startswith(("kopf/", "kvserve-operator"))]
    return {"rate": rate, "mode": mode, "timings_s": timings, "faults": proxy.faults(),
            "operator_requests": len(operator_calls),
            "client_retries": op.reconciler.client.retries if op.reconciler.client else None,
            "objects_left": {k: v for k, v in duplicates.items() if v}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.1, 0.2])
    parser.add_argument("--modes", nargs="+", default=["retries", "no-retries"], choices=["retries", "no-retries"])
    parser.add_argument("--step-timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=14)
    args = parser.parse_args(argv)
    runs = []
    for mode in args.modes:
        for rate in args.rates:
            print(f"running: {mode}, {rate:.0%} faults ...", flush=True)
            runs.append(run_one(rate, mode, args.step_timeout, args.seed))
    load = os.getloadavg()
    print(f"\nseconds per step (-: not within {args.step_timeout:.0f} s); load average {load[0]:.1f}")
    print(f"{'mode':<11} {'faults':>6} " + " ".join(f"{s:>11}" for s in STEPS) + "  requests  retries")
    for r in runs:
        cells = [f"{r['timings_s'][s]:>11.1f}" if r["timings_s"].get(s) is not None else f"{'-':>11}" for s in STEPS]
        print(f"{r['mode']:<11} {r['rate']:>6.0%} " + " ".join(cells)
              + f"  {r['operator_requests']:>8}  {r['client_retries'] if r['client_retries'] is not None else '-':>7}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "operator_faults.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(),
                               "cpus": os.cpu_count(), "load_average": load, "step_timeout_s": args.step_timeout,
                               "runs": runs}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
