"""Small pure pieces of the shell: what applying changes, conditions, signal parsing."""

from __future__ import annotations

import datetime as dt

from kvserve.operator.autoscaler import AutoscalerState, Decision, PodSignals, Signals
from kvserve.operator.kube import FIELD_MANAGER, owned_by
from kvserve.operator.sources import PrometheusSource, signals_from_prometheus
from kvserve.operator.status import (
    append_decision,
    decision_record,
    merge_conditions,
    rollout_conditions,
    scaling_conditions,
)
from kvserve.testing import server_side_apply as ssa

T0 = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.UTC)


def test_apply_changes_only_the_operators_fields_and_keeps_others():
    """What the API server does with the operator's apply (as the test emulator models it)."""
    desired = {"metadata": {"labels": {"a": "1"}, "annotations": {"x": "1"}},
               "spec": {"replicas": 3, "template": {"spec": {"containers": [{"name": "c", "image": "i:2"}]}}}}
    live = ssa.apply(None, {**desired, "spec": {**desired["spec"], "template": {"spec": {"containers": [
        {"name": "c", "image": "i:1"}]}}}}, FIELD_MANAGER, force=True)
    # Others' fields: a label, `kubectl rollout restart`'s annotation, a field the operator never sets.
    live = ssa.apply(live, {"metadata": {"labels": {"team": "ml"}, "annotations": {"kubectl/restartedAt": "t"}},
                            "spec": {"paused": False}}, "kubectl", force=True)
    out = ssa.apply(live, desired, FIELD_MANAGER, force=True)
    assert out["spec"] == {"replicas": 3, "paused": False,
                           "template": {"spec": {"containers": [{"name": "c", "image": "i:2"}]}}}
    assert out["metadata"]["labels"] == {"a": "1", "team": "ml"}
    assert out["metadata"]["annotations"] == {"x": "1", "kubectl/restartedAt": "t"}
    assert ssa.apply(out, desired, FIELD_MANAGER, force=True) == out  # nothing to change


def test_owned_by_needs_the_controller_reference():
    obj = {"metadata": {"ownerReferences": [{"uid": "u1", "controller": True}]}}
    assert owned_by(obj, "u1") and not owned_by(obj, "u2")
    assert not owned_by({"metadata": {"ownerReferences": [{"uid": "u1"}]}}, "u1")


def test_conditions_keep_transition_time_until_status_flips():
    first = merge_conditions([], rollout_conditions(desired=2, ready=1, rollout_in_progress=False, generation=1), T0)
    ready = {c["type"]: c for c in first}["Ready"]
    assert ready["status"] == "True" and ready["reason"] == "Available"
    later = T0 + dt.timedelta(minutes=5)
    second = merge_conditions(first, rollout_conditions(desired=2, ready=2, rollout_in_progress=False,
                                                        generation=2), later)
    by = {c["type"]: c for c in second}
    assert by["Ready"]["lastTransitionTime"] == "2026-11-22T12:00:00Z"  # stayed True
    assert by["Ready"]["observedGeneration"] == 2 and by["Ready"]["reason"] == "AllReplicasReady"
    assert by["Progressing"]["status"] == "False"
    assert by["Progressing"]["lastTransitionTime"] == "2026-11-22T12:05:00Z"  # flipped
    assert [c["type"] for c in second] == ["Ready", "Progressing", "Degraded"]


def _decision(**kw):
    base = dict(replicas=3, tp=1, reason="ScaleUp", message="m", signals=Signals(2, 0.8, 7, 9),
                state=AutoscalerState(), from_replicas=2, from_tp=1)
    return Decision(**{**base, **kw})


def test_scaling_conditions_and_decision_history():
    conds = {c["type"]: c for c in scaling_conditions(_decision(limited="TooManyReplicas", limited_message="x"),
                                                      enabled=True, generation=3)}
    assert conds["ScalingActive"]["status"] == "True" and conds["ScalingLimited"]["reason"] == "TooManyReplicas"
    off = {c["type"]: c for c in scaling_conditions(None, enabled=False, generation=3)}
    assert off["ScalingActive"]["reason"] == "AutoscalingDisabled"
    history = []
    for i in range(8):
        history = append_decision(history, decision_record(_decision(replicas=i), T0))
    assert len(history) == 5 and history[-1]["toReplicas"] == 7
    assert history[-1]["signals"] == {"pods": 2, "kvCacheUtilization": 0.8, "queueDepth": 7, "requestsRunning": 9}


