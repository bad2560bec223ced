"""charts/kvserve rendered by the real Helm engine (scripts/helm_render.py: helm-sdkpy's
`install` into a kmock emulator with in-memory release storage), then:
- every object validates like the kustomize output does (strict Kubernetes schemas);
- the chart installs the same objects as the kustomize overlays, field for field, apart from
  Helm's own labels (cluster scope = base + monitoring, namespace scope = namespaced);
- Helm enforces values.schema.json; the switches (CRDs, monitoring, dashboards, scope) work.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import test_manifests as tm
import yaml

ROOT = Path(__file__).resolve().parent.parent
RENDER = ROOT / "scripts" / "helm_render.py"
HELM_LABELS = {"app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version", "helm.sh/chart"}
ALL_ON = {"monitoring": {"enabled": True}, "dashboards": {"enabled": True},
          "peering": {"create": True}}

CASES = {
    "defaults": {"values": {}},
    "cluster": {"values": ALL_ON},
    "namespace": {"values": {"rbac": {"scope": "namespace"}, "peering": {"create": True}}},
    "team-a": {"values": {"rbac": {"scope": "namespace", "watchNamespace": "team-a"},
                          "crds": {"install": False},
                          "monitoring": {"enabled": True, "labels": {"release": "prom"}},
                          "image": {"repository": "registry.local/kvserve", "tag": "dev",
                                    "pullPolicy": "Always"}}},
    "bring-your-own": {"values": {"rbac": {"create": False},
                                  "serviceAccount": {"create": False, "name": "platform-sa"},
                                  "crds": {"install": True, "keep": False},
                                  "operator": {"verbose": True,
                                               "extraArgs": ["--scrape-interval", "10"],
                                               "nodeSelector": {"pool": "system"}}}},
    "no-network-policy": {"values": {"networkPolicy": {"enabled": False}}},
    "closed-network-policy": {"values": {"networkPolicy": {"metricsNamespaces": []}}},
    "no-operator-monitor": {"values": {"monitoring": {"enabled": True, "operator": {"enabled": False}},
                                       "operator": {"metricsPort": 9100}}},
    "bad-scope": {"values": {"rbac": {"scope": "galaxy"}}},
    "bad-key": {"values": {"monitoring": {"enabeld": True}}},
    "bad-interval": {"values": {"monitoring": {"enabled": True, "interval": "soon"}}},
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    try:
        py = subprocess.run([sys.executable, str(RENDER), "--ensure-env"], check=True,
                            capture_output=True, text=True, timeout=300).stdout.strip()
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"real Helm (helm-sdkpy, Python >= 3.12) unavailable: {e}")
    cases = tmp_path_factory.mktemp("helm") / "cases.json"
    cases.write_text(json.dumps(CASES))
    out = subprocess.run([py, str(RENDER), str(cases)], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    return json.loads(out)


def objects(rendered: dict, case: str) -> list[dict]:
    result = rendered[case]
    assert "error" not in result, result.get("error")
    return [d for d in yaml.safe_load_all(result["manifest"]) if d]


def normalize(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    meta = doc["metadata"]
    for key in HELM_LABELS:
        meta.get("labels", {}).pop(key, None)
    meta.get("annotations", {}).pop("helm.sh/resource-policy", None)
    for key in ("labels", "annotations"):
        if key in meta and not meta[key]:
            del meta[key]
    return doc


def by_key(docs) -> dict:
    return {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): normalize(d)
            for d in docs}


@pytest.mark.parametrize("case", ["defaults", "cluster", "namespace", "team-a", "bring-your-own",
                                  "closed-network-policy"])
def test_every_rendered_object_validates(rendered, case):
    docs = objects(rendered, case)
    assert docs
    for doc in docs:
        try:
            tm.validate(doc)
        except Exception as e:
            raise AssertionError(f"{case}: {doc['kind']}/{doc['metadata']['name']}: {e}") from e


@pytest.mark.parametrize("case, overlays", [("cluster", ["base", "monitoring"]),
                                            ("namespace", ["namespaced"])])
def test_chart_installs_what_kustomize_installs(rendered, case, overlays):
    chart = by_key(objects(rendered, case))
    kustomize = by_key(d for o in overlays for d in tm.build(o) if d["kind"] != "Namespace")
    assert sorted(chart) == sorted(kustomize)
    for key, want in kustomize.items():
        assert chart[key] == want, key


def test_defaults_are_the_operator_with_crds_only(rendered):
    kinds = sorted({d["kind"] for d in objects(rendered, "defaults")})
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                     "Deployment", "NetworkPolicy", "Service", "ServiceAccount"]
    crds = [d for d in objects(rendered, "defaults") if d["kind"] == "CustomResourceDefinition"]
    assert {c["metadata"]["name"] for c in crds} == {
        "inferenceservices.kvserve.dev", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    assert all(c["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for c in crds)
    assert "in every namespace" in rendered["defaults"]["notes"]
    # Without a peering object kopf would pause: the default runs standalone, with no peering RBAC.
    (dep,) = [d for d in objects(rendered, "defaults") if d["kind"] == "Deployment"]
    assert "--standalone" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    (role,) = [d for d in objects(rendered, "defaults") if d["kind"] == "ClusterRole"]
    assert not any("kopf.dev" in r["apiGroups"] for r in role["rules"])


def test_namespace_scope_with_an_explicit_namespace_and_options(rendered):
    docs = objects(rendered, "team-a")
    assert not any(d["kind"] == "CustomResourceDefinition" for d in docs)
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "team-a"
    assert not any(d["kind"] in ("ClusterRole", "ClusterRoleBinding") for d in docs)
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=team-a" in c["args"] and "--all-namespaces" not in c["args"]
    assert c["image"] == "registry.local/kvserve:dev" and c["imagePullPolicy"] == "Always"
    monitors = [d for d in docs if d["kind"] in ("PodMonitor", "ServiceMonitor", "PrometheusRule")]
    assert len(monitors) == 5  # runtime, agent and router PodMonitors, operator ServiceMonitor, rules
    assert all(d["metadata"]["labels"]["release"] == "prom" for d in monitors)
    assert "in namespace team-a" in rendered["team-a"]["notes"]


@pytest.mark.parametrize("case, message", [("bad-scope", "/rbac/scope"),
                                           ("bad-key", "enabeld"),
                                           ("bad-interval", "/monitoring/interval")])
def test_values_schema_rejects_bad_values(rendered, case, message):
    assert "values don't meet the specifications" in rendered[case]["error"]
    assert message in rendered[case]["error"]


def test_bring_your_own_service_account_and_rbac(rendered):
    docs = objects(rendered, "bring-your-own")
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "platform-sa"
    assert pod["nodeSelector"] == {"pool": "system"}
    args = pod["containers"][0]["args"]
    assert args[-3:] == ["--verbose", "--scrape-interval", "10"]
    # Every flag the chart can emit is one `kvserve-operator run` accepts.
    cli = pytest.importorskip("kvserve.operator.cli")
    cli.build_parser().parse_args(args)
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert crds and not any("annotations" in c["metadata"] and
                            "helm.sh/resource-policy" in c["metadata"]["annotations"] for c in crds)


def test_operator_monitor_switch_and_metrics_port(rendered):
    docs = objects(rendered, "no-operator-monitor")
    assert "PodMonitor" in {d["kind"] for d in docs} and "ServiceMonitor" not in {d["kind"] for d in docs}
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--metrics-port=9100" in c["args"]
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in c["ports"]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    assert {"name": "metrics", "port": 9100, "targetPort": "metrics", "protocol": "TCP"} in svc["spec"]["ports"]


def test_network_policy_switch(rendered):
    """On by default (Prometheus in `monitoring` may scrape the metrics port, nothing else may
    connect); off with networkPolicy.enabled false; no namespace at all closes every port."""
    (policy,) = [d for d in objects(rendered, "defaults") if d["kind"] == "NetworkPolicy"]
    (dep,) = [d for d in objects(rendered, "defaults") if d["kind"] == "Deployment"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert not [d for d in objects(rendered, "no-network-policy") if d["kind"] == "NetworkPolicy"]
    (closed,) = [d for d in objects(rendered, "closed-network-policy") if d["kind"] == "NetworkPolicy"]
    assert closed["spec"]["ingress"] == []
