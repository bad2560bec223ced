"""Per-pod parallel layouts (spec.parallelism.devicesPerPod): the spec's rules, the pod template
(which never depends on the live layout), and the layout policy, one table per rule."""

from __future__ import annotations

import pytest

from kvserve.operator import manifests as M
from kvserve.operator.autoscaler import Signals
from kvserve.operator.desired import recorded_size
from kvserve.operator.layout import (
    TPOT_MEMORY_SECONDS,
    LayoutState,
    PodLayout,
    decide_layout,
    initial_layout,
    pod_layouts,
)
from kvserve.operator.reshape import recorded_layout, secret_value
from kvserve.operator.spec import SpecError, model_shape, parse_spec

LLAMA_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "bfloat16"}
OWNER = {"apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "m", "namespace": "ns", "uid": "u1"}}


def make_spec(devices=2, tensor=None, layout=None, runtime=None, config=LLAMA_8B):
    raw = {"model": {"uri": "hf://org/m", "config": config},
           "runtime": runtime if runtime is not None else {"adminApiKeySecret": {"name": "adm", "key": "k"}},
           "parallelism": {"devicesPerPod": devices, "tensor": tensor or {"min": 1, "max": devices}},
           "autoscaling": {"layout": {"stabilizationSeconds": 30, "reshapeCostMultiple": 10, **(layout or {})}}}
    spec = parse_spec(raw)
    return spec, model_shape(spec)


@pytest.mark.parametrize("devices, tensor, runtime, field", [
    (3, None, None, "devicesPerPod"),  # not a power of two
    (2, {"min": 1, "max": 4}, None, "devicesPerPod"),  # TP bound beyond the pod's devices
    (2, None, {"engine": "vllm", "adminApiKeySecret": {"name": "a", "key": "k"}}, "devicesPerPod"),
    (2, None, {}, "devicesPerPod"),  # no admin key the operator could show the agents
])
def test_spec_rules_name_the_field(devices, tensor, runtime, field):
    with pytest.raises(SpecError, match=field):
        make_spec(devices, tensor=tensor or {"min": 1, "max": min(devices, 2)} if tensor is None else tensor,
                  runtime=runtime)


@pytest.mark.parametrize("devices, tensor, expected", [
    (2, {"min": 1, "max": 2}, [PodLayout(2, 1), PodLayout(1, 2)]),
    (4, {"min": 1, "max": 4}, [PodLayout(4, 1), PodLayout(1, 4)]),  # 2xTP2: one TP group per process today
    (4, {"min": 1, "max": 2}, [PodLayout(4, 1)]),
    (2, {"min": 2, "max": 2, "initial": 2}, [PodLayout(1, 2)]),
])
def test_pod_layouts(devices, tensor, expected):
    spec, shape = make_spec(devices, tensor=tensor)
    assert pod_layouts(spec, shape) == expected


def test_template_owns_g_devices_and_never_depends_on_the_live_layout():
    spec, shape = make_spec(4, tensor={"min": 1, "max": 4})
    replicas, tp = recorded_size(spec, shape, {"layout": {"devicesPerPod": 4, "dataParallel": 1,
                                                          "tensorParallel": 4}, "tensorParallelSize": 4})
    assert tp == 1  # the template's TP is the initial one; the live layout is in status.layout only
    dep = M.build_deployment(OWNER, spec, replicas=replicas, tp=tp)
    runtime = dep["spec"]["template"]["spec"]["containers"][0]
    assert runtime["resources"]["limits"]["nvidia.com/gpu"] == "4"
    cmd = runtime["command"]
    assert cmd[cmd.index("--data-parallel-size") + 1] == "4" and cmd[cmd.index("--tensor-parallel-size") + 1] == "1"
    assert recorded_layout(spec, {"layout": {"devicesPerPod": 4, "dataParallel": 1, "tensorParallel": 4}}) \
        == PodLayout(1, 4)
    assert recorded_layout(spec, {"layout": {"devicesPerPod": 2, "dataParallel": 1, "tensorParallel": 2}}) \
        == initial_layout(spec) == PodLayout(4, 1)  # recorded for another G: back to the template's


def sig(per_pod_running, queue=0.0, kv=0.3, pods=2):
    return Signals(pods=pods, kv_cache_utilization=kv, queue_depth=queue * pods,
                   requests_running=per_pod_running * pods)


DP, TP = PodLayout(2, 1), PodLayout(1, 2)


@pytest.mark.parametrize("current, signals, reason, expected", [
    (TP, sig(12), "LayoutDataParallel", DP),  # high load: throughput
    (TP, sig(6, queue=4), "LayoutDataParallel", DP),  # waiting requests count as load
    (DP, sig(1), "LayoutTensorParallel", TP),  # low load: latency
    (DP, sig(2, kv=0.95), "LayoutTensorParallel", TP),  # long contexts
    (DP, sig(5), "LayoutWithinBand", DP),  # between the thresholds: hysteresis band
    (TP, sig(5), "LayoutWithinBand", TP),
    (DP, sig(12), "LayoutSettled", DP),
    (DP, Signals(), "NoMetrics", DP),
])
def test_layout_wish_after_stabilization(current, signals, reason, expected):
    spec, shape = make_spec()
    state = LayoutState(wish=expected, wish_since=0.0) if expected != current else LayoutState()
    d = decide_layout(spec, shape, current, signals, state, now=100.0)
    assert (d.reason, d.layout) == (reason, expected)


def test_a_wish_must_hold_for_the_stabilization_window():
    spec, shape = make_spec()
    state, out = LayoutState(), []
    for t, s in [(0, sig(12)), (20, sig(12)), (25, sig(5)), (30, sig(12)), (50, sig(12)), (60, sig(12))]:
        d = decide_layout(spec, shape, TP, s, state, now=t)
        state = d.state
        out.append(d.reason)
    # the dip into the band at t=25 restarts the window: the change comes 30 s after t=30
    assert out == ["LayoutStabilizing", "LayoutStabilizing", "LayoutWithinBand", "LayoutStabilizing",
                   "LayoutStabilizing", "LayoutDataParallel"]


def test_measured_reshape_cost_gates_the_next_change():
    spec, shape = make_spec(layout={"stabilizationSeconds": 0, "reshapeCostMultiple": 10})
    state = LayoutState(last_change=0.0, last_reshape_seconds=6.0)  # 10 x 6 s: kept 60 s
    d = decide_layout(spec, shape, DP, sig(1), state, now=30.0)
    assert (d.reason, d.layout) == ("LayoutCostGated", DP)
    d = decide_layout(spec, shape, DP, sig(1), d.state, now=61.0)
    assert (d.reason, d.layout, d.state.last_change) == ("LayoutTensorParallel", TP, 61.0)


def test_no_flapping_under_a_load_oscillating_around_one_threshold():
    spec, shape = make_spec()
    layout, state, changes = DP, LayoutState(), 0
    for t in range(0, 600, 5):  # 7.5 .. 8.5 requests per pod: around highLoadRequests 8, never below low
        d = decide_layout(spec, shape, layout, sig(8.5 if (t // 5) % 2 else 7.5), state, now=float(t))
        state, changes = d.state, changes + d.changed
        layout = d.layout
    assert changes == 0


def test_fixed_when_only_one_layout_or_disabled():
    spec, shape = make_spec(2, tensor={"min": 2, "max": 2, "initial": 2})
    assert decide_layout(spec, shape, TP, sig(20), LayoutState(), 0).reason == "LayoutFixed"
    spec, shape = make_spec(layout={"enabled": False})
    assert decide_layout(spec, shape, DP, sig(0), LayoutState(), 0).reason == "LayoutFixed"


def test_secret_value():
    assert secret_value({"data": {"k": "c2VjcmV0Cg=="}}, "k") == "secret"
    assert secret_value({"stringData": {"k": "s"}}, "k") == "s"
    assert secret_value({"data": {}}, "k") is None and secret_value(None, "k") is None


def tpot_sig(per_pod_running, itl_sum, itl_count, pods=2):
    return Signals(pods=pods, kv_cache_utilization=0.3, requests_running=per_pod_running * pods,
                   itl_seconds_sum=itl_sum, itl_seconds_count=itl_count)


@pytest.mark.parametrize("slo, current, per_pod, d_sum, d_count, reason, expected", [
    # with an SLO, low load alone keeps the layout; a missed SLO asks for the highest TP
    (0.1, DP, 1, 2.0, 100, "LayoutTPOTMet", DP),  # 20 ms per token: met
    (0.1, DP, 1, 20.0, 100, "LayoutTensorParallel", TP),  # 200 ms per token: missed at low load
    (0.1, DP, 5, 20.0, 100, "LayoutTensorParallel", TP),  # missed within the band too
    (0.1, TP, 12, 20.0, 100, "LayoutDataParallel", DP),  # high load: throughput first, whatever the TPOT
    (0.1, DP, 1, 20.0, 10, "LayoutTPOTMet", DP),  # too few tokens to measure: nothing missed
    (0.1, DP, 1, -5.0, 100, "LayoutTPOTMet", DP),  # totals went back (a pod restarted): not measured
    (0.0, DP, 1, 2.0, 100, "LayoutTensorParallel", TP),  # no SLO: low load asks for it as before
])
def test_tpot_slo_table(slo, current, per_pod, d_sum, d_count, reason, expected):
    spec, shape = make_spec(layout={"stabilizationSeconds": 0, "tpotSloSeconds": slo})
    state = LayoutState(itl_totals=(100.0, 1000.0))
    d = decide_layout(spec, shape, current, tpot_sig(per_pod, 100.0 + d_sum, 1000.0 + d_count), state, now=10.0)
    assert (d.reason, d.layout) == (reason, expected), d.message
    assert d.state.itl_totals == (100.0 + d_sum, 1000.0 + d_count)


@pytest.mark.parametrize("at_tp, at_dp, long_context, reason, expected", [
    (0.50, 0.10, False, "LayoutTPOTGated", DP),  # the higher TP was 5x slower here (CPU ranks): refused
    (0.10, 0.10, False, "LayoutTPOTGated", DP),  # no better is not worth a reshape
    (0.05, 0.10, False, "LayoutTensorParallel", TP),  # faster: taken
    (None, 0.10, False, "LayoutTensorParallel", TP),  # never measured: tried once
    (0.50, 0.10, True, "LayoutTensorParallel", TP),  # long contexts need the pool whatever the TPOT
])
def test_measured_tpot_gates_a_move_to_higher_tp(at_tp, at_dp, long_context, reason, expected):
    spec, shape = make_spec(layout={"stabilizationSeconds": 0})
    known = ((DP, at_dp, 5.0),) + (((TP, at_tp, 5.0),) if at_tp is not None else ())
    signals = sig(2, kv=0.95) if long_context else sig(1)
    d = decide_layout(spec, shape, DP, signals, LayoutState(tpot_by_layout=known), now=10.0)
    assert (d.reason, d.layout) == (reason, expected), d.message
    if reason == "LayoutTPOTGated":
        assert f"{at_tp:.3f}s" in d.message and "1xTP2" in d.message


def test_tpot_is_learned_per_layout_at_low_load_only():
    spec, shape = make_spec(layout={"stabilizationSeconds": 0, "reshapeCostMultiple": 0})
    state = LayoutState()
    # TP at low load: 400 tokens in 40 s -> 0.1 s per token, recorded for 1xTP2
    for t, totals in ((0, (0.0, 0.0)), (10, (40.0, 400.0))):
        state = decide_layout(spec, shape, TP, tpot_sig(1, *totals), state, now=float(t)).state
    assert state.tpot_at(TP, 10.0) == pytest.approx(0.1)
    # high load at 2xTP1 moves to DP; its high-load TPOT is not what one request would get
    d = decide_layout(spec, shape, TP, tpot_sig(12, 140.0, 800.0), state, now=20.0)
    assert d.layout == DP and d.state.tpot_at(DP, 20.0) is None
    # DP at low load: 0.02 s per token, recorded; TP (0.1 s) is then refused at low load
    d = decide_layout(spec, shape, DP, tpot_sig(1, 144.0, 1000.0), d.state, now=30.0)
    assert d.state.tpot_at(DP, 30.0) == pytest.approx(0.02)
    assert (d.reason, d.layout) == ("LayoutTPOTGated", DP)
    # an hour later TP's TPOT is forgotten: the pods may have changed, so it is tried again
    later = 10.0 + TPOT_MEMORY_SECONDS + 1
    d = decide_layout(spec, shape, DP, tpot_sig(1, 148.0, 1200.0), d.state, now=later)
    assert (d.reason, d.layout) == ("LayoutTensorParallel", TP)


def test_tpot_slo_spec_field():
    spec, _ = make_spec(layout={"tpotSloSeconds": 0.05})
    assert spec.autoscaling.layout.tpot_slo_seconds == 0.05
    with pytest.raises(SpecError, match="tpotSloSeconds"):
        make_spec(layout={"tpotSloSeconds": -1})
