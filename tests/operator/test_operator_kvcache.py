"""spec.runtime.kvOffload and the KV events wiring (operator/kvcache.py): the CRD and the parser
agree on what is valid, the pod template gets the tier's flags, volume and memory, and with the
router's prefix policy the pods publish KV events that the router follows and only the router
may reach (NetworkPolicy, evaluated with tests/operator/netpol_eval.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from netpol_eval import Pod, allowed

from kvserve.operator import crd
from kvserve.operator import kvcache as K
from kvserve.operator import manifests as M
from kvserve.operator import netpol as N
from kvserve.operator import router as R
from kvserve.operator.spec import SpecError, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "crds" / "examples"
UID = "0b5e2a1c-1111-4222-8333-944455556666"


def owner(name: str = "tiny-cpu", **runtime_or_router) -> dict:
    obj = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    obj["metadata"]["uid"] = UID
    obj["metadata"].setdefault("namespace", "default")
    for key, value in runtime_or_router.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **value}
    return obj


def runtime_container(obj: dict, tp: int = 1) -> tuple[dict, dict]:
    spec = parse_spec(crd.apply_defaults(obj, crd.openapi_schema())["spec"])
    template = M.build_deployment(obj, spec, replicas=1, tp=tp)["spec"]["template"]
    return next(c for c in template["spec"]["containers"] if c["name"] == "runtime"), template


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


@pytest.mark.parametrize("kv_offload, error", [
    ({"size": "8Gi", "medium": "pvc"}, "claimName"),
    ({"size": "8Gi", "medium": "emptyDir", "claimName": "c"}, "claimName"),
    ({"medium": "memory"}, "size"),
    ({"size": "100Ki"}, "size"),
    ({"size": "8Gi", "medium": "tape"}, "medium"),
    # A claim the operator creates: a StorageClass and a size, not with an existing claim.
    ({"size": "8Gi", "medium": "pvc", "claimName": "c", "storageClassName": "nfs"}, "storageClassName"),
    ({"size": "8Gi", "medium": "pvc", "claimName": "c", "claimSize": "100Gi"}, "claimSize"),
    ({"size": "8Gi", "medium": "emptyDir", "storageClassName": "nfs"}, "storageClassName"),
    ({"size": "8Gi", "medium": "pvc", "claimName": "c", "accessMode": "ReadWriteOnce"}, "accessMode"),
    ({"size": "8Gi", "medium": "pvc", "storageClassName": "nfs", "claimSize": "100Gi", "accessMode": "All"},
     "accessMode"),
])
def test_bad_kv_offload_is_refused_by_crd_and_parser_naming_the_field(kv_offload, error):
    obj = owner(runtime={"kvOffload": kv_offload})
    with pytest.raises(SpecError, match=f"spec.runtime.kvOffload(.{error})?"):
        parse_spec(obj["spec"])
    if error != "size" or "size" not in kv_offload:  # 100Ki passes the schema (a quantity), not the parser
        assert crd.validate(obj), "the CRD let it through"


def test_a_claim_smaller_than_the_tier_or_not_a_storage_class_name_is_refused():
    for kv, error in [({"claimSize": "4Gi"}, "claimSize"), ({"storageClassName": "NFS_rwx"}, "storageClassName")]:
        obj = owner(runtime={"kvOffload": {"size": "8Gi", "medium": "pvc", "storageClassName": "nfs",
                                           "claimSize": "100Gi", **kv}})
        with pytest.raises(SpecError, match=f"spec.runtime.kvOffload.{error}"):
            parse_spec(obj["spec"])


@pytest.mark.parametrize("spec_extra, pods, ranks", [
    ({"replicas": 3, "autoscaling": {"enabled": False}}, 3, 1),
    ({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 5}}, 5, 1),
    ({"replicas": 1, "autoscaling": {"enabled": False}, "parallelism": {"tensor": {"min": 1, "max": 4}}}, 1, 4),
])
def test_claim_size_defaults_to_every_pods_tier_at_the_largest_size_and_never_shrinks(spec_extra, pods, ranks):
    obj = owner(runtime={"kvOffload": {"size": "8Gi", "medium": "pvc", "storageClassName": "nfs"}})
    obj["spec"].update(spec_extra)
    assert crd.validate(obj) == []
    spec = parse_spec(crd.apply_defaults(obj, crd.openapi_schema())["spec"])
    tier = 8 * 1024**3 * ranks
    want = pods * (tier + tier // 16 + ranks * 64 * 1024**2)
    got = K.default_claim_bytes(spec)
    assert want <= got < want + 1024**3 and got % 1024**3 == 0
    claim = K.build_claim(obj, spec)
    assert claim["spec"]["resources"]["requests"]["storage"] == str(got)
    # A live claim grown past the default (maxReplicas was higher once) is not asked to shrink;
    # one smaller is grown; a claimSize given is rendered as given.
    bigger = {"spec": {"resources": {"requests": {"storage": "4Ti"}}}}
    assert K.not_shrunk(claim, bigger, spec)["spec"]["resources"]["requests"]["storage"] == str(4 * 1024**4)
    assert K.not_shrunk(claim, {"spec": {"resources": {"requests": {"storage": "1Gi"}}}}, spec) == claim
    assert K.not_shrunk(claim, None, spec) == claim
    obj["spec"]["runtime"]["kvOffload"]["claimSize"] = "100Gi"
    given = parse_spec(crd.apply_defaults(obj, crd.openapi_schema())["spec"])
    assert K.not_shrunk(K.build_claim(obj, given), bigger, given)["spec"]["resources"]["requests"]["storage"] \
        == str(100 * 1024**3)


def _claim(phase=None, age_s=0.0, storage_class="nfs"):
    import datetime as dt

    created = (dt.datetime(2026, 1, 1, tzinfo=dt.UTC) - dt.timedelta(seconds=age_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"creationTimestamp": created},
            "spec": {"storageClassName": storage_class, "accessModes": ["ReadWriteMany"]},
            "status": {"phase": phase} if phase else {}}


@pytest.mark.parametrize("kv, live, want", [
    ({"medium": "emptyDir"}, None, None),  # no claim: no condition
    ({"medium": "pvc", "storageClassName": "nfs"}, _claim("Bound"), (True, "Bound", False)),
    # Just created: Pending (a WaitForFirstConsumer class binds with the first pod), no Warning yet.
    ({"medium": "pvc", "storageClassName": "nfs"}, _claim(None, 5), (False, "ClaimPending", False)),
    ({"medium": "pvc", "storageClassName": "nfs"}, _claim("Pending", 600), (False, "ClaimPending", True)),
    ({"medium": "pvc", "storageClassName": "nfs"}, _claim("Lost", 5), (False, "ClaimLost", True)),
    ({"medium": "pvc", "claimName": "mine"}, None, (False, "ClaimNotFound", True)),
    ({"medium": "pvc", "claimName": "mine"}, _claim("Bound"), (True, "Bound", False)),
])
def test_the_claim_condition_says_whether_the_tiers_claim_is_bound(kv, live, want):
    import datetime as dt

    spec = parse_spec(owner(runtime={"kvOffload": {"size": "8Gi", **kv}})["spec"])
    got = K.claim_condition(spec, "tiny", live, dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    assert (None if got is None else (got[0], got[1], got[3])) == want
    if got is not None and not got[0]:
        assert ("tiny-kv-offload" if "storageClassName" in kv else "mine") in got[2]


@pytest.mark.parametrize("extra, access", [({}, "ReadWriteMany"), ({"accessMode": "ReadWriteOnce"}, "ReadWriteOnce")])
def test_a_storage_class_makes_the_operator_create_an_owned_claim_the_pods_mount(extra, access):
    from kvserve.operator import desired as D

    kv = {"size": "8Gi", "medium": "pvc", "storageClassName": "fast.nfs", "claimSize": "200Gi", **extra}
    obj = owner(runtime={"kvOffload": kv})
    assert crd.validate(obj) == []
    spec = parse_spec(crd.apply_defaults(obj, crd.openapi_schema())["spec"])
    objects = D.owned_objects(obj, spec, replicas=2, tp=1)
    kinds = [o["kind"] for o in objects]
    assert kinds.index("PersistentVolumeClaim") < kinds.index("Deployment")  # the pods mount it
    claim = objects[kinds.index("PersistentVolumeClaim")]
    assert claim["metadata"]["name"] == K.claim_name("tiny") == "tiny-kv-offload"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == UID
    assert claim["spec"] == {"accessModes": [access], "storageClassName": "fast.nfs",
                             "resources": {"requests": {"storage": str(200 * 1024**3)}}}
    runtime, template = runtime_container(obj)
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes[K.OFFLOAD_VOLUME]["persistentVolumeClaim"] == {"claimName": "tiny-kv-offload"}
    assert flag(runtime["command"], "--kv-offload-dir") == K.OFFLOAD_DIR
    # Never among what the operator cleans up: turning the tier off keeps the prefixes.
    assert ("PersistentVolumeClaim", "tiny-kv-offload") not in D.possible_objects("tiny")
    # An existing claim: mounted, nothing created.
    obj = owner(runtime={"kvOffload": {"size": "8Gi", "medium": "pvc", "claimName": "mine"}})
    spec = parse_spec(crd.apply_defaults(obj, crd.openapi_schema())["spec"])
    assert "PersistentVolumeClaim" not in [o["kind"] for o in D.owned_objects(obj, spec, replicas=1, tp=1)]


def test_kv_offload_is_kvserves_only():
    obj = owner(runtime={"kvOffload": {"size": "1Gi"}, "engine": "vllm"})
    with pytest.raises(SpecError, match="spec.runtime.kvOffload"):
        parse_spec(obj["spec"])


@pytest.mark.parametrize("medium, volume, args_dir", [
    # 2 ranks x 8Gi, plus 1/16 of it and 64Mi per rank for headers, block rounding and the file in flight
    ("emptyDir", {"emptyDir": {"sizeLimit": str(2 * 8 * 1024**3 + 1024**3 + 2 * 64 * 1024**2)}}, K.OFFLOAD_DIR),
    ("pvc", {"persistentVolumeClaim": {"claimName": "kv-cache"}}, K.OFFLOAD_DIR),
    ("memory", None, None),
])
def test_offload_tier_in_the_pod_template(medium, volume, args_dir):
    kv = {"size": "8Gi", "medium": medium, **({"claimName": "kv-cache"} if medium == "pvc" else {})}
    obj = owner(runtime={"kvOffload": kv, "resources": {"requests": {"memory": "4Gi"}, "limits": {"memory": "6Gi"}}})
    assert crd.validate(obj) == []
    runtime, template = runtime_container(obj, tp=2)
    assert flag(runtime["command"], "--kv-offload-bytes") == str(8 * 1024**3)  # per rank, as the runtime takes it
    assert flag(runtime["command"], "--kv-offload-dir") == args_dir
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in runtime["volumeMounts"]}
    memory = runtime["resources"]
    if volume is None:
        assert K.OFFLOAD_VOLUME not in volumes and K.OFFLOAD_VOLUME not in mounts
        # Host memory for 2 ranks x 8Gi on top of what the spec asked for.
        assert memory["requests"]["memory"] == str(4 * 1024**3 + 16 * 1024**3)
        assert memory["limits"]["memory"] == str(6 * 1024**3 + 16 * 1024**3)
    else:
        assert {k: v for k, v in volumes[K.OFFLOAD_VOLUME].items() if k != "name"} == volume
        assert mounts[K.OFFLOAD_VOLUME] == K.OFFLOAD_DIR
        assert memory["requests"]["memory"] == "4Gi"


def test_no_tier_no_change():
    runtime, template = runtime_container(owner())
    assert "--kv-offload-bytes" not in runtime["command"]
    assert K.OFFLOAD_VOLUME not in {v["name"] for v in template["spec"]["volumes"]}


def _render(obj: dict) -> tuple[dict, dict, list[dict]]:
    spec = parse_spec(crd.apply_defaults(obj, crd.openapi_schema())["spec"])
    runtime, template = runtime_container(obj)
    router = R.build_router_deployment(obj, spec)["spec"]["template"]["spec"]["containers"][0]
    return runtime, template, router, N.build_network_policies(obj, spec)


def test_router_prefix_policy_wires_kv_events_end_to_end():
    obj = owner(router={"enabled": True})
    runtime, template, router, policies = _render(obj)
    config = json.loads(flag(runtime["command"], "--kv-events-config"))
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558"}
    from kvserve.runtime.kv_events import KVEventsConfig

    assert KVEventsConfig.parse(config).active  # what the runtime accepts
    assert {p["name"]: p["containerPort"] for p in runtime["ports"]} == {"http": M.RUNTIME_PORT, "kv-events": 5557,
                                                                         "kv-replay": 5558}
    assert template["metadata"]["annotations"][K.EVENTS_PORT_ANNOTATION] == "5557"
    assert flag(router["command"], "--kv-events-port") == "5557"
    # The router's own parser takes the operator's command.
    from kvserve.runtime.cli import build_parser
    from kvserve.runtime.router.cli import kv_index_config

    args = build_parser().parse_args(router["command"][1:])
    assert args.kv_events_port == 5557 and kv_index_config(args) is not None
    # Only the router reaches the events ports; a client of the namespace does not.
    ns = obj["metadata"]["namespace"]
    pod = Pod(ns, M.labels(obj["metadata"]["name"]))
    router_pod = Pod(ns, R.router_labels(obj["metadata"]["name"]))
    client = Pod(ns, {"app": "client"})
    for port in (5557, 5558):
        assert allowed(policies, router_pod, pod, port) and not allowed(policies, client, pod, port)
    assert allowed(policies, client, router_pod, R.ROUTER_PORT)


@pytest.mark.parametrize("change", [
    {"router": {"enabled": True, "kvEvents": False}},
    {"router": {"enabled": True, "policy": "round-robin"}},
    {"router": {"enabled": True}, "runtime": {"enablePrefixCaching": False}},
    {"router": {"enabled": False}},
])
def test_no_events_without_a_router_that_uses_them(change):
    obj = copy.deepcopy(owner(**change))
    assert crd.validate(obj) == []
    runtime, template, router, policies = _render(obj)
    assert "--kv-events-config" not in runtime["command"] and "--kv-events-port" not in router["command"]
    assert K.EVENTS_PORT_ANNOTATION not in template["metadata"]["annotations"]
    assert all(rule["ports"][0]["port"] not in (5557, 5558) for p in policies for rule in p["spec"]["ingress"])


def test_plan_counts_the_tier_in_blocks_next_to_the_pool():
    from kvserve.operator.spec import model_shape

    obj = owner("llama-8b-gpu", runtime={"kvOffload": {"size": "16Gi", "medium": "memory"}})
    spec = parse_spec(crd.apply_defaults(obj, crd.openapi_schema())["spec"])
    shape = model_shape(spec)
    got = K.offload_plan(spec, shape, tp=2)
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes = 128 KiB per token, half per rank at TP 2.
    per_token = 32 * 8 * 128 * 2 * 2 // 2
    assert got["blocksPerRank"] == 16 * 1024**3 // (per_token * 16) and got["tokensPerRank"] == got["blocksPerRank"] * 16
    assert got["bytesPerPod"] == got["podMemoryRequestAdded"] == 2 * 16 * 1024**3 and got["poolTokensPerRank"] > 0
    assert K.offload_plan(parse_spec(owner()["spec"]), shape, 1) is None
