"""The kustomize manifests: every overlay builds with the real `kubectl kustomize`, built-in
objects validate strictly against Kubernetes' own schemas, custom resources against their CRD's
schema (or, for other projects' CRDs we do not ship, a minimal schema of the fields we use)."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S_VERSION = "1.33.0"
OVERLAYS = ["crds", "base", "namespaced", "monitoring", "examples/inferenceservices",
            "examples/argocd"]

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize)")


@cache
def build(overlay: str) -> tuple:
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "manifests" / overlay)],
                         check=True, capture_output=True, text=True).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema for every CRD we ship."""
    out = {}
    for crd in build("crds"):
        for v in crd["spec"]["versions"]:
            api = f'{crd["spec"]["group"]}/{v["name"]}'
            out[(api, crd["spec"]["names"]["kind"])] = v["schema"]["openAPIV3Schema"]
    return out


# Other projects' custom resources: only the fields these manifests use, closed where we can
# be sure of the shape, so that a typo in what we wrote fails.
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"], "additionalProperties": False,
        "properties": {"key": {"type": "string"},
                       "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": {"type": "string"}}}}}}}
_RELABEL = {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
    "sourceLabels": {"type": "array", "items": {"type": "string"}}, "regex": {"type": "string"},
    "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep"]},
    "targetLabel": {"type": "string"}, "replacement": {"type": "string"}}}}
_ENDPOINT = {"type": "object", "additionalProperties": False, "properties": {
    "port": {"type": "string"}, "path": {"type": "string"},
    "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"}, "relabelings": _RELABEL}}
_NS_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}}
_META = {"type": "object", "required": ["name", "namespace"]}
_RULE = {"type": "object", "additionalProperties": False, "required": ["expr"],
         "oneOf": [{"required": ["record"]}, {"required": ["alert"]}], "properties": {
             "record": {"type": "string"}, "alert": {"type": "string"}, "expr": {"type": "string"},
             "for": {"type": "string"}, "labels": {"type": "object"},
             "annotations": {"type": "object"}}}
FOREIGN_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): {"type": "object", "properties": {
        "metadata": _META, "spec": {"type": "object", "additionalProperties": False,
                                    "required": ["selector", "podMetricsEndpoints"], "properties": {
            "namespaceSelector": _NS_SELECTOR, "selector": _SELECTOR, "jobLabel": {"type": "string"},
            "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}}}},
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {"type": "object", "properties": {
        "metadata": _META, "spec": {"type": "object", "additionalProperties": False,
                                    "required": ["selector", "endpoints"], "properties": {
            "namespaceSelector": _NS_SELECTOR, "selector": _SELECTOR, "jobLabel": {"type": "string"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                **_ENDPOINT, "properties": {**_ENDPOINT["properties"], "honorLabels": {"type": "boolean"}}}}}}}},
    ("monitoring.coreos.com/v1", "PrometheusRule"): {"type": "object", "properties": {
        "metadata": _META, "spec": {"type": "object", "additionalProperties": False, "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "interval": {"type": "string"},
                               "rules": {"type": "array", "items": _RULE}}}}}}}},
    ("argoproj.io/v1alpha1", "Application"): {"type": "object", "properties": {
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {"type": "object", "required": ["source", "destination", "project"],
                 "additionalProperties": False, "properties": {
            "project": {"type": "string"},
            "source": {"type": "object", "required": ["repoURL", "path"],
                       "additionalProperties": False, "properties": {
                "repoURL": {"type": "string"}, "targetRevision": {"type": "string"},
                "path": {"type": "string"}}},
            "destination": {"type": "object", "additionalProperties": False, "properties": {
                "server": {"type": "string"}, "namespace": {"type": "string"},
                "name": {"type": "string"}}},
            "syncPolicy": {"type": "object", "additionalProperties": False, "properties": {
                "automated": {"type": "object", "additionalProperties": False, "properties": {
                    "prune": {"type": "boolean"}, "selfHeal": {"type": "boolean"}}},
                "syncOptions": {"type": "array", "items": {"type": "string"}}}}}}}},
}


def crd_validate(doc: dict, schema: dict) -> None:
    """OpenAPI 3.0 schemas are JSON Schema draft 4 in shape (boolean exclusiveMinimum)."""
    jsonschema.Draft4Validator(schema).validate(doc)