def test_agent_json_with_nulls_is_safe():
    p = PodSignals.from_json("p", {"ready": True, "stale": True, "kv_cache_utilization": None,
                                   "queue_depth": None, "tensor_parallel_size": None})
    assert p.stale and p.kv_cache_utilization == 0.0 and p.tensor_parallel_size is None
    p = PodSignals.from_json("p", {"kv_cache_utilization": 1.7, "queue_depth": -2, "tensor_parallel_size": 2})
    assert p.kv_cache_utilization == 1.0 and p.queue_depth == 0.0 and p.tensor_parallel_size == 2


def _pod(name, ready=True):
    return {"metadata": {"name": name}, "status": {"phase": "Running", "podIP": "10.0.0.1",
                                                   "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_prometheus_vector_to_pod_signals():
    result = [
        {"metric": {"__name__": "kvserve_kv_cache_utilization", "pod": "a"}, "value": [1, "0.8"]},
        {"metric": {"__name__": "kvserve_queue_depth", "pod": "a"}, "value": [1, "3"]},
        {"metric": {"__name__": "kvserve_tensor_parallel_size", "pod": "a"}, "value": [1, "2"]},
        {"metric": {"__name__": "kvserve_engine_up", "pod": "a"}, "value": [1, "1"]},
        {"metric": {"__name__": "kvserve_kv_cache_utilization", "pod": "b"}, "value": [1, "0.1"]},
        {"metric": {"__name__": "kvserve_engine_up", "pod": "b"}, "value": [1, "0"]},
    ]
    a, b, c, d = signals_from_prometheus(result, [_pod("a"), _pod("b"), _pod("c"), _pod("d", ready=False)])
    assert (a.kv_cache_utilization, a.queue_depth, a.tensor_parallel_size, a.stale) == (0.8, 3.0, 2, False)
    assert b.stale  # engine down: its numbers must not drive anything
    assert c.stale and c.ready  # no series
    assert not d.ready
    query = PrometheusSource.query("ns", [_pod("a.b")])
    assert 'namespace="ns"' in query and 'pod=~"a\\\\.b"' in query and "kvserve_queue_depth" in query


async def test_agent_source_timeouts_errors_and_bounded_concurrency():
    """Ready pods are scraped at most `concurrency` at a time; failures are stale, never zeros."""
    import asyncio

    from aiohttp import web

    from kvserve.operator.sources import AgentSource
    from kvserve.testing.e2e_harness import free_port_on_all

    in_flight, peak = 0, 0

    async def signals(request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            host = request.host.split(":")[0]
            if host == "127.0.0.61":
                return web.Response(status=500)
            if host == "127.0.0.62":
                await asyncio.sleep(3.0)  # past the timeout
            await asyncio.sleep(0.2)
            return web.json_response({"ready": True, "stale": False, "kv_cache_utilization": 0.5,
                                      "queue_depth": 1, "tensor_parallel_size": 1})
        finally:
            in_flight -= 1

    hosts = [f"127.0.0.{i}" for i in range(60, 68)]
    port = free_port_on_all(hosts)
    app = web.Application()
    app.router.add_get("/v1/signals", signals)
    runner = web.AppRunner(app)
    await runner.setup()
    for host in hosts:
        await web.TCPSite(runner, host, port).start()
    try:
        pods = [{"metadata": {"name": f"p{i}"},
                 "status": {"phase": "Running", "podIP": host,
                            "conditions": [{"type": "Ready", "status": "True"}]}} for i, host in enumerate(hosts)]
        pods.append({"metadata": {"name": "pending"}, "status": {"phase": "Pending"}})
        source = AgentSource(port=port, timeout=1.5, concurrency=3)
        errors: dict[str, str] = {}
        out = await source.scrape("default", "x", pods, errors)
        await source.close()
    finally:
        await runner.cleanup()
    by = {p.name: p for p in out}
    assert by["p0"].kv_cache_utilization == 0.5 and not by["p0"].stale
    assert by["p1"].stale and "HTTP 500" in errors["p1"]
    assert by["p2"].stale and "Timeout" in errors["p2"]
    assert not by["pending"].ready and "pending" not in errors  # never scraped
    assert peak <= 3


def test_shape_from_a_local_model_directory(tmp_path):
    import json

    from kvserve.operator.handlers import shape_for
    from kvserve.operator.spec import parse_spec

    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256}))
    shape = shape_for(parse_spec({"model": {"uri": f"file://{tmp_path}"}}))
    assert shape.num_attention_heads == 4 and shape.valid_tp_degrees(8) == [1, 2, 4]
    assert shape_for(parse_spec({"model": {"uri": str(tmp_path / "missing")}})) is None
    assert shape_for(parse_spec({"model": {"uri": "hf://nobody/not-cached"}})) is None  # no network


