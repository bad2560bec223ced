"""Every PromQL expression of the dashboard and the rules against a real Prometheus (2.42)
scraping a real kvserve runtime and agent that serve live streaming traffic.

Real: Prometheus (scrape, rule evaluation, query API), the runtime (`kvserve serve` on a tiny
random-weight model), the agent (`kvserve agent serve`), the operator's metrics endpoint
(operator/metrics.py, job kvserve-operator as its ServiceMonitor names it), the rules file, the
dashboard.
Emulated: kube-state-metrics. Its series are produced here from an InferenceService status by
applying manifests/monitoring/kube-state-metrics-crs.yaml (the subset of kube-state-metrics'
custom-resource-state semantics that config uses; see test_monitoring.ksm_series). The scrape labels
namespace/pod/inferenceservice are set as
the PodMonitors' relabelings would set them in a cluster.

Checks: Prometheus loads and evaluates every rule with health "ok"; every recording rule and
every dashboard query returns data; every series selector inside the alerts returns data; the
dashboard's template-variable queries find the namespace and the InferenceService.
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import test_monitoring as tmon
import yaml

from kvserve.testing.adapters import build_lora_adapter

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NS, ISVC, POD = "ml", "chat", "chat-7d9f-abcde"
ADAPTER = "chat-lora"
FUNCTIONS = {"sum", "avg", "max", "min", "count", "rate", "deriv", "changes", "absent",
             "histogram_quantile", "by", "on", "and", "or", "unless", "without", "ignoring"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # not up yet
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last error: {last})")


class FakeKubeStateMetrics:
    """Serves what kube-state-metrics would export for one InferenceService."""

    def __init__(self, isvc: dict):
        self.isvc = isvc
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = outer.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def exposition(self) -> str:
        lines = []
        for name, labels, value in tmon.ksm_series(tmon.ksm_config(), self.isvc):
            lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            lines.append(f"{name}{{{lab}}} {value}")
        return "\n".join(lines) + "\n"


def stream_traffic(url: str, stop: threading.Event, prefix: str):
    """Concurrent streaming completions with a shared prefix, until stopped; the last stream asks
    for the LoRA adapter, so the dashboard's per-adapter panel has a series."""
    def one(i: int):
        model = ADAPTER if i == 2 else "tiny"
        while not stop.is_set():
            body = json.dumps({"model": model, "prompt": f"{prefix} {i}", "max_tokens": 12,
                               "stream": True}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    for _ in r:
                        pass
            except Exception:
                time.sleep(0.2)
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    return threads


@pytest.fixture(scope="module")
def live(tiny_llama, tmp_path_factory):
    try:
        prom_bin = tmon.prometheus_bin.ensure()
    except Exception as e:
        pytest.skip(f"prometheus unavailable: {e}")
    work = tmp_path_factory.mktemp("prom")
    rt_port, ag_port, prom_port, router_port = free_port(), free_port(), free_port(), free_port()
    procs = []
    ksm = operator = None
    stop = threading.Event()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    adapter = build_lora_adapter(tiny_llama, work / "adapter", r=4)
    try:
        procs.append(subprocess.Popen(
            [BIN / "kvserve", "serve", str(tiny_llama), "--host", "127.0.0.1",
             "--port", str(rt_port), "--served-model-name", "tiny", "--num-kv-blocks", "64",
             "--enable-prefix-caching", "--enable-lora", "--max-lora-rank", "8",
             "--lora-modules", f"{ADAPTER}={adapter}"],
            stdout=open(work / "runtime.log", "w"), stderr=subprocess.STDOUT, env=env))
        procs.append(subprocess.Popen(
            [BIN / "kvserve", "agent", "serve", "--engine-url", f"http://127.0.0.1:{rt_port}",
             "--engine", "kvserve", "--host", "127.0.0.1", "--port", str(ag_port),
             "--interval", "0.5"],
            stdout=open(work / "agent.log", "w"), stderr=subprocess.STDOUT, env=env))

        # The router in front of it (spec.router): the dashboard's Router row reads its metrics.
        procs.append(subprocess.Popen(
            [BIN / "kvserve", "router", "--endpoints", f"http://127.0.0.1:{rt_port}", "--agent-port", "0",
             "--host", "127.0.0.1", "--port", str(router_port)],
            stdout=open(work / "router.log", "w"), stderr=subprocess.STDOUT, env=env))

        isvc = copy.deepcopy(tmon.SAMPLE_ISVC)
        isvc["metadata"].update(namespace=NS, name=ISVC)
        isvc["status"]["conditions"].append({"type": "Progressing", "status": "False"})
        ksm = FakeKubeStateMetrics(isvc)
        from kvserve.operator.metrics import OperatorMetrics

        operator_metrics = OperatorMetrics()
        operator_metrics.observe(NS, ISVC, desired=3, tp=2, ready=3)
        operator = operator_metrics.serve(0, addr="127.0.0.1")

        groups = copy.deepcopy(tmon.rule_groups())
        for g in groups:
            g["interval"] = "1s"
        (work / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
        pod = {"namespace": NS, "inferenceservice": ISVC, "pod": POD}
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                {"job_name": "kvserve-runtime", "static_configs": [
                    {"targets": [f"127.0.0.1:{rt_port}"], "labels": {**pod, "container": "runtime"}}]},
                {"job_name": "kvserve-agent", "static_configs": [
                    {"targets": [f"127.0.0.1:{ag_port}"], "labels": {**pod, "container": "agent"}}]},
                {"job_name": "kvserve-router", "static_configs": [
                    {"targets": [f"127.0.0.1:{router_port}"],
                     "labels": {"namespace": NS, "inferenceservice": ISVC, "pod": f"{ISVC}-router-0",
                                "container": "router"}}]},
                {"job_name": "kube-state-metrics", "honor_labels": True, "static_configs": [
                    {"targets": [f"127.0.0.1:{ksm.port}"]}]},
                {"job_name": "kvserve-operator", "honor_labels": True, "static_configs": [
                    {"targets": [f"127.0.0.1:{operator.server_port}"],
                     "labels": {"namespace": "kvserve-system", "pod": "kvserve-operator-0"}}]},
            ],
        }
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        wait_for(lambda: get_json(f"http://127.0.0.1:{rt_port}/ready"), 60, "runtime ready")
        procs.append(subprocess.Popen(
            [prom_bin / "prometheus", f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
            cwd=work, stdout=open(work / "prometheus.log", "w"), stderr=subprocess.STDOUT))
        wait_for(lambda: get_json(f"http://127.0.0.1:{router_port}/ready"), 30, "router ready")
        stream_traffic(f"http://127.0.0.1:{router_port}", stop,
                       "The cat sat on the mat and the dog watched the cat from the door")
        prom = f"http://127.0.0.1:{prom_port}"
        # A scaling decision once Prometheus has seen the old size, so that the dashboard's
        # annotation queries (changes of desired replicas and TP) see it.
        wait_for(lambda: query(prom, "kvserve_inferenceservice_desired_replicas == 3"), 30,
                 "prometheus scraping kube-state-metrics")
        isvc["status"].update(desiredReplicas=4, replicas=4, tensorParallelSize=4)
        yield {"prom": prom, "work": work}
    finally:
        stop.set()
        if ksm is not None:
            ksm.server.shutdown()
        if operator is not None:
            operator.shutdown()
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def query(prom: str, expr: str) -> list:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        body = get_json(url)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{expr!r}: {e.read().decode()}") from e
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def selectors(expr: str) -> list[str]:
    """The series selectors in an expression (metric name with its matchers)."""
    out = []
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", re.sub(r'"[^"]*"', '""', expr)):
        name = m.group(1)
        if name in FUNCTIONS or name in ("le",) or name.isdigit() or "_" not in name and ":" not in name:
            continue
        out.append(expr_slice(expr, name, m.start()))
    return out


def expr_slice(expr: str, name: str, start: int) -> str:
    """`name{...}` as written in the original expression (quotes kept)."""
    i = expr.find(name, start)
    j = i + len(name)
    if j < len(expr) and expr[j] == "{":
        j = expr.index("}", j) + 1
    return expr[i:j]


def test_every_rule_loads_and_evaluates_cleanly(live):
    prom = live["prom"]

    def evaluated():
        groups = get_json(f"{prom}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = wait_for(evaluated, 30, "rules evaluated")
    want = {r.get("record") or r.get("alert") for g in tmon.rule_groups() for r in g["rules"]}
    assert {r["name"] for r in rules} == want
    assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), \
        [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]


def test_every_recording_rule_returns_data(live):
    prom = live["prom"]
    records = [r["record"] for g in tmon.rule_groups() for r in g["rules"] if "record" in r]
    sel = f'{{namespace="{NS}", inferenceservice="{ISVC}"}}'
    wait_for(lambda: all(query(prom, f"{name}{sel}") for name in records), 40,
             "every recording rule to produce data: " + ", ".join(
                 n for n in records if not query(prom, f"{n}{sel}")))


def test_every_dashboard_query_returns_data(live):
    prom = live["prom"]
    exprs = [tmon.substitute(e, NS, ISVC, "1m") for e in tmon.dashboard_exprs(tmon.dashboard())]
    missing = lambda: [e for e in exprs if not query(prom, e)]  # noqa: E731
    try:
        wait_for(lambda: not missing(), 40, "dashboard queries")
    except AssertionError:
        raise AssertionError(f"dashboard queries without data: {missing()}") from None


def test_every_alert_parses_and_its_series_exist(live):
    prom = live["prom"]
    alerts = [r for g in tmon.rule_groups() for r in g["rules"] if "alert" in r]
    for rule in alerts:
        query(prom, rule["expr"])  # parses and evaluates (may be empty: nothing is on fire)
        for sel in selectors(rule["expr"]):
            wait_for(lambda: query(prom, sel), 30, f"{rule['alert']}: data for {sel}")


def test_dashboard_variables_find_the_inferenceservice(live):
    prom = live["prom"]
    for var in tmon.dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.*), (\w+)\)", var["definition"])
        match, label = m.group(1).replace("$namespace", NS), m.group(2)
        url = f"{prom}/api/v1/label/{label}/values?" + urllib.parse.urlencode({"match[]": match})
        values = get_json(url)["data"]
        assert {"namespace": NS, "inferenceservice": ISVC}[label] in values


def test_operator_series_keep_the_inferenceservice_namespace(live):
    """As the ServiceMonitor's honorLabels does: `up` is the operator's, its series the resource's."""
    prom = live["prom"]
    wait_for(lambda: query(prom, f'kvserve_operator_desired_replicas{{namespace="{NS}", inferenceservice="{ISVC}"}}'),
             30, "operator series")
    assert query(prom, 'up{job="kvserve-operator", namespace="kvserve-system"} == 1')
