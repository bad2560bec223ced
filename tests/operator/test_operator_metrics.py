"""operator/metrics.py: series per resource, removed on delete, served on /metrics."""

from __future__ import annotations

import urllib.request

from kvserve.operator.metrics import OperatorMetrics

A = {"namespace": "ns", "inferenceservice": "a"}
B = {"namespace": "ns", "inferenceservice": "b"}


def test_series_per_resource_and_forget_removes_only_that_resource():
    m = OperatorMetrics()
    get = m.registry.get_sample_value
    for labels in (A, B):
        m.observe(labels["namespace"], labels["inferenceservice"], desired=3, tp=2, ready=1)
        m.decision(labels["namespace"], labels["inferenceservice"], "ScaleUp")
    m.decision("ns", "a", "ScaleUp")
    m.decision("ns", "a", "ScaleDown")
    m.error("ns", "a")
    assert get("kvserve_operator_scaling_decisions_total", A | {"reason": "ScaleUp"}) == 2
    assert get("kvserve_operator_scaling_decisions_total", A | {"reason": "ScaleDown"}) == 1
    assert get("kvserve_operator_reconcile_errors_total", A) == 1
    assert (get("kvserve_operator_desired_replicas", A), get("kvserve_operator_desired_tensor_parallel_size", A),
            get("kvserve_operator_ready_replicas", A)) == (3, 2, 1)
    m.forget("ns", "a")
    m.forget("ns", "a")  # twice (a retried delete handler) is fine
    for name in ("kvserve_operator_desired_replicas", "kvserve_operator_reconcile_errors_total"):
        assert get(name, A) is None
    assert get("kvserve_operator_scaling_decisions_total", A | {"reason": "ScaleUp"}) is None
    assert get("kvserve_operator_desired_replicas", B) == 3
    assert get("kvserve_operator_scaling_decisions_total", B | {"reason": "ScaleUp"}) == 1
    m.forget("ns", "never-seen")


def test_updates_after_forget_with_uid_are_ignored_but_a_recreated_resource_counts():
    """A timer run that began before the deletion must not bring the series back."""
    m = OperatorMetrics()
    get = m.registry.get_sample_value
    m.observe("ns", "a", desired=2, tp=1, ready=2, uid="u1")
    m.forget("ns", "a", "u1")
    m.observe("ns", "a", desired=3, tp=1, ready=2, uid="u1")
    m.decision("ns", "a", "ScaleUp", uid="u1")
    m.error("ns", "a", uid="u1")
    assert get("kvserve_operator_desired_replicas", A) is None
    assert get("kvserve_operator_scaling_decisions_total", A | {"reason": "ScaleUp"}) is None
    assert get("kvserve_operator_reconcile_errors_total", A) is None
    m.observe("ns", "a", desired=1, tp=1, ready=0, uid="u2")  # same name, new resource
    assert get("kvserve_operator_desired_replicas", A) == 1


def test_the_desired_size_is_set_when_applied_and_ready_only_when_counted():
    m = OperatorMetrics()
    get = m.registry.get_sample_value
    m.observe("ns", "a", desired=2, tp=1, ready=2)
    m.observe("ns", "a", desired=3, tp=2)  # converge, before the pods are counted
    assert (get("kvserve_operator_desired_replicas", A), get("kvserve_operator_desired_tensor_parallel_size", A),
            get("kvserve_operator_ready_replicas", A)) == (3, 2, 2)


def test_registries_are_separate():
    one, two = OperatorMetrics(), OperatorMetrics()
    one.decision("ns", "a", "ScaleUp")
    assert two.registry.get_sample_value("kvserve_operator_scaling_decisions_total", A | {"reason": "ScaleUp"}) is None


def test_serve_exposes_the_counters_after_a_decision():
    m = OperatorMetrics()
    server = m.serve(0, addr="127.0.0.1")
    try:
        m.decision("ns", "a", "ScaleUp")
        m.observe("ns", "a", desired=2, tp=1, ready=2)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'kvserve_operator_scaling_decisions_total{inferenceservice="a",namespace="ns",reason="ScaleUp"} 1.0' in text
    assert 'kvserve_operator_desired_replicas{inferenceservice="a",namespace="ns"} 2.0' in text
