"""manifests/examples/gateway-api-inference-extension: kvserve behind GAIE's InferencePool and
endpoint picker, kept valid and consistent with what the operator builds.

Core kinds validate strictly against Kubernetes 1.33 (kubernetes-validate); the InferenceService
against kvserve's CRD; the InferencePool against GAIE's own CRD (v1.5.0, vendored in
tests/fixtures/gaie with its source) with its CEL rules; Gateway and HTTPRoute against closed
schemas of just the fields used. Then the wiring: the pool selects exactly the pods the operator
makes, on the runtime's port; the picker's Service, Deployment, RBAC and plugin config fit
together; the runtime exports every metric the picker's mapping reads.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvserve.operator import crd
from kvserve.operator import manifests as M
from kvserve.operator.spec import parse_spec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "manifests" / "examples" / "gateway-api-inference-extension"
POOL_CRD = Path(__file__).parent / "fixtures" / "gaie" / "inferencepools.inference.networking.k8s.io.yaml"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize)")

_REF = {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
    "group": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"},
    "namespace": {"type": "string"}}}
GATEWAY_API = {
    "Gateway": {"type": "object", "properties": {"spec": {
        "type": "object", "additionalProperties": False, "required": ["gatewayClassName", "listeners"],
        "properties": {"gatewayClassName": {"type": "string", "minLength": 1}, "listeners": {
            "type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "protocol", "port"],
                "properties": {"name": {"type": "string"}, "protocol": {"enum": ["HTTP", "HTTPS"]},
                               "port": {"type": "integer", "minimum": 1, "maximum": 65535}}}}}}}},
    "HTTPRoute": {"type": "object", "properties": {"spec": {
        "type": "object", "additionalProperties": False, "required": ["parentRefs", "rules"],
        "properties": {"parentRefs": {"type": "array", "minItems": 1, "items": _REF}, "rules": {
            "type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["backendRefs"], "properties": {
                    "matches": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                                           "properties": {"path": {
                                                               "type": "object", "additionalProperties": False,
                                                               "properties": {"type": {"enum": ["PathPrefix", "Exact"]},
                                                                              "value": {"type": "string"}}}}}},
                    "backendRefs": {"type": "array", "minItems": 1, "items": _REF},
                    "timeouts": {"type": "object", "additionalProperties": False, "properties": {
                        "request": {"type": "string", "pattern": "^([0-9]{1,5}(h|m|s|ms)){1,4}$"}}}}}}}}}},
}


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    out = subprocess.run(["kubectl", "kustomize", str(EXAMPLE)], check=True, capture_output=True, text=True).stdout
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}


def test_every_object_validates(docs):
    pool_crd = yaml.safe_load(POOL_CRD.read_text())
    kinds = set()
    for (kind, name), doc in docs.items():
        kinds.add(kind)
        assert doc["metadata"].get("namespace", "llm") == "llm"
        if doc["apiVersion"] == "kvserve.dev/v1alpha1":
            assert crd.validate(doc) == [], name
        elif doc["apiVersion"] == "inference.networking.k8s.io/v1":
            assert crd.validate(doc, crd=pool_crd, version="v1") == [], name
        elif doc["apiVersion"].startswith("gateway.networking.k8s.io/"):
            jsonschema.validate(doc, GATEWAY_API[kind])
        else:
            kubernetes_validate.validate(doc, "1.33.0", strict=True)
    assert kinds == {"Namespace", "InferenceService", "InferencePool", "ServiceAccount", "Role", "RoleBinding",
                     "ConfigMap", "Deployment", "Service", "Gateway", "HTTPRoute"}


def test_the_vendored_pool_crd_rejects_what_it_should(docs):
    """The fixture really checks: a pool without targetPorts, or with a duplicate port, fails."""
    pool_crd = yaml.safe_load(POOL_CRD.read_text())
    pool = docs[("InferencePool", "qwen3-8b")]
    broken = {**pool, "spec": {k: v for k, v in pool["spec"].items() if k != "targetPorts"}}
    assert any("targetPorts" in e for e in crd.validate(broken, crd=pool_crd, version="v1"))
    twice = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 8000}, {"number": 8000}]}}
    assert any("unique" in e for e in crd.validate(twice, crd=pool_crd, version="v1"))
    typo = {**pool, "spec": {**pool["spec"], "targetPort": 8000}}
    assert crd.validate(typo, crd=pool_crd, version="v1")


def test_the_pool_selects_the_operators_pods_on_the_runtime_port(docs):
    isvc = docs[("InferenceService", "qwen3-8b")]
    isvc["metadata"]["uid"] = "0b5e2a1c-1111-4222-8333-944455556666"
    deployment = M.build_deployment(isvc, parse_spec(isvc["spec"]), replicas=2, tp=1)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    pool = docs[("InferencePool", "qwen3-8b")]["spec"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    # Nothing else the operator makes matches: the selector is its own Deployment's.
    assert pool["selector"]["matchLabels"] == M.selector_labels("qwen3-8b")
    runtime = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "runtime")
    assert [p["number"] for p in pool["targetPorts"]] == [runtime["ports"][0]["containerPort"]] == [M.RUNTIME_PORT]


def test_the_endpoint_picker_fits_together(docs):
    pool = docs[("InferencePool", "qwen3-8b")]["spec"]
    ref = pool["endpointPickerRef"]
    service = docs[("Service", ref["name"])]
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    deployment = docs[("Deployment", ref["name"])]
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    epp = pod["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in epp["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in named
    args = dict(a.removeprefix("--").split("=", 1) for a in epp["args"])
    assert (args["pool-name"], args["pool-namespace"], args["pool-group"]) == (
        "qwen3-8b", "llm", "inference.networking.k8s.io")
    assert pod["spec"]["serviceAccountName"] == ref["name"]
    # The plugin config is where --config-file says, and every profile entry names a plugin.
    mount = next(m for m in epp["volumeMounts"] if args["config-file"].startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = docs[("ConfigMap", volume["configMap"]["name"])]
    config = yaml.safe_load(config_map["data"][Path(args["config-file"]).name])
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]) for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= plugins
    # It may read the pool's pods and the pool.
    role = docs[("Role", ref["name"])]
    binding = docs[("RoleBinding", ref["name"])]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == ref["name"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    for verb in ("get", "list", "watch"):
        assert ("", "pods", verb) in granted and ("inference.networking.k8s.io", "inferencepools", verb) in granted


def test_the_runtime_exports_what_the_picker_reads(docs):
    from kvserve.runtime.server.metrics import EXPORTED_NAMES

    config_map = docs[("ConfigMap", "qwen3-8b-epp")]
    config = yaml.safe_load(config_map["data"]["plugins.yaml"])
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    mapping = next(e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"])
    read = {v for k, v in mapping.items() if k.endswith("Spec") and v}
    assert read == {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                    "vllm:cache_config_info"}
    assert read <= set(EXPORTED_NAMES)
    source = next(p for p in config["plugins"] if p["type"] == "metrics-data-source")["parameters"]
    assert source["path"] == "/metrics"


def test_the_route_sends_the_gateway_to_the_pool(docs):
    route = docs[("HTTPRoute", "qwen3-8b")]["spec"]
    (parent,) = route["parentRefs"]
    assert (parent["kind"], parent["name"]) == ("Gateway", "inference-gateway")
    assert ("Gateway", parent["name"]) in docs
    (backend,) = route["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", "qwen3-8b")
