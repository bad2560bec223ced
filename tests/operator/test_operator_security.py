"""Issue 18 on Kubernetes: credentials only from Secrets, the per-pod admin token, HF_TOKEN only in
the fetch step, sizeLimits on the pods' emptyDirs, and the NetworkPolicies the operator renders
(checked for what they let through with tests/operator/netpol_eval.py, and strictly against the
Kubernetes schemas)."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from netpol_eval import Pod, allowed

from kvserve.operator import crd
from kvserve.operator import manifests as M
from kvserve.operator import netpol as N
from kvserve.operator import router as R
from kvserve.operator.cli import operator_namespace
from kvserve.operator.spec import GIB, SpecError, checkpoint_size_limit, parse_spec

K8S_VERSION = "1.33.0"
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "crds" / "examples"
UID = "0b5e2a1c-1111-4222-8333-944455556666"


def owner(name: str, **spec_changes) -> dict:
    obj = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    obj["metadata"]["uid"] = UID
    for key, value in spec_changes.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **value}
    return obj


def containers(dep: dict) -> dict[str, dict]:
    pod = dep["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"] + pod.get("initContainers", [])}


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def volumes(dep: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}


def render(obj: dict, replicas: int = 1, tp: int = 1) -> list[dict]:
    spec = parse_spec(obj["spec"])
    return (M.build_all(obj, spec, replicas=replicas, tp=tp) + N.build_network_policies(obj, spec)
            + (R.build_router_objects(obj, spec) if spec.router.enabled else []))


def deployment(obj: dict, tp: int = 1) -> dict:
    return M.build_deployment(obj, parse_spec(obj["spec"]), replicas=1, tp=tp)


# --- credentials: refused in plain text, rendered from Secrets ------------------------------------

@pytest.mark.parametrize("where, item, field, points_to", [
    ("env", {"name": "KVSERVE_API_KEY", "value": "sk-123"}, "spec.runtime.env[0]", "spec.runtime.apiKeySecret"),
    ("env", {"name": "VLLM_API_KEY", "value": "sk-123"}, "spec.runtime.env[0]", "spec.runtime.apiKeySecret"),
    ("env", {"name": "KVSERVE_ADMIN_API_KEY", "value": "x"}, "spec.runtime.env[0]",
     "spec.runtime.adminApiKeySecret"),
    ("env", {"name": "HF_TOKEN", "value": "hf_abc"}, "spec.runtime.env[0]", "spec.model.hfTokenSecret"),
    ("env", {"name": "HUGGING_FACE_HUB_TOKEN", "value": "hf_abc"}, "spec.runtime.env[0]", "spec.model.hfTokenSecret"),
    ("args", "--api-key", "spec.runtime.args[0]", "spec.runtime.apiKeySecret"),
    ("args", "--api-key=sk-123", "spec.runtime.args[0]", "spec.runtime.apiKeySecret"),
    ("args", "--admin-api-key=x", "spec.runtime.args[0]", "spec.runtime.adminApiKeySecret"),
])
def test_plain_text_credentials_are_refused_by_the_parser_and_the_crd(where, item, field, points_to):
    obj = owner("tiny-cpu")
    obj["spec"]["runtime"][where] = [item]
    with pytest.raises(SpecError) as error:
        parse_spec(obj["spec"])
    assert error.value.field == field and points_to in str(error.value)
    assert "sk-123" not in str(error.value) and "hf_abc" not in str(error.value)  # never echoed back
    # The API server refuses it first (CEL), naming the Secret fields.
    problems = crd.validate(obj)
    assert problems and any("Secret" in p for p in problems), problems


@pytest.mark.parametrize("item", [{"name": "KVSERVE_LOG", "value": "debug"}, "--admin-api-key-file=/k", "--api-keys"])
def test_other_env_and_args_pass(item):
    obj = owner("tiny-cpu")
    obj["spec"]["runtime"]["env" if isinstance(item, dict) else "args"] = [item]
    parse_spec(obj["spec"])
    assert crd.validate(obj) == []


@pytest.mark.parametrize("ref, error", [
    ({"name": "Bad_Name"}, "spec.runtime.apiKeySecret.name"),
    ({"key": "k"}, "spec.runtime.apiKeySecret.name"),
    ({"name": "ok", "key": "a/b"}, "spec.runtime.apiKeySecret.key"),
    ("llm-key", "spec.runtime.apiKeySecret"),
])
def test_bad_secret_references_name_the_field(ref, error):
    obj = owner("tiny-cpu", runtime={"apiKeySecret": ref})
    with pytest.raises(SpecError) as e:
        parse_spec(obj["spec"])
    assert e.value.field == error


def _values(objects: list[dict]) -> list[str]:
    """Every plain env value of every container of every object."""
    out = []
    for obj in objects:
        pod = (obj.get("spec") or {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            out += [e["name"] for e in c.get("env", []) if "value" in e]
    return out


def test_api_key_reaches_runtime_and_router_only_through_secret_key_ref():
    obj = owner("tiny-cpu", runtime={"apiKeySecret": {"name": "llm-key"}}, router={"enabled": True})
    objects = render(obj)
    ref = {"secretKeyRef": {"name": "llm-key", "key": "KVSERVE_API_KEY"}}
    c = containers(deployment(obj))
    assert env(c["runtime"])["KVSERVE_API_KEY"]["valueFrom"] == ref
    (router,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "tiny-router"]
    assert env(containers(router)["router"])["KVSERVE_API_KEY"]["valueFrom"] == ref
    # The agent calls no user route, the fetch step neither: neither gets the key.
    assert "KVSERVE_API_KEY" not in env(c["agent"]) and "KVSERVE_API_KEY" not in env(c["fetch-model"])
    assert not {"KVSERVE_API_KEY", "VLLM_API_KEY", "KVSERVE_ADMIN_API_KEY", "HF_TOKEN"} & set(_values(objects))
    for o in objects:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def test_vllm_gets_the_key_under_its_own_name():
    obj = owner("manual-vllm", runtime={"apiKeySecret": {"name": "llm-key", "key": "token"}})
    c = containers(deployment(obj, tp=2))
    assert env(c["runtime"])["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "llm-key", "key": "token"}}
    assert "KVSERVE_API_KEY" not in env(c["runtime"])
    # vLLM has no admin route and no kvserve binary: no admin token in its container.
    assert not {"KVSERVE_ADMIN_API_KEY_FILE", "KVSERVE_ADMIN_API_KEY"} & set(env(c["runtime"]))
    assert "admin-token" not in {m["name"] for m in c["runtime"]["volumeMounts"]}
    assert env(c["agent"])["KVSERVE_ADMIN_API_KEY_FILE"]["value"] == M.ADMIN_TOKEN_FILE


def test_hf_token_only_in_the_fetch_step():
    obj = owner("llama-8b-gpu")  # hfTokenSecret: {name: hf-token}
    c = containers(deployment(obj, tp=4))
    assert env(c["fetch-model"])["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    for name in ("runtime", "agent", "admin-token"):
        assert "HF_TOKEN" not in env(c[name]), name


def test_every_pod_gets_its_own_admin_token_in_memory():
    dep = deployment(owner("tiny-cpu"))
    c = containers(dep)
    init = dep["spec"]["template"]["spec"]["initContainers"]
    assert [i["name"] for i in init] == ["admin-token", "fetch-model"]
    assert c["admin-token"]["command"] == ["kvserve", "agent", "admin-token", "--out", "/var/run/kvserve/admin/token"]
    assert volumes(dep)["admin-token"] == {"name": "admin-token",
                                           "emptyDir": {"medium": "Memory", "sizeLimit": M.ADMIN_VOLUME_SIZE}}
    assert c["admin-token"]["volumeMounts"] == [{"name": "admin-token", "mountPath": "/var/run/kvserve/admin"},
                                                {"name": "tmp", "mountPath": "/tmp"}]  # HOME: the root is read-only
    for name in ("runtime", "agent"):
        assert {"name": "admin-token", "mountPath": "/var/run/kvserve/admin", "readOnly": True} \
            in c[name]["volumeMounts"]
        # The preStop hooks (`kvserve agent drain`) run in these containers and read the same variable.
        assert env(c[name])["KVSERVE_ADMIN_API_KEY_FILE"] == {"name": "KVSERVE_ADMIN_API_KEY_FILE",
                                                             "value": "/var/run/kvserve/admin/token"}
    assert "admin-token" not in {m["name"] for m in c["fetch-model"]["volumeMounts"]}
    kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_admin_key_secret_replaces_the_per_pod_token():
    dep = deployment(owner("tiny-cpu", runtime={"adminApiKeySecret": {"name": "ops"}}))
    c = containers(dep)
    assert "admin-token" not in c and "admin-token" not in volumes(dep)
    for name in ("runtime", "agent"):
        assert env(c[name])["KVSERVE_ADMIN_API_KEY"]["valueFrom"] == {
            "secretKeyRef": {"name": "ops", "key": "KVSERVE_ADMIN_API_KEY"}}
        assert "KVSERVE_ADMIN_API_KEY_FILE" not in env(c[name])


# --- sizeLimits -----------------------------------------------------------------------------------

@pytest.mark.parametrize("example, changes, tp, limit", [
    ("tiny-cpu", {"model": {"uri": "hf://kvserve/tiny-llama", "sizeLimit": "3Gi"}}, 1, "3Gi"),
    # No config, CPU: twice the memory limit (4Gi).
    ("tiny-cpu", {}, 1, "8Gi"),
    ("tiny-cpu", {"runtime": {"resources": {}}}, 1, "64Gi"),
    # GPUs, no config: twice what the pod's GPUs hold; load-time int4 reads a 4x larger checkpoint.
    ("manual-vllm", {}, 2, "320Gi"),
    ("manual-vllm", {"runtime": {"engine": "kvserve", "quantization": "int4"}}, 2, "1280Gi"),
    # Inline config (8B, bf16: 16.1e9 bytes of weights): * 1.25 + 1Gi, rounded up.
    ("llama-8b-gpu", {}, 4, "20Gi"),
])
def test_models_volume_size_limit(example, changes, tp, limit):
    obj = owner(example)
    for key, value in changes.items():
        obj["spec"][key] = value if key == "model" else {**obj["spec"].get(key, {}), **value}
    dep = deployment(obj, tp=tp)
    assert volumes(dep)["models"]["emptyDir"] == {"sizeLimit": limit}
    assert volumes(dep)["tmp"]["emptyDir"] == {"sizeLimit": M.TMP_SIZE_LIMIT}
    kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_a_config_learned_later_does_not_change_the_size_limit():
    """status.model's config replaces spec.model.config for TP planning; the pod template must
    not change with it (that would roll every pod once the first one reports)."""
    from dataclasses import replace

    spec = parse_spec(owner("manual-vllm")["spec"])
    learned = replace(spec, model=replace(spec.model, config={"model_type": "llama", "num_hidden_layers": 2,
                                                             "hidden_size": 64, "num_attention_heads": 4,
                                                             "vocab_size": 256, "intermediate_size": 128}))
    assert M.pod_template("q", spec, 2) == M.pod_template("q", learned, 2)


def test_checkpoint_size_limit_is_monotonic_in_the_model():
    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "vocab_size": 256, "intermediate_size": 128, "torch_dtype": "bfloat16"}
    small = checkpoint_size_limit(base)
    assert small == 2 * GIB  # tiny weights + 1Gi, rounded up
    assert checkpoint_size_limit({**base, "num_hidden_layers": 2000, "hidden_size": 4096,
                                  "intermediate_size": 16384, "num_attention_heads": 32}) > small
    assert checkpoint_size_limit({"model_type": "llama"}) is None
    assert checkpoint_size_limit(None) is None


@pytest.mark.parametrize("value", ["lots", 0, -1, True])
def test_bad_size_limit_names_the_field(value):
    obj = owner("tiny-cpu")
    obj["spec"]["model"]["sizeLimit"] = value
    with pytest.raises(SpecError) as e:
        parse_spec(obj["spec"])
    assert e.value.field == "spec.model.sizeLimit"


# --- NetworkPolicies ------------------------------------------------------------------------------

RUNTIME = Pod("default", M.labels("tiny"))
ROUTER = Pod("default", R.router_labels("tiny"))
OPERATOR = Pod("kvserve-system", {"app.kubernetes.io/name": "kvserve-operator"})
PROMETHEUS = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
NEIGHBOUR = Pod("default", {"app": "client"})
STRANGER = Pod("elsewhere", {"app": "client"})
FRIEND = Pod("team-a", {"app": "client"})
FAKE_OPERATOR = Pod("elsewhere", {"app.kubernetes.io/name": "kvserve-operator"})
GATEWAY = Pod("default", {"gateway.networking.k8s.io/gateway-name": "inference-gateway"})


def policies(**network_policy) -> list[dict]:
    obj = owner("tiny-cpu", router={"enabled": True}, networkPolicy=network_policy)
    return N.build_network_policies(obj, parse_spec(obj["spec"]))


# (source, target, port, allowed by default?)
REACH = [
    (ROUTER, RUNTIME, M.RUNTIME_PORT, True),
    (NEIGHBOUR, RUNTIME, M.RUNTIME_PORT, True),   # allowSameNamespace
    (STRANGER, RUNTIME, M.RUNTIME_PORT, False),
    (PROMETHEUS, RUNTIME, M.RUNTIME_PORT, True),  # /metrics is on the runtime port
    (OPERATOR, RUNTIME, M.RUNTIME_PORT, False),
    (OPERATOR, RUNTIME, M.AGENT_PORT, True),      # /v1/signals
    (ROUTER, RUNTIME, M.AGENT_PORT, True),
    (PROMETHEUS, RUNTIME, M.AGENT_PORT, True),
    (NEIGHBOUR, RUNTIME, M.AGENT_PORT, False),    # no /drain, no /v1/signals from other pods
    (STRANGER, RUNTIME, M.AGENT_PORT, False),
    (FAKE_OPERATOR, RUNTIME, M.AGENT_PORT, False),  # the label alone, in the wrong namespace
    (NEIGHBOUR, RUNTIME, 9999, False),              # any other port
    (NEIGHBOUR, ROUTER, R.ROUTER_PORT, True),
    (STRANGER, ROUTER, R.ROUTER_PORT, False),
    (OPERATOR, ROUTER, R.ROUTER_PORT, True),        # /router/demand
    (PROMETHEUS, ROUTER, R.ROUTER_PORT, True),
]


@pytest.mark.parametrize("source, target, port, expected", REACH)
def test_default_policies_let_through_exactly_who_needs_it(source, target, port, expected):
    assert allowed(policies(), source, target, port) is expected


def test_without_policies_everyone_reaches_everything():
    """What the issue found: the whole cluster reaches the agent's port."""
    assert allowed([], STRANGER, RUNTIME, M.AGENT_PORT)
    assert policies(enabled=False) == []


