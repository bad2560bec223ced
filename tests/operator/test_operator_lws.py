"""Replicas larger than one node: the LeaderWorkerSet the operator renders, checked against LWS's
real CRD schema (tests/fixtures/lws, v0.10.0), and the real operator against the API emulator
with and without that CRD loaded (objects rendered, scaled, status; a clear condition + Event
when the cluster lacks LWS).
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import pathlib

import pytest
import yaml
from test_operator_e2e import assert_operator_calls_are_documented

from kvserve.operator import crd
from kvserve.operator import desired as D
from kvserve.operator import manifests as M
from kvserve.operator import multinode as MN
from kvserve.operator import netpol as N
from kvserve.operator.handlers import OperatorConfig
from kvserve.operator.spec import SpecError, check_servable, parse_spec
from kvserve.testing.e2e_harness import Api, OperatorThread, condition, wait_for
from kvserve.testing.kube_emulator import EmulatorThread, PatchedEmulator

LWS_CRD = pathlib.Path(__file__).parent.parent / "fixtures" / "lws" / "leaderworkersets.v0.10.0.crd.yaml.gz"
CONFIG = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 8,
          "num_key_value_heads": 8, "intermediate_size": 128, "vocab_size": 256}
OWNER = {"apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "big", "namespace": "default", "uid": "u-1"}}


@functools.cache
def lws_crd() -> dict:
    return yaml.safe_load(gzip.decompress(LWS_CRD.read_bytes()))


def big_spec(**over) -> dict:
    spec = {"model": {"uri": "hf://org/big", "config": CONFIG},
            "gpu": {"perShard": 1, "gpusPerNode": 8},
            "parallelism": {"pipeline": 2, "tensor": {"min": 8, "max": 8, "initial": 8},
                            "rendezvousKeySecret": {"name": "big-rendezvous"}},
            "autoscaling": {"enabled": False}, "replicas": 2}
    for key, value in over.items():
        spec[key] = value
    return spec


def parsed(raw: dict):
    obj = crd.apply_defaults({"apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService",
                              "metadata": {"name": "big"}, "spec": raw}, crd.openapi_schema())
    return parse_spec(obj["spec"])


def test_rendered_leaderworkerset_validates_against_the_real_crd_and_keeps_the_pod_hardening():
    spec = parsed(big_spec())
    lws = MN.build_workload(OWNER, spec, replicas=2, tp=8)
    assert lws["kind"] == "LeaderWorkerSet" and lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    # Strict: a misspelled or unknown field anywhere (pod templates included) is an error.
    assert crd.validate(lws, crd=lws_crd(), version="v1", cel=False) == []
    typo = copy.deepcopy(lws)
    typo["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["comand"] = ["x"]
    assert crd.validate(typo, crd=lws_crd(), version="v1", cel=False)
    group = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["replicas"] == 2 and group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    deployment_pod = M.pod_template("big", spec, 8)
    for template in (leader, worker):
        pod = template["spec"]
        # The same hardening as a Deployment's pod, and the same fetch step.
        assert pod["securityContext"] == deployment_pod["spec"]["securityContext"]
        assert pod["automountServiceAccountToken"] is False
        assert [c["name"] for c in pod["initContainers"]][-1] == "fetch-model"
        runtime = pod["containers"][0]
        assert runtime["securityContext"] == deployment_pod["spec"]["containers"][0]["securityContext"]
        assert runtime["resources"]["limits"]["nvidia.com/gpu"] == "8"  # one node's share of 16
        env = {e["name"]: e for e in runtime["env"]}
        assert env["KVSERVE_RENDEZVOUS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "big-rendezvous", "key": "key"}
        assert M.selector_labels("big").items() <= template["metadata"]["labels"].items()
    assert leader["metadata"]["annotations"][M.HASH_ANNOTATION] == worker["metadata"]["annotations"][M.HASH_ANNOTATION]
    lead = leader["spec"]["containers"]
    assert [c["name"] for c in lead] == ["runtime", "agent"]
    cmd = lead[0]["command"]
    assert cmd[:2] == ["kvserve", "serve"] and cmd[cmd.index("--pipeline-parallel-size") + 1] == "2"
    assert {"startupProbe", "livenessProbe", "readinessProbe", "lifecycle"} <= set(lead[0])
    (work,) = worker["spec"]["containers"]
    assert work["command"] == ["kvserve", "worker", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2"]
    assert "livenessProbe" not in work and "ports" not in work
    assert worker["metadata"]["labels"][MN.ROLE_LABEL] == "worker"
    assert leader["metadata"]["labels"][MN.ROLE_LABEL] == "leader"
    # The Service reaches leaders only; the group's pods reach each other on every port.
    service = M.build_service(OWNER, spec)
    assert service["spec"]["selector"][MN.ROLE_LABEL] == "leader"
    (policy,) = N.build_network_policies(OWNER, spec)
    assert {"from": [{"podSelector": {"matchLabels": M.selector_labels("big")}}]} in policy["spec"]["ingress"]
    kinds = [o["kind"] for o in D.owned_objects(OWNER, spec, replicas=2, tp=8)]
    assert "LeaderWorkerSet" in kinds and "Deployment" not in kinds


def test_only_a_leaderworkerset_leaves_its_size_to_the_scale_subresource():
    lws_spec = parsed(big_spec())
    lws = MN.build_workload(OWNER, lws_spec, replicas=3, tp=8)
    body = MN.applied_body(lws)
    assert MN.scaled_through_subresource(lws) and "replicas" not in body["spec"]
    assert lws["spec"]["replicas"] == 3  # the rendering keeps it: the digest and _runs compare it
    assert {k: v for k, v in lws["spec"].items() if k != "replicas"} == body["spec"]
    dep = MN.build_workload(OWNER, parsed(big_spec(gpu={"perShard": 1, "gpusPerNode": 8},
                                                   parallelism={"tensor": {"min": 4, "max": 4, "initial": 4}})),
                            replicas=3, tp=4)
    assert not MN.scaled_through_subresource(dep) and MN.applied_body(dep) == dep


@pytest.mark.parametrize("kind, replicas", [("LeaderWorkerSet", 0), ("LeaderWorkerSet", 3), ("Deployment", 0),
                                            ("Deployment", 2)])
def test_a_workload_is_created_at_its_size(kind, replicas):
    """The creating apply carries spec.replicas for every workload (a LeaderWorkerSet created
    without it would run LWS's default of 1 group, even for a service scaled to zero); a
    LeaderWorkerSet then hands the field to SIZE_MANAGER, whose apply holds it alone."""
    if kind == "LeaderWorkerSet":
        obj = MN.build_workload(OWNER, parsed(big_spec()), replicas=replicas, tp=8)
    else:
        obj = MN.build_workload(OWNER, parsed(big_spec(gpu={"perShard": 1, "gpusPerNode": 8},
                                                       parallelism={"tensor": {"min": 4, "max": 4, "initial": 4}})),
                                replicas=replicas, tp=4)
    assert obj["kind"] == kind
    assert MN.created_body(obj)["spec"]["replicas"] == replicas
    handover = MN.size_handover(obj)
    if kind == "LeaderWorkerSet":
        assert "replicas" not in MN.applied_body(obj)["spec"]
        assert handover == {"apiVersion": MN.LWS_API_VERSION, "kind": kind, "spec": {"replicas": replicas},
                            "metadata": {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]}}
    else:
        assert handover is None and MN.applied_body(obj)["spec"]["replicas"] == replicas


def test_a_replica_that_fits_a_node_stays_a_deployment_with_its_stages():
    spec = parsed(big_spec(gpu={"perShard": 1, "gpusPerNode": 8},
                           parallelism={"pipeline": 2, "tensor": {"min": 4, "max": 4, "initial": 4}}))
    dep = MN.build_workload(OWNER, spec, replicas=1, tp=4)
    assert dep["kind"] == "Deployment"
    runtime = dep["spec"]["template"]["spec"]["containers"][0]
    assert runtime["command"][runtime["command"].index("--pipeline-parallel-size") + 1] == "2"
    assert runtime["resources"]["limits"]["nvidia.com/gpu"] == "8"
    # Without gpusPerNode nothing changes for existing services: no role label, same Service.
    plain = parsed(big_spec(gpu={"perShard": 1}, parallelism={"tensor": {"min": 1, "max": 1}}))
    assert MN.ROLE_LABEL not in M.pod_template("big", plain, 1)["metadata"]["labels"]
    assert MN.ROLE_LABEL not in M.build_service(OWNER, plain)["spec"]["selector"]


@pytest.mark.parametrize("over, field", [
    (dict(parallelism={"pipeline": 2, "tensor": {"min": 8, "max": 8, "initial": 8}}),
     "spec.parallelism.rendezvousKeySecret"),
    (dict(gpu={"perShard": 1, "gpusPerNode": 6}), "spec.gpu.gpusPerNode"),
    (dict(autoscaling={"enabled": True, "tensorParallel": {"enabled": True}}, replicas=None),
     "spec.autoscaling.tensorParallel.enabled"),
])
def test_bad_multinode_specs_name_the_field(over, field):
    raw = big_spec(**over)
    if raw.get("replicas") is None:
        raw.pop("replicas")
    with pytest.raises(SpecError) as info:
        parsed(raw)
    assert info.value.field == field


def test_more_stages_than_layers_is_refused():
    spec = parsed(big_spec(parallelism={"pipeline": 8, "tensor": {"min": 2, "max": 2, "initial": 2},
                                        "rendezvousKeySecret": {"name": "k"}}))
    from kvserve.runtime.capacity import ModelShape

    with pytest.raises(SpecError, match="8 exceeds the model's 4 layers"):
        check_servable(spec, ModelShape.from_hf_config(CONFIG))


# -- the real operator against the emulator ------------------------------------------------------

BIG = {"apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService",
       "metadata": {"name": "big", "namespace": "default"}, "spec": big_spec(replicas=1)}


def _lws_resource():
    import kmock

    return kmock.ResourceInfo(kind="LeaderWorkerSet", singular="leaderworkerset", namespaced=True,
                              verbs={"get", "list", "watch", "create", "patch", "delete"},
                              subresources={"status", "scale"})


LWS_PATH = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets/big"
SCALE = LWS_PATH + "/scale"


def scale_patches(emulator) -> int:
    """PATCHes the operator sent to the LeaderWorkerSet's scale subresource."""
    return sum(1 for r in list(emulator.emulator)
               if r.resource is not None and r.resource.plural == "leaderworkersets" and r.subresource == "scale"
               and r.method == "PATCH" and (r.headers or {}).get("User-Agent", "").startswith("kvserve-operator"))


def _leader_pod(lws: dict, group: int) -> dict:
    template = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    meta = template["metadata"]
    meta["labels"][MN.WORKER_INDEX_LABEL] = "0"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"big-{group}", "namespace": "default", "labels": meta["labels"],
                         "annotations": meta["annotations"]},
            "spec": template["spec"],
            "status": {"phase": "Running", "podIP": f"127.0.0.{10 + group}",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def test_operator_renders_scales_and_reports_a_leaderworkerset_and_names_a_missing_crd():
    import kopf

    PatchedEmulator.UNSERVED_GROUPS.add("leaderworkerset.x-k8s.io")
    emulator = EmulatorThread().start()
    api = Api(emulator.url)
    config = OperatorConfig(scrape_interval=0.3, scrape_timeout=1.0, agent_port=1, max_sample_age=3.0,
                            connection=kopf.ConnectionInfo(server=emulator.url))
    op = OperatorThread(emulator.url, config).start()
    try:
        obj = crd.apply_defaults(copy.deepcopy(BIG), crd.openapi_schema())
        assert crd.validate(obj) == []
        api.apply_isvc(obj)
        # No LWS CRD in this cluster: a Degraded condition and a Warning say so.
        isvc = wait_for(lambda: (o := api.get_isvc("big")) and condition(o, "Degraded").get("status") == "True"
                        and o, what="Degraded")
        assert condition(isvc, "Degraded")["reason"] == "LeaderWorkerSetMissing"
        assert "LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1) is not installed" in condition(isvc, "Degraded")[
            "message"]
        assert any(e["reason"] == "LeaderWorkerSetMissing" for e in api.events())
        assert api.get("Deployment", "big") is None

        # The CRD is installed: the next retry renders it, valid against the real schema.
        emulator.emulator.resources["leaderworkerset.x-k8s.io/v1/leaderworkersets"] = _lws_resource()
        PatchedEmulator.UNSERVED_GROUPS.discard("leaderworkerset.x-k8s.io")
        # Created at its size (no moment at LWS's default of 1 group), then the size handed to a
        # second field manager, so the operator's later applies (which leave it out) keep it.
        lws = wait_for(lambda: (o := api.get("LeaderWorkerSet", "big")) and any(
            f.get("manager") == MN.SIZE_MANAGER for f in o["metadata"].get("managedFields") or []) and o,
            timeout=60, what="LeaderWorkerSet created and its size handed over")
        (create, *_) = [r for r in list(emulator.emulator) if r.resource is not None
                        and r.resource.plural == "leaderworkersets" and r.method == "PATCH" and r.subresource is None]
        assert create.data["spec"]["replicas"] == 1, "the creating apply carries the size"
        assert scale_patches(emulator) == 0  # nothing to correct
        stored = {k: lws[k] for k in ("apiVersion", "kind", "spec")}
        stored["metadata"] = {"name": "big", "namespace": "default"}
        assert crd.validate(stored, crd=lws_crd(), version="v1", cel=False) == []
        assert lws["spec"]["replicas"] == 1 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        (ref,) = lws["metadata"]["ownerReferences"]
        assert ref["kind"] == "InferenceService"

        assert api.call("GET", SCALE)["spec"]["replicas"] == 1

        # Scaled: two groups, set through the scale subresource, never by the applied body (its
        # field manager owns no spec.replicas, so a template change cannot reset the size).
        api.patch_spec("big", {"replicas": 2})
        wait_for(lambda: api.call("GET", SCALE)["spec"]["replicas"] == 2, what="2 groups through /scale")
        lws = api.get("LeaderWorkerSet", "big")
        assert lws["spec"]["replicas"] == 2
        assert scale_patches(emulator) >= 1
        owners = {f["manager"]: json.dumps(f.get("fieldsV1", {})) for f in lws["metadata"]["managedFields"]
                  if f.get("operation") == "Apply"}
        assert "f:replicas" not in owners["kvserve-operator"] and "f:replicas" in owners[MN.SIZE_MANAGER]
        # The LWS controller's view of the groups reads back through the same Scale.
        api.call("PATCH", LWS_PATH + "/status", {"status": {"replicas": 2, "hpaPodSelector": "x=y"}},
                 content_type="application/merge-patch+json")
        scale = api.call("GET", SCALE)
        assert scale["kind"] == "Scale" and scale["status"] == {"replicas": 2, "selector": "x=y"}
        # `kubectl scale` behind the operator's back: it is the one writer, the size comes back.
        api.call("PATCH", SCALE, {"spec": {"replicas": 5}}, content_type="application/merge-patch+json")
        wait_for(lambda: api.call("GET", SCALE)["spec"]["replicas"] == 2, timeout=30, what="size put back")
        lws = api.get("LeaderWorkerSet", "big")
        # Status counts groups by their leaders (what LWS's controller would create).
        for group in range(2):
            api.call("POST", "/api/v1/namespaces/default/pods", _leader_pod(lws, group))
        worker = _leader_pod(lws, 0)
        worker["metadata"].update(name="big-0-1", labels={**worker["metadata"]["labels"], MN.ROLE_LABEL: "worker"})
        api.call("POST", "/api/v1/namespaces/default/pods", worker)
        isvc = wait_for(lambda: (o := api.get_isvc("big")) and (o.get("status") or {}).get("readyReplicas") == 2
                        and o, timeout=30, what="2 ready replicas")
        assert condition(isvc, "Degraded")["status"] == "False"

        api.delete_isvc("big")
        wait_for(lambda: api.get("LeaderWorkerSet", "big") is None, what="LeaderWorkerSet deleted")
    finally:
        PatchedEmulator.UNSERVED_GROUPS.discard("leaderworkerset.x-k8s.io")
        op.stop()
        emulator.stop()
    assert op.error is None
    assert_operator_calls_are_documented(emulator)


def test_the_multinode_example_renders_a_valid_leaderworkerset():
    path = pathlib.Path(__file__).parents[2] / "crds" / "examples" / "multinode-lws.yaml"
    obj = yaml.safe_load(path.read_text())
    assert crd.validate(obj) == []
    obj = crd.apply_defaults(obj, crd.openapi_schema())
    spec = parse_spec(obj["spec"])
    (lws,) = [o for o in D.owned_objects(obj | {"metadata": {**obj["metadata"], "uid": "u"}}, spec, replicas=1, tp=8)
              if o["kind"] == "LeaderWorkerSet"]
    assert crd.validate(lws, crd=lws_crd(), version="v1", cel=False) == []
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
