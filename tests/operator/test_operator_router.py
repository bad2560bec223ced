"""spec.router's objects (strictly valid Kubernetes, least privilege, disjoint selectors) and the
scale-to-zero decisions (pure, table-tested)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_operator_manifests import K8S_VERSION, owner

from kvserve.operator import manifests as M
from kvserve.operator import router as R
from kvserve.operator.autoscaler import AutoscalerState, Observation, PodSignals, decide, hold
from kvserve.operator.kube import FIELD_MANAGER
from kvserve.operator.scaletozero import (
    SCALE_TO_ZERO,
    WAKE_ON_DEMAND,
    RouterDemand,
    aggregate_demand,
    parse_demand,
    pods_busy,
    zero_decision,
)
from kvserve.operator.spec import parse_spec
from kvserve.testing import server_side_apply as ssa


def routed(min_replicas: int = 0, **router) -> tuple[dict, object]:
    obj = owner("tiny-cpu")
    obj["spec"]["router"] = {"enabled": True, **router}
    obj["spec"].setdefault("autoscaling", {})["minReplicas"] = min_replicas
    obj["spec"]["autoscaling"]["scaleToZeroAfterSeconds"] = 60
    return obj, parse_spec(obj["spec"])


def test_router_objects_validate_strictly_and_grant_only_pod_reads():
    obj, spec = routed(policy="least-load", holdTimeoutSeconds=90, replicas=2)
    objects = R.build_router_objects(obj, spec)
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Role", "RoleBinding", "Deployment"]
    for o in objects:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        assert o["metadata"]["name"] == "tiny-router"
        assert o["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    _, role, binding, dep = objects
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == "tiny-router"
    assert binding["subjects"][0]["namespace"] == obj["metadata"]["namespace"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "tiny-router" and pod["automountServiceAccountToken"] is True
    assert dep["spec"]["replicas"] == 2
    (c,) = pod["containers"]
    assert c["image"] == spec.runtime.agent_image and c["securityContext"]["readOnlyRootFilesystem"]
    # The command is one `kvserve router` accepts, and it names this service's pods.
    from kvserve.runtime.cli import build_parser
    from kvserve.runtime.router.cli import build_source, config_from_args

    args = build_parser().parse_args(c["command"][1:])
    source, config = build_source(args), config_from_args(args)
    assert (source.namespace, source.selector) == (obj["metadata"]["namespace"], M.selector_labels("tiny"))
    assert (config.policy.policy, config.hold_timeout_s, config.served_model_name) == \
        ("least-load", 90, spec.model.served_name)
    assert (source.runtime_port, source.agent_port) == (M.RUNTIME_PORT, M.AGENT_PORT)


def test_router_and_runtime_pods_never_match_each_others_selectors():
    obj, spec = routed()
    runtime = M.build_deployment(obj, spec, replicas=1, tp=1)
    router = R.build_router_deployment(obj, spec)

    def matches(selector, labels):
        return all(labels.get(k) == v for k, v in selector["matchLabels"].items())

    assert matches(runtime["spec"]["selector"], runtime["spec"]["template"]["metadata"]["labels"])
    assert matches(router["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    assert not matches(runtime["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    assert not matches(router["spec"]["selector"], runtime["spec"]["template"]["metadata"]["labels"])
    # The Service follows the router switch; the PDB always guards the runtime pods.
    assert M.build_service(obj, spec)["spec"]["selector"] == M.router_selector("tiny")
    off = parse_spec({**obj["spec"], "router": {"enabled": False}, "autoscaling": {"minReplicas": 1}})
    assert M.build_service(obj, off)["spec"]["selector"] == M.selector_labels("tiny")
    assert M.build_pdb(obj)["spec"]["selector"]["matchLabels"] == M.selector_labels("tiny")


def test_switching_the_service_selector_removes_the_other_label():
    """Applied over each other (as the test emulator models server-side apply), the selectors do
    not mix: a selector with both labels would match no pod."""
    obj, spec = routed()
    on = M.build_service(obj, spec)
    off = M.build_service(obj, parse_spec({**obj["spec"], "router": {}, "autoscaling": {"minReplicas": 1}}))
    for first, second in ((on, off), (off, on)):
        live = ssa.apply(ssa.apply(None, first, FIELD_MANAGER, force=True), second, FIELD_MANAGER, force=True)
        assert live["spec"]["selector"] == second["spec"]["selector"]


# --- scale to zero ------------------------------------------------------------------------------

IDLE = RouterDemand(routers=1, answered=1, held=0, in_flight=0, idle_seconds=61)


@pytest.mark.parametrize("replicas, demand, busy, expected", [
    (1, IDLE, False, (0, SCALE_TO_ZERO)),
    (3, IDLE, False, (0, SCALE_TO_ZERO)),
    (1, RouterDemand(1, 1, 0, 0, 59), False, None),  # not idle long enough
    (1, IDLE, True, None),  # a pod still works (a client that bypasses the router)
    (1, RouterDemand(1, 1, 0, 1, 61), False, None),  # a request is being served
    (1, RouterDemand(2, 1, 0, 0, 61), False, None),  # a router did not answer: unknown, stay up
    (1, RouterDemand(0, 0), False, None),  # no router pod ready
    (1, None, False, None),
    (0, RouterDemand(1, 1, 3, 3, 0), False, (1, WAKE_ON_DEMAND)),
    (0, RouterDemand(2, 1, 1, 1, 0), False, (1, WAKE_ON_DEMAND)),  # one router holding is enough
    (0, IDLE, False, None),  # asleep, nobody asking: stay asleep
    (0, None, False, None),
])
def test_sleep_and_wake_table(replicas, demand, busy, expected):
    _, spec = routed()
    got = zero_decision(spec, replicas, demand, busy=busy)
    assert (got.replicas, got.reason) == expected if expected else got is None


def test_a_service_stays_up_a_full_window_after_creation_or_wake():
    _, spec = routed()
    assert zero_decision(spec, 1, IDLE, busy=False, awake_seconds=30) is None
    assert zero_decision(spec, 1, IDLE, busy=False, awake_seconds=60).reason == SCALE_TO_ZERO


def test_wake_goes_to_min_replicas_and_only_services_with_a_router_sleep():
    _, spec = routed(min_replicas=2)
    assert zero_decision(spec, 0, RouterDemand(1, 1, 1, 1, 0), busy=False).replicas == 2
    assert zero_decision(spec, 2, IDLE, busy=False) is None  # minReplicas > 0 never sleeps
    obj = owner("tiny-cpu")
    assert zero_decision(parse_spec(obj["spec"]), 1, IDLE, busy=False) is None  # no router


def test_demand_answers():
    assert parse_demand({"held": 2, "in_flight": 3, "idle_seconds": 0.5, "other": "x"}) == \
        {"held": 2.0, "in_flight": 3.0, "idle_seconds": 0.5}
    for bad in (None, [], {"held": -1, "in_flight": 0, "idle_seconds": 0}, {"held": True, "in_flight": 0,
                                                                             "idle_seconds": 0}, {"held": 1}):
        assert parse_demand(bad) is None
    agg = aggregate_demand(3, [{"held": 1, "in_flight": 2, "idle_seconds": 9}, None,
                               {"held": 0, "in_flight": 0, "idle_seconds": 4}])
    assert agg == RouterDemand(routers=3, answered=2, held=1, in_flight=2, idle_seconds=4) and not agg.complete
    assert pods_busy([PodSignals("a", requests_running=1)], 10) and not pods_busy([PodSignals("a")], 10)
    assert not pods_busy([PodSignals("a", queue_depth=5, stale=True)], 10)  # unknown is not busy


@given(st.integers(1, 20), st.lists(st.floats(0, 1), max_size=6), st.integers(0, 3))
def test_the_load_alone_never_takes_a_running_service_to_zero(replicas, kv, steps):
    _, spec = routed()
    state = AutoscalerState()
    for t in range(steps + 1):
        pods = tuple(PodSignals(f"p{i}", kv_cache_utilization=k) for i, k in enumerate(kv))
        d = decide(spec, None, Observation(time=1000.0 * t, replicas=replicas, tp=1, pods=pods), state)
        assert d.replicas >= 1
        state, replicas = d.state, d.replicas
    assert hold(spec, replicas, 1)[0] >= 1 and hold(spec, 0, 1)[0] == 0  # asleep stays asleep


def test_a_sleeping_service_stays_at_zero_in_the_autoscaler():
    _, spec = routed()
    d = decide(spec, None, Observation(time=0, replicas=0, tp=1, pods=()), AutoscalerState())
    assert d.replicas == 0 and d.reason == "NoMetrics"