def validate(doc: dict) -> None:
    key = (doc["apiVersion"], doc["kind"])
    schemas = crd_schemas()
    if key in schemas:
        crd_validate(doc, schemas[key])
    elif key in FOREIGN_SCHEMAS:
        jsonschema.validate(doc, FOREIGN_SCHEMAS[key])
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_generated_files_are_in_sync():
    """CRD copies, dashboard JSON and the chart's copies match their sources."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gen_manifests.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates(overlay):
    docs = build(overlay)
    assert docs
    for doc in docs:
        try:
            validate(doc)
        except Exception as e:  # name the object: a bare schema error says nothing of where
            raise AssertionError(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {e}") from e


def _operator_deployment(overlay: str) -> dict:
    (dep,) = [d for d in build(overlay) if d["kind"] == "Deployment"]
    return dep


@pytest.mark.parametrize("overlay", ["base", "namespaced"])
def test_operator_deployment_is_hardened(overlay):
    pod = _operator_deployment(overlay)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["serviceAccountName"] == "kvserve-operator"
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["command"] == ["kvserve-operator"] and c["args"][0] == "run"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"]["port"] in ports
    # The flags are the real CLI's, and the liveness endpoint is where the probe looks.
    cli = pytest.importorskip("kvserve.operator.cli")
    args = cli.build_parser().parse_args(c["args"])
    assert args.liveness == f"http://0.0.0.0:{ports[c['livenessProbe']['httpGet']['port']]}/healthz"
    assert args.metrics_port == ports["metrics"]


def test_namespaced_overlay_watches_its_namespace_only():
    dep = _operator_deployment("namespaced")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=$(POD_NAMESPACE)" in args and "--all-namespaces" not in args
    kinds = {(d["kind"], d["metadata"]["name"]) for d in build("namespaced")}
    assert ("ClusterRole", "kvserve-operator") not in kinds
    assert ("ClusterKopfPeering", "default") not in kinds
    assert ("Role", "kvserve-operator") in kinds and ("KopfPeering", "default") in kinds


# What the operator does against the API (docs/operator.md "RBAC the operator needs"):
# (group, resource) -> verbs. The operator's own calls are also the ones `make demo` /
# tests/test_demo.py record from a real run (scripts/rbac_audit.py).
NAMESPACED_NEEDS = {
    ("kvserve.dev", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("kvserve.dev", "inferenceservices/status"): {"patch"},
    ("apps", "deployments"): {"get", "create", "patch", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "create", "patch", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets/scale"): {"get", "patch"},
    ("", "services"): {"get", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "create", "patch", "delete"},  # spec.adapters
    ("", "persistentvolumeclaims"): {"get", "create", "patch"},  # spec.runtime.kvOffload.storageClassName
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch", "delete"},
    ("", "pods"): {"get", "list", "watch"},  # get/watch only to grant them to a router (spec.router)
    ("", "secrets"): {"get"},  # spec.parallelism.devicesPerPod: the admin key shown to the pods' agents
    ("", "serviceaccounts"): {"get", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"get", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch", "delete"},  # spec.networkPolicy
    ("", "events"): {"create"},
}
# --all-namespaces: kopf scans CRDs and uses the cluster-wide peering object.
CLUSTER_NEEDS = {**NAMESPACED_NEEDS,
                 ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
                 ("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"}}
# A plain --namespace: no scanning, the namespaced peering object.
ROLE_NEEDS = {**NAMESPACED_NEEDS, ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"}}


def grants(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


def test_cluster_rbac_is_exactly_what_the_operator_uses():
    docs = build("base")
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert grants(role["rules"]) == CLUSTER_NEEDS
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvserve-operator",
                                    "namespace": "kvserve-system"}]
    assert not any(d["kind"] == "Secret" for d in docs)


def test_namespaced_rbac_is_one_role_and_nothing_cluster_wide():
    docs = build("namespaced")
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "kvserve-system"
    assert grants(role["rules"]) == ROLE_NEEDS
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_crd_copies_are_the_operators_crds():
    for name in ("inferenceservices.kvserve.dev.yaml", "kopf-peering.yaml"):
        for src in yaml.safe_load_all((ROOT / "crds" / name).read_text()):
            (shipped,) = [d for d in build("crds") if d["metadata"]["name"] == src["metadata"]["name"]]
            assert shipped == src


def test_examples_validate_against_the_crd_and_bad_ones_do_not():
    schema = crd_schemas()[("kvserve.dev/v1alpha1", "InferenceService")]
    isvcs = [d for d in build("examples/inferenceservices") if d["kind"] == "InferenceService"]
    assert {d["metadata"]["name"] for d in isvcs} == {"tiny-cpu", "llama-8b"}
    for doc in isvcs:
        crd_validate(doc, schema)
    gpu = next(d for d in isvcs if d["metadata"]["name"] == "llama-8b")
    assert gpu["spec"]["parallelism"]["tensor"] == {"min": 1, "max": 4, "initial": 1}
    assert gpu["spec"]["autoscaling"]["tensorParallel"]["enabled"] is True
    cpu = next(d for d in isvcs if d["metadata"]["name"] == "tiny-cpu")
    assert cpu["spec"]["gpu"]["perShard"] == 0
    for path, value in [(("runtime", "engine"), "tgi"), (("model", "uri"), "s3://bucket/x"),
                        (("autoscaling", "maxReplicas"), 0), (("runtime", "blockSize"), 7)]:
        bad = copy.deepcopy(cpu)
        bad["spec"][path[0]][path[1]] = value
        with pytest.raises(jsonschema.ValidationError):
            crd_validate(bad, schema)


def test_argocd_applications_point_at_real_folders():
    apps = {a["metadata"]["name"]: a for a in build("examples/argocd")}
    assert apps["kvserve-inferenceservices"]["spec"]["source"]["path"] == \
        "manifests/examples/inferenceservices"
    assert apps["kvserve-operator"]["spec"]["source"]["path"] == "manifests/base"
    for app in apps.values():
        assert (ROOT / app["spec"]["source"]["path"] / "kustomization.yaml").exists()
        assert "ignoreDifferences" not in app["spec"]


def test_monitoring_targets_every_inference_pod_by_contract_port():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in build("monitoring")}
    for name, port, label in [("kvserve-runtime", "8000", "kvserve.dev/inferenceservice"),
                              ("kvserve-agent", "8081", "kvserve.dev/inferenceservice"),
                              ("kvserve-router", "8000", "kvserve.dev/router")]:
        pm = docs[("PodMonitor", name)]["spec"]
        assert pm["namespaceSelector"] == {"any": True}
        assert pm["selector"]["matchExpressions"][0]["key"] == label
        relabel = pm["podMetricsEndpoints"][0]["relabelings"]
        assert {"sourceLabels": ["__meta_kubernetes_pod_container_port_number"], "regex": port,
                "action": "keep"} in relabel
        source = "__meta_kubernetes_pod_label_" + label.replace(".", "_").replace("/", "_")
        assert {"sourceLabels": [source], "targetLabel": "inferenceservice"} in relabel
    dash = docs[("ConfigMap", "kvserve-dashboard")]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    # The operator's own /metrics: the ServiceMonitor picks the base Service's `metrics` port,
    # which reaches the container port the operator serves on.
    sm = docs[("ServiceMonitor", "kvserve-operator")]
    assert sm["metadata"]["namespace"] == "kvserve-system" and "namespaceSelector" not in sm["spec"]
    base = {(d["kind"], d["metadata"]["name"]): d for d in build("base")}
    svc = base[("Service", "kvserve-operator")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True  # kvserve_operator_* keep the InferenceService's namespace
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
    (container,) = base[("Deployment", "kvserve-operator")]["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    assert f"--metrics-port={port['port']}" in container["args"]


def test_the_operator_can_serve_the_examples():
    """The examples pass the operator's own parser and servability rules, and the GPU one can
    really use TP 1, 2 and 4 (heads divide, weights fit in 80 GiB)."""
    spec_mod = pytest.importorskip("kvserve.operator.spec")
    autoscaler = pytest.importorskip("kvserve.operator.autoscaler")
    crd = pytest.importorskip("kvserve.operator.crd")
    for doc in build("examples/inferenceservices"):
        if doc["kind"] != "InferenceService":
            continue
        # What an API server would answer: defaults, unknown fields refused, CEL rules.
        assert crd.validate(doc) == [], doc["metadata"]["name"]
        spec = spec_mod.parse_spec(doc["spec"])
        shape = spec_mod.model_shape(spec)
        spec_mod.check_servable(spec, shape)
        if doc["metadata"]["name"] == "llama-8b":
            assert autoscaler.valid_degrees(spec, shape) == [1, 2, 4]


def test_rbac_audit_flags_what_a_role_does_not_grant():
    sys.path.insert(0, str(ROOT / "scripts"))
    import rbac_audit

    rules = [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "patch"]}]
    used = [("get", "apps", "deployments"), ("delete", "apps", "deployments"),
            ("list", "", "pods")]
    denied, unused = rbac_audit.audit(used, rules)
    assert denied == {("delete", "apps", "deployments"), ("list", "", "pods")}
    assert unused == {("patch", "apps", "deployments")}


def test_rbac_audit_counts_a_server_side_apply_as_patch_and_create():
    """The operator creates what it owns by server-side apply, which the API server authorizes
    as create when the object does not exist yet: the audit asks for both rights."""
    from types import SimpleNamespace as NS

    sys.path.insert(0, str(ROOT / "scripts"))
    import rbac_audit

    def request(method, action, content_type):
        return NS(headers={"User-Agent": "kvserve-operator", "Content-Type": content_type},
                  resource=NS(plural="deployments", group="apps"), subresource=None,
                  method=NS(value=method), action=NS(value=action))

    assert rbac_audit.from_kmock([request("PATCH", "update", "application/apply-patch+yaml")]) == [
        ("patch", "apps", "deployments"), ("create", "apps", "deployments")]
    assert rbac_audit.from_kmock([request("PATCH", "update", "application/merge-patch+json")]) == [
        ("patch", "apps", "deployments")]


def test_namespaced_overlay_moves_whole_to_another_namespace(tmp_path):
    """`namespace: team-a` on top of manifests/namespaced: the operator, its Role, binding and
    peering all follow, and it watches team-a."""
    import os

    rel = os.path.relpath(ROOT / "manifests" / "namespaced", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(f"namespace: team-a\nresources:\n  - {rel}\n")
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], check=True, capture_output=True,
                         text=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    for doc in docs:
        validate(doc)
        if doc["kind"] == "Namespace":
            assert doc["metadata"]["name"] == "team-a"
        elif doc["kind"] != "CustomResourceDefinition":
            assert doc["metadata"]["namespace"] == "team-a", doc["kind"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["subjects"][0]["namespace"] == "team-a"