def test_optional_fields_dropped_from_the_rendering_are_deleted_by_the_apply():
    live = {"spec": {"replicas": 2, "template": {"spec": {"nodeSelector": {"gpu": "h100"},
                                                          "tolerations": [{"key": "x"}], "containers": []}}}}
    desired = {"spec": {"replicas": 2, "template": {"spec": {"tolerations": [{"key": "x"}], "containers": []}}}}
    out = ssa.apply(ssa.apply(None, live, FIELD_MANAGER, force=True), desired, FIELD_MANAGER, force=True)
    assert out["spec"] == desired["spec"]


def test_limit_warnings_only_when_too_many_replicas_begins(monkeypatch):
    """Regression: idle at minReplicas posted a Warning `TooFewReplicas`; resting at a bound is normal."""
    import kopf

    from kvserve.operator.handlers import Reconciler

    warned = []
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warned.append(reason))
    limited = lambda reason: {"conditions": [{"type": "ScalingLimited", "status": "True", "reason": reason}]}
    Reconciler._report_limits({}, {}, _decision(limited="TooFewReplicas", limited_message="x"))
    assert warned == []
    Reconciler._report_limits({}, {}, _decision(limited="TooManyReplicas", limited_message="x"))
    assert warned == ["TooManyReplicas"]
    Reconciler._report_limits({}, limited("TooManyReplicas"), _decision(limited="TooManyReplicas", limited_message="x"))
    assert warned == ["TooManyReplicas"]  # once as the state begins, not every tick


def test_unknown_model_shape_is_said_in_status_and_one_event(monkeypatch):
    """Regression: an hf:// model without `model.config` left TP planning silently off."""
    import kopf

    from kvserve.operator.handlers import Reconciler, shape_for
    from kvserve.operator.spec import parse_spec
    from kvserve.operator.status import tp_note

    spec = parse_spec({"model": {"uri": "hf://kvserve-test/not-cached"},
                       "parallelism": {"tensor": {"min": 1, "max": 4}},
                       "autoscaling": {"tensorParallel": {"enabled": True}}})
    shape = shape_for(spec)
    assert shape is None
    note = tp_note(spec, shape)
    assert "spec.model.config" in note and "TP stays at 1" in note
    active = scaling_conditions(_decision(), enabled=True, generation=1, note=note)[0]
    assert active["type"] == "ScalingActive" and active["message"].endswith(note)
    configured = parse_spec({"model": {"uri": "hf://org/m", "config": {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256}}, "autoscaling": {"tensorParallel": {"enabled": True}}})
    assert tp_note(configured, shape_for(configured)) == ""
    warned, memo = [], {}
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warned.append((reason, message)))
    for _ in range(3):
        Reconciler._report_tp_note({}, memo, note)
    assert warned == [("TensorParallelUnplanned", note)]


def test_peering_objects_to_check_and_the_message():
    from kvserve.operator.peering import missing_message, peering_objects

    assert peering_objects("default", [], True) == [("ClusterKopfPeering", None)]
    assert peering_objects("default", ["ml", "team-*"], False) == [("KopfPeering", "ml")]
    message = missing_message("default", "ClusterKopfPeering", None)
    assert message.startswith("peering object ClusterKopfPeering 'default' does not exist")
    assert "kind ClusterKopfPeering, metadata.name 'default';" in message and "--standalone" in message
