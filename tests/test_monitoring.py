"""Prometheus rules and the Grafana dashboard, checked offline with the real promtool.

- `promtool check rules` on the PrometheusRule's groups, and on every dashboard query (wrapped
  as recording rules, so each one is parsed by Prometheus' own parser);
- `promtool test rules` with a unit test for every alert (manifests/monitoring/tests);
- the kube-state-metrics config produces every kvserve_inferenceservice_* series the rules and
  the dashboard use, from a status shaped like the operator's.
The live check (a real Prometheus scraping a real runtime and agent) is test_monitoring_live.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MON = ROOT / "manifests" / "monitoring"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


prometheus_bin = _load_script("prometheus_bin")
gen = _load_script("gen_manifests")


@pytest.fixture(scope="module")
def promtool() -> Path:
    try:
        return prometheus_bin.ensure() / "promtool"
    except Exception as e:  # no apt and no binaries: say so instead of failing obscurely
        pytest.skip(f"promtool unavailable: {e}")


def rule_groups() -> list[dict]:
    return yaml.safe_load((MON / "prometheusrule.yaml").read_text())["spec"]["groups"]


def dashboard() -> dict:
    return json.loads((MON / "dashboards" / gen.DASHBOARD_FILE).read_text())


def dashboard_exprs(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    return exprs


def substitute(expr: str, namespace: str = "ml", isvc: str = "chat", rate: str = "1m") -> str:
    """Grafana's variables replaced as Grafana would before sending the query."""
    return (expr.replace("$namespace", namespace).replace("$inferenceservice", isvc)
            .replace("$__rate_interval", rate))


def run(cmd: list, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)


def test_promtool_check_rules(promtool, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups()}))
    proc = run([promtool, "check", "rules", rules])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_cover_every_alert(promtool, tmp_path):
    tests = yaml.safe_load((MON / "tests" / "rules.test.yaml").read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case.get("alert_rule_test", [])
              if t.get("exp_alerts")}
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}
    assert alerts == tested, f"alerts without a firing unit test: {alerts - tested}"
    assert tests["group_eval_order"] == [g["name"] for g in rule_groups()], (
        "every rule group must be in group_eval_order, or promtool orders them at random")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
    shutil.copy(MON / "tests" / "rules.test.yaml", tmp_path)
    proc = run([promtool, "test", "rules", "rules.test.yaml"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_dashboard_query_parses(promtool, tmp_path):
    exprs = [substitute(e) for e in dashboard_exprs(dashboard())]
    rules = [{"record": f"dashboard:query_{i}:check", "expr": e} for i, e in enumerate(exprs)]
    (tmp_path / "q.yaml").write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]}))
    proc = run([promtool, "check", "rules", tmp_path / "q.yaml"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_is_one_inferenceservice_at_a_time():
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"namespace", "inferenceservice"} <= set(variables)
    titles = {p["title"] for p in dash["panels"]}
    for needed in ["Replicas and tensor-parallel degree", "KV-cache utilization per pod",
                   "Queue depth (waiting requests)", "Running requests", "Tokens per second",
                   "Time to first token", "Inter-token latency", "Preemptions per second",
                   "Prefix-cache hit rate", "Engine step time by phase (mean per step)",
                   "Weights per pod (format, dtype, KV cache dtype)"]:
        assert needed in titles
    for expr in dashboard_exprs(dash):
        assert 'namespace="$namespace"' in expr and 'inferenceservice="$inferenceservice"' in expr
    weights = next(p for p in dash["panels"] if p["title"].startswith("Weights per pod"))
    expr = weights["targets"][0]["expr"]
    assert "kvserve:model_weight_bytes{" in expr and "kvserve:model_info{" in expr  # the runtime's names
    assert all(f"{{{{{label}}}}}" in weights["targets"][0]["legendFormat"]
               for label in ("pod", "quantization", "dtype", "kv_cache_dtype"))
    names = {a["name"] for a in dash["annotations"]["list"]}
    assert {"Replica decisions", "TP decisions"} <= names
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


# --- kube-state-metrics custom-resource-state, the subset our config uses -------------------

def _walk(obj, path):
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def _number(value):
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return 1.0 if value.lower() == "true" else 0.0
    return float(value)


def ksm_series(config: dict, obj: dict) -> list[tuple[str, dict, float]]:
    """What kube-state-metrics' Gauge metrics with path/valueFrom/labelsFromPath produce."""
    out = []
    for res in config["spec"]["resources"]:
        gvk = res["groupVersionKind"]
        if obj["apiVersion"] != f'{gvk["group"]}/{gvk["version"]}' or obj["kind"] != gvk["kind"]:
            continue
        common = {k: str(_walk(obj, p)) for k, p in res.get("labelsFromPath", {}).items()}
        common.update(customresource_group=gvk["group"], customresource_kind=gvk["kind"],
                      customresource_version=gvk["version"])
        for metric in res["metrics"]:
            gauge = metric["each"]["gauge"]
            name = f'{res["metricNamePrefix"]}_{metric["name"]}'
            value = _walk(obj, gauge["path"])
            items = value if isinstance(value, list) else [value]
            for item in items:
                if item is None:
                    continue
                labels = dict(common)
                for k, p in gauge.get("labelsFromPath", {}).items():
                    labels[k] = str(_walk(item, p))
                v = _walk(item, gauge["valueFrom"]) if "valueFrom" in gauge else item
                out.append((name, labels, _number(v)))
    return out


SAMPLE_ISVC = {
    "apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "chat", "namespace": "ml"},
    "spec": {"model": {"uri": "hf://org/m"}, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
    "status": {"replicas": 3, "readyReplicas": 2, "desiredReplicas": 3, "tensorParallelSize": 2,
               "conditions": [{"type": "Ready", "status": "True"},
                              {"type": "ScalingLimited", "status": "False"},
                              {"type": "Degraded", "status": "False"}]},
}


def ksm_config() -> dict:
    cm = yaml.safe_load((MON / "kube-state-metrics-crs.yaml").read_text())
    return yaml.safe_load(cm["data"]["custom-resource-state.yaml"])


def test_kube_state_metrics_config_yields_every_series_rules_and_dashboard_use():
    series = ksm_series(ksm_config(), SAMPLE_ISVC)
    produced = {name for name, _, _ in series}
    text = (MON / "prometheusrule.yaml").read_text() + "\n".join(dashboard_exprs(dashboard()))
    used = set(re.findall(r"\bkvserve_inferenceservice_[a-z_]+", text))
    assert used and used <= produced, used - produced
    by_name = {(n, lab.get("condition")): v for n, lab, v in series}
    assert by_name[("kvserve_inferenceservice_desired_replicas", None)] == 3
    assert by_name[("kvserve_inferenceservice_condition", "Ready")] == 1
    assert by_name[("kvserve_inferenceservice_condition", "Degraded")] == 0
    assert all(lab["inferenceservice"] == "chat" and lab["namespace"] == "ml"
               for _, lab, _ in series)


def test_ksm_paths_exist_in_the_crd():
    """Each status/spec path the kube-state-metrics config reads is a field of the CRD."""
    crd = yaml.safe_load((ROOT / "crds" / gen.CRD_FILE).read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for res in ksm_config()["spec"]["resources"]:
        for metric in res["metrics"]:
            node = schema
            for key in metric["each"]["gauge"]["path"]:
                assert key in node.get("properties", {}), (metric["name"], key)
                node = node["properties"][key]