def test_allowed_namespaces_and_pods_open_the_service_ports_only():
    tight = policies(allowSameNamespace=False, allowedNamespaces=["team-a"],
                     allowedPods=[{"matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}}],
                     metrics={"namespaces": ["prom"], "podSelector": {"matchLabels": {"app": "prometheus"}}})
    assert allowed(tight, FRIEND, RUNTIME, M.RUNTIME_PORT) and allowed(tight, FRIEND, ROUTER, R.ROUTER_PORT)
    assert allowed(tight, GATEWAY, RUNTIME, M.RUNTIME_PORT)
    assert not allowed(tight, NEIGHBOUR, RUNTIME, M.RUNTIME_PORT)
    assert not allowed(tight, FRIEND, RUNTIME, M.AGENT_PORT) and not allowed(tight, GATEWAY, RUNTIME, M.AGENT_PORT)
    assert allowed(tight, ROUTER, RUNTIME, M.RUNTIME_PORT)
    assert not allowed(tight, PROMETHEUS, RUNTIME, M.RUNTIME_PORT)  # not in namespace "prom" any more
    assert allowed(tight, Pod("prom", {"app": "prometheus"}), RUNTIME, M.AGENT_PORT)
    assert not allowed(tight, Pod("prom", {"app": "grafana"}), RUNTIME, M.AGENT_PORT)


def test_no_client_and_no_metrics_means_no_rule_that_admits_everyone():
    """An ingress rule with an empty `from` admits every source: the builder must drop it."""
    closed = policies(allowSameNamespace=False, metrics={"namespaces": []})
    for policy in closed:
        assert all(rule["from"] for rule in policy["spec"]["ingress"])
    assert not allowed(closed, NEIGHBOUR, RUNTIME, M.RUNTIME_PORT)
    assert not allowed(closed, NEIGHBOUR, ROUTER, R.ROUTER_PORT)
    assert allowed(closed, ROUTER, RUNTIME, M.RUNTIME_PORT) and allowed(closed, OPERATOR, RUNTIME, M.AGENT_PORT)


def test_the_operator_peer_follows_where_the_operator_runs():
    obj = owner("tiny-cpu")
    moved = N.build_network_policies(obj, parse_spec(obj["spec"]), N.OperatorPeer(namespace="ops"))
    assert allowed(moved, Pod("ops", OPERATOR.labels), RUNTIME, M.AGENT_PORT)
    assert not allowed(moved, OPERATOR, RUNTIME, M.AGENT_PORT)


@pytest.mark.parametrize("flag, env_, own, expected", [
    ("ops", {"POD_NAMESPACE": "x"}, "y", "ops"),
    (None, {"POD_NAMESPACE": "x"}, "y", "x"),
    (None, {}, "y", "y"),
    (None, {}, None, "kvserve-system"),
])
def test_operator_namespace(flag, env_, own, expected):
    assert operator_namespace(flag, env_, own) == expected


def test_policies_are_owned_labelled_and_valid():
    obj = owner("tiny-cpu", router={"enabled": True},
                networkPolicy={"allowedNamespaces": ["team-a", "default"],
                               "allowedPods": [{"matchExpressions": [{"key": "app", "operator": "In",
                                                                      "values": ["gw"]}]}]})
    built = N.build_network_policies(obj, parse_spec(obj["spec"]))
    assert [p["metadata"]["name"] for p in built] == ["tiny", "tiny-router"]
    for p in built:
        kubernetes_validate.validate(p, K8S_VERSION, strict=True)
        (ref,) = p["metadata"]["ownerReferences"]
        assert ref["uid"] == UID and ref["controller"] is True
        assert p["spec"]["policyTypes"] == ["Ingress"]  # egress stays open (the Hub download)
    assert built[0]["spec"]["podSelector"]["matchLabels"] == M.selector_labels("tiny")
    assert built[1]["spec"]["podSelector"]["matchLabels"] == M.router_selector("tiny")
    # Without the router: one policy, and router pods (had there been any) lose the agent port.
    obj = owner("tiny-cpu")
    (only,) = N.build_network_policies(obj, parse_spec(obj["spec"]))
    assert only["metadata"]["name"] == "tiny"
    assert not allowed([only], ROUTER, RUNTIME, M.AGENT_PORT)


@pytest.mark.parametrize("raw, field", [
    ({"enabled": "yes"}, "spec.networkPolicy.enabled"),
    ({"allowedNamespaces": ["Team_A"]}, "spec.networkPolicy.allowedNamespaces[0]"),
    ({"allowedNamespaces": "team-a"}, "spec.networkPolicy.allowedNamespaces"),
    ({"allowedPods": [{"matchLabel": {"a": "b"}}]}, "spec.networkPolicy.allowedPods[0].matchLabel"),
    ({"allowedPods": [{"matchLabels": {"a": 1}}]}, "spec.networkPolicy.allowedPods[0].matchLabels.a"),
    ({"allowedPods": [{"matchExpressions": [{"key": "a", "operator": "Near"}]}]},
     "spec.networkPolicy.allowedPods[0].matchExpressions[0].operator"),
    ({"metrics": {"namespaces": [""]}}, "spec.networkPolicy.metrics.namespaces[0]"),
])
def test_bad_network_policy_fields_are_named(raw, field):
    obj = owner("tiny-cpu", networkPolicy=raw)
    with pytest.raises(SpecError) as e:
        parse_spec(obj["spec"])
    assert e.value.field == field


def test_crd_defaults_equal_parser_defaults_for_the_new_fields():
    minimal = {"model": {"uri": "hf://org/m"}, "runtime": {"apiKeySecret": {"name": "k"},
                                                           "adminApiKeySecret": {"name": "a"}}}
    defaulted = crd.apply_defaults({"spec": minimal}, crd.openapi_schema())["spec"]
    assert parse_spec(copy.deepcopy(minimal)) == parse_spec(defaulted)
    assert defaulted["networkPolicy"] == {"enabled": True, "allowSameNamespace": True,
                                          "metrics": {"namespaces": ["monitoring"]}}
    assert defaulted["runtime"]["apiKeySecret"] == {"name": "k", "key": "KVSERVE_API_KEY"}


def test_the_gateway_example_still_reaches_its_pods():
    """manifests/examples/gateway-api-inference-extension: the gateway's pods and the endpoint
    picker reach the runtime port (requests, /metrics); other pods of the namespace do not."""
    example = ROOT / "manifests" / "examples" / "gateway-api-inference-extension"
    isvc = yaml.safe_load((example / "inferenceservice.yaml").read_text())
    isvc["metadata"]["uid"] = UID
    built = N.build_network_policies(isvc, parse_spec(isvc["spec"]))
    epp = next(d for d in yaml.safe_load_all((example / "endpoint-picker.yaml").read_text())
               if d["kind"] == "Deployment")
    gateway = next(d for d in yaml.safe_load_all((example / "gateway.yaml").read_text()) if d["kind"] == "Gateway")
    runtime = Pod("llm", M.labels("qwen3-8b"))
    epp_pod = Pod("llm", epp["spec"]["template"]["metadata"]["labels"])
    gateway_pod = Pod("llm", {"gateway.networking.k8s.io/gateway-name": gateway["metadata"]["name"]})
    assert allowed(built, epp_pod, runtime, M.RUNTIME_PORT)
    assert allowed(built, gateway_pod, runtime, M.RUNTIME_PORT)
    assert not allowed(built, Pod("llm", {"app": "curl"}), runtime, M.RUNTIME_PORT)
    assert not allowed(built, epp_pod, runtime, M.AGENT_PORT)
