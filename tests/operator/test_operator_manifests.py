"""Every object the operator builds is a valid Kubernetes object (strict) with the promised shape."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvserve.operator import manifests as M
from kvserve.operator.netpol import build_network_policies
from kvserve.operator.spec import parse_spec

K8S_VERSION = "1.33.0"
EXAMPLES = Path(__file__).resolve().parents[2] / "crds" / "examples"


def owner(name: str) -> dict:
    obj = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    obj["metadata"]["uid"] = "0b5e2a1c-1111-4222-8333-944455556666"
    return obj


CASES = [("tiny-cpu", 1, 1), ("llama-8b-gpu", 3, 1), ("llama-8b-gpu", 8, 4), ("manual-vllm", 2, 2)]


@pytest.mark.parametrize("example,replicas,tp", CASES)
def test_every_manifest_validates_strictly(example, replicas, tp):
    obj = owner(example)
    spec = parse_spec(obj["spec"])
    for manifest in M.build_all(obj, spec, replicas=replicas, tp=tp) + build_network_policies(obj, spec):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_strict_validation_would_catch_a_misspelled_field():
    obj = owner("tiny-cpu")
    dep = M.build_deployment(obj, parse_spec(obj["spec"]), replicas=1, tp=1)
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def _containers(dep):
    pod = dep["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"] + pod["initContainers"]}


def test_gpu_deployment_shape():
    obj = owner("llama-8b-gpu")
    spec = parse_spec(obj["spec"])
    dep = M.build_deployment(obj, spec, replicas=3, tp=4)
    c = _containers(dep)
    runtime, agent, fetch = c["runtime"], c["agent"], c["fetch-model"]
    assert dep["spec"]["replicas"] == 3
    assert runtime["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert runtime["resources"]["requests"]["nvidia.com/gpu"] == "4"
    cmd = runtime["command"]
    assert cmd[:3] == ["kvserve", "serve", "/models/llama-8b"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
    assert cmd[cmd.index("--port") + 1] == "8000"
    assert cmd[cmd.index("--served-model-name") + 1] == "llama-3.1-8b"
    assert "--device" not in cmd
    assert agent["command"][:3] == ["kvserve", "agent", "serve"]
    assert agent["command"][agent["command"].index("--engine-url") + 1] == "http://127.0.0.1:8000"
    assert agent["command"][agent["command"].index("--port") + 1] == "8081"
    assert fetch["command"] == ["kvserve", "agent", "fetch", "hf://meta-llama/Llama-3.1-8B-Instruct",
                                "/models/llama-8b"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}} in fetch["env"]
    for container in (runtime, agent, fetch):
        sc = container["securityContext"]
        assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["readOnlyRootFilesystem"]
        assert sc["capabilities"] == {"drop": ["ALL"]}
    assert runtime["lifecycle"]["preStop"]["exec"]["command"][:3] == ["kvserve", "agent", "drain"]
    assert agent["lifecycle"]["preStop"]["exec"]["command"][:3] == ["kvserve", "agent", "drain"]
    # kvserve: alive while loading (/live), in the Service only when serving (/ready).
    assert [runtime[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")] \
        == ["/live", "/live", "/ready"]
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]  # NCCL needs shm at TP > 1
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert dep["spec"]["template"]["metadata"]["annotations"][M.TP_ANNOTATION] == "4"
    assert M.template_tp(dep) == 4


def test_cpu_pod_asks_for_no_gpu_and_runs_on_cpu():
    obj = owner("tiny-cpu")
    dep = M.build_deployment(obj, parse_spec(obj["spec"]), replicas=1, tp=1)
    runtime = _containers(dep)["runtime"]
    assert "nvidia.com/gpu" not in runtime["resources"]["limits"]
    assert runtime["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
    assert runtime["command"][-2:] == ["--device", "cpu"]


def test_vllm_from_pvc():
    obj = owner("manual-vllm")
    dep = M.build_deployment(obj, parse_spec(obj["spec"]), replicas=2, tp=2)
    c = _containers(dep)
    assert c["runtime"]["command"][:2] == ["vllm", "serve"]
    assert c["runtime"]["command"][-2:] == ["--max-num-batched-tokens", "8192"]
    assert "lifecycle" not in c["runtime"]  # no kvserve binary in vLLM's image; the agent drains
    assert c["agent"]["command"][c["agent"]["command"].index("--engine") + 1] == "vllm"
    assert c["fetch-model"]["command"][3] == "/model-source/qwen2.5-7b-instruct"
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["model-source"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


@pytest.mark.parametrize("build", [M.build_service, M.build_pdb])
def test_service_and_pdb_select_the_pods(build):
    obj = owner("tiny-cpu")
    out = build(obj)
    selector = out["spec"]["selector"]
    selector = selector.get("matchLabels", selector)
    assert selector == {"app.kubernetes.io/instance": "tiny", "kvserve.dev/inferenceservice": "tiny"}


def test_labels_and_owner_references_on_everything():
    obj = owner("tiny-cpu")
    for m in M.build_all(obj, parse_spec(obj["spec"]), replicas=1, tp=1):
        meta = m["metadata"]
        assert meta["name"] == "tiny" and meta["namespace"] == "default"
        assert meta["labels"]["app.kubernetes.io/instance"] == "tiny"
        assert meta["labels"]["kvserve.dev/inferenceservice"] == "tiny"
        (ref,) = meta["ownerReferences"]
        assert ref == {"apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService", "name": "tiny",
                       "uid": obj["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    svc = M.build_service(obj)
    assert svc["spec"]["ports"][0]["port"] == 8000


def test_builders_are_deterministic_and_do_not_mutate_input():
    obj = owner("llama-8b-gpu")
    before = copy.deepcopy(obj)
    spec = parse_spec(obj["spec"])
    assert M.build_all(obj, spec, replicas=2, tp=2) == M.build_all(obj, spec, replicas=2, tp=2)
    assert obj == before


@pytest.mark.parametrize("example,tp", [("tiny-cpu", 1), ("llama-8b-gpu", 4)])
def test_pod_commands_parse_with_the_real_kvserve_cli(example, tp):
    """Every kvserve command in the pod template is accepted by `kvserve`'s own argument parser."""
    from kvserve.runtime.cli import build_parser

    obj = owner(example)
    dep = M.build_deployment(obj, parse_spec(obj["spec"]), replicas=1, tp=tp)
    parser = build_parser()
    c = _containers(dep)
    commands = [c["runtime"]["command"], c["agent"]["command"], c["fetch-model"]["command"],
                c["admin-token"]["command"],
                c["runtime"]["lifecycle"]["preStop"]["exec"]["command"],
                c["agent"]["lifecycle"]["preStop"]["exec"]["command"]]
    for command in commands:
        assert command[0] == "kvserve"
        args = parser.parse_args(command[1:])  # exits (SystemExit) on an unknown flag
        if getattr(args, "cmd", None) == "serve":
            assert args.tensor_parallel_size == tp and args.port == 8000
        if getattr(args, "agent_cmd", None) == "serve":
            assert args.port == 8081 and args.engine_url == "http://127.0.0.1:8000"
        if getattr(args, "agent_cmd", None) == "admin-token":
            assert args.out == M.ADMIN_TOKEN_FILE


def test_vllm_pods_probe_the_only_route_vllm_has():
    """vLLM has no /live or /ready and listens only once loaded: /health, with a long startup."""
    obj = owner("manual-vllm")
    assert obj["spec"]["runtime"]["engine"] == "vllm"
    runtime = _containers(M.build_deployment(obj, parse_spec(obj["spec"]), replicas=1, tp=1))["runtime"]
    probes = [runtime[p] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
    assert [p["httpGet"]["path"] for p in probes] == ["/health"] * 3
    assert probes[0]["periodSeconds"] * probes[0]["failureThreshold"] >= 30 * 60
