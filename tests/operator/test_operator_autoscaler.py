"""Autoscaler policy: one table per rule, then properties over random loads and clocks."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvserve.operator.autoscaler import AutoscalerState, Observation, PodSignals, decide, hold, valid_degrees
from kvserve.operator.spec import model_shape, parse_spec

LLAMA_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
            "torch_dtype": "bfloat16"}


def make_spec(autoscaling=None, tensor=None, config=LLAMA_8B, gpu_memory="80Gi"):
    raw = {"model": {"uri": "hf://org/m", "config": config},
           "gpu": {"memory": gpu_memory},
           "autoscaling": {"minReplicas": 1, "maxReplicas": 10, "targetKVCacheUtilization": 0.5,
                           "targetQueueDepth": 4, "scaleUpStabilizationSeconds": 30,
                           "scaleDownStabilizationSeconds": 300, "maxScaleUpStep": 4, "maxScaleDownStep": 2,
                           **(autoscaling or {})},
           "parallelism": {"tensor": tensor or {"min": 1, "max": 1}}}
    spec = parse_spec(raw)
    return spec, model_shape(spec)


def pods(n, kv=0.5, queue=0.0, running=8.0, ready=True, stale=False, tp=1, capacity=100_000, start=0):
    return tuple(PodSignals(f"p{start + i}", ready=ready, stale=stale, kv_cache_utilization=kv, queue_depth=queue,
                            requests_running=running, kv_cache_capacity_tokens=capacity, tensor_parallel_size=tp)
                 for i in range(n))


def run(spec, shape, steps, replicas, tp=1, state=None):
    """Feeds (time, pod-builder) steps through decide, applying each decision; returns the decisions."""
    state = state or AutoscalerState()
    out = []
    for t, build in steps:
        d = decide(spec, shape, Observation(t, replicas, tp, build(replicas, tp)), state)
        state, replicas, tp = d.state, d.replicas, d.tp
        out.append(d)
    return out


# --- replicas ------------------------------------------------------------------------------------

def test_no_fresh_signals_holds_the_current_size():
    spec, shape = make_spec()
    for fleet in [(), pods(3, ready=False, kv=0.0), pods(3, stale=True, kv=0.0)]:
        d = decide(spec, shape, Observation(0, 3, 1, fleet), AutoscalerState())
        assert (d.replicas, d.reason, d.metrics_available) == (3, "NoMetrics", False)


def test_no_signals_still_obeys_bounds():
    spec, shape = make_spec({"minReplicas": 2})
    d = decide(spec, shape, Observation(0, 1, 1, ()), AutoscalerState())
    assert (d.replicas, d.reason) == (2, "OutsideBounds")


@pytest.mark.parametrize("kv,expected", [(0.5, 3), (0.54, 3), (0.46, 3)])
def test_tolerance_band_holds(kv, expected):
    spec, shape = make_spec()
    d = decide(spec, shape, Observation(1000, 3, 1, pods(3, kv=kv)), AutoscalerState(history_start=0))
    assert (d.replicas, d.reason) == (expected, "WithinTolerance")


@pytest.mark.parametrize("kv,queue,expected", [
    (0.75, 0, 5),    # 3 pods x 0.75 / 0.5 = 4.5 -> 5
    (0.5, 8, 6),     # queue 24 total / 4 per replica = 6
    (1.0, 40, 7),    # max of kv (6) and queue (30), capped at +4
])
def test_scale_up_is_ceil_of_load_over_target_with_step_cap(kv, queue, expected):
    spec, shape = make_spec({"panicThreshold": 100})
    d = decide(spec, shape, Observation(0, 3, 1, pods(3, kv=kv, queue=queue)), AutoscalerState())
    assert (d.replicas, d.reason) == (expected, "ScaleUp")


def test_scale_up_waits_for_the_up_window():
    spec, shape = make_spec({"panicThreshold": 100})
    low = lambda n, tp: pods(n, kv=0.5)
    high = lambda n, tp: pods(n, kv=0.8)
    ds = run(spec, shape, [(0, low), (10, high), (20, high), (29, high), (41, high)], replicas=2)
    assert [d.replicas for d in ds] == [2, 2, 2, 2, 4]
    assert ds[1].reason == "ScaleUpStabilizing" and ds[-1].reason == "ScaleUp"


def test_scale_down_only_after_the_down_window_and_by_step():
    spec, shape = make_spec()
    busy = lambda n, tp: pods(n, kv=0.5)
    idle = lambda n, tp: pods(n, kv=0.05)
    steps = [(t, busy) for t in range(0, 100, 10)] + [(t, idle) for t in range(100, 1000, 10)]
    ds = run(spec, shape, steps, replicas=6)
    sizes = [d.replicas for d in ds]
    first_down = next(i for i, s in enumerate(sizes) if s < 6)
    assert steps[first_down][0] >= 390  # the last busy sample (t=90) ages out of the 300 s window
    assert sizes[first_down] == 4  # step cap 2
    assert sizes[-1] == 1


def test_fresh_operator_waits_a_full_window_before_scaling_down():
    spec, shape = make_spec()
    idle = lambda n, tp: pods(n, kv=0.0)
    ds = run(spec, shape, [(t, idle) for t in range(5000, 5400, 15)], replicas=4)
    sizes = [d.replicas for d in ds]
    assert sizes[:20] == [4] * 20 and ds[0].reason == "ScaleDownStabilizing"
    assert sizes[-1] < 4


def test_unready_and_stale_pods_never_drive_a_scale_down():
    spec, shape = make_spec()
    state = AutoscalerState(history_start=-10_000)
    # 1 fresh pod at target, 3 pods whose (zero) numbers must not count as idle.
    for bad in [pods(3, kv=0.0, ready=False, start=1), pods(3, kv=0.0, stale=True, start=1), ()]:
        fleet = pods(1, kv=0.5) + bad
        d = decide(spec, shape, Observation(0, 4, 1, fleet), state)
        assert d.replicas == 4, d


def test_unready_pods_count_as_idle_when_scaling_up():
    spec, shape = make_spec({"panicThreshold": 100})
    fleet = pods(2, kv=0.6) + pods(2, kv=0.0, ready=False, start=2)
    # fresh only: 1.2/0.5 = 2.4 -> up; with 2 not-ready as idle: 1.2 / (4*0.5) = 0.6 -> no scale-up.
    d = decide(spec, shape, Observation(0, 4, 1, fleet), AutoscalerState())
    assert d.replicas == 4


def test_panic_scales_up_at_once_beyond_the_step_and_blocks_scale_down():
    spec, shape = make_spec({"maxScaleUpStep": 1, "maxReplicas": 20, "panicWindowSeconds": 60})
    state = AutoscalerState(recommendations=((0, 5),), history_start=-1000)
    d = decide(spec, shape, Observation(10, 5, 1, pods(5, kv=1.0, queue=20)), state)
    assert (d.replicas, d.reason) == (10, "PanicScaleUp")  # doubled despite step 1 and the up window
    d2 = decide(spec, shape, Observation(20, 10, 1, pods(10, kv=0.0)), d.state)
    assert (d2.replicas, d2.reason) == (10, "PanicHold")


def test_bounds_and_scaling_limited():
    spec, shape = make_spec({"maxReplicas": 4, "panicThreshold": 100})
    d = decide(spec, shape, Observation(0, 4, 1, pods(4, kv=1.0, queue=20)), AutoscalerState())
    assert d.replicas == 4 and d.limited == "TooManyReplicas"
    spec, shape = make_spec({"minReplicas": 2})
    d = decide(spec, shape, Observation(1000, 2, 1, pods(2, kv=0.0)), AutoscalerState(history_start=0))
    assert d.replicas == 2 and d.limited == "TooFewReplicas"


def test_hold_for_reconciles():
    spec, _ = make_spec({"minReplicas": 2, "maxReplicas": 5}, tensor={"min": 1, "max": 4, "initial": 2})
    assert hold(spec, 9, 4) == (5, 2)  # TP autoscaling off: initial wins
    manual = parse_spec({"model": {"uri": "/m"}, "autoscaling": {"enabled": False}, "replicas": 3})
    assert hold(manual, 7, 1) == (3, 1)


# --- tensor parallelism --------------------------------------------------------------------------

TP_ON = {"maxReplicas": 2, "panicThreshold": 100, "tensorParallel": {"enabled": True,
                                                                    "scaleDownStabilizationSeconds": 600}}


def test_tp_goes_up_at_max_replicas_when_still_saturated():
    spec, shape = make_spec(TP_ON, tensor={"min": 1, "max": 4})
    hot = lambda n, tp: pods(n, kv=0.95, queue=10, tp=tp)
    ds = run(spec, shape, [(t, hot) for t in range(0, 50, 10)], replicas=2)
    assert [d.tp for d in ds] == [1, 1, 1, 2, 2]
    assert ds[3].reason == "TensorParallelUpAtMaxReplicas" and ds[3].replicas == 2


def test_tp_goes_up_for_long_contexts_with_few_requests():
    spec, shape = make_spec({**TP_ON, "maxReplicas": 10}, tensor={"min": 1, "max": 4})
    # KV full with one request per pod and a queue: more replicas would not hold a longer context.
    long_ctx = lambda n, tp: pods(n, kv=0.97, queue=0, running=1, tp=tp)
    state = AutoscalerState(recommendations=tuple((t, 2) for t in range(-40, 0, 10)), history_start=-1000)
    ds = run(spec, shape, [(t, long_ctx) for t in range(0, 50, 10)], replicas=2, state=state)
    assert any(d.reason == "TensorParallelUpLongContext" for d in ds), [d.reason for d in ds]


def test_tp_goes_down_after_a_long_low_window():
    spec, shape = make_spec(TP_ON, tensor={"min": 1, "max": 4})
    quiet = lambda n, tp: pods(n, kv=0.05, queue=0, running=1, tp=tp, capacity=400_000)
    state = AutoscalerState(history_start=-10_000)
    ds = run(spec, shape, [(t, quiet) for t in range(0, 700, 30)], replicas=2, tp=4, state=state)
    changes = [(i, d.tp) for i, d in enumerate(ds) if d.tp != d.from_tp]
    assert changes and changes[0][1] == 2 and 600 <= changes[0][0] * 30 < 660
    assert ds[changes[0][0]].reason == "TensorParallelDownLowLoad"


def test_tp_stays_when_the_lower_degree_would_be_over_target():
    spec, shape = make_spec(TP_ON, tensor={"min": 1, "max": 4})
    # 2 x 0.30 x 400k tokens = 240k in use; TP 2 gives about 2 x 0.5 x 215k: over target.
    warm = lambda n, tp: pods(n, kv=0.3, queue=0, running=20, tp=tp, capacity=400_000)
    ds = run(spec, shape, [(t, warm) for t in range(0, 2000, 30)], replicas=2, tp=4,
             state=AutoscalerState(history_start=-10_000))
    assert all(d.tp == 4 for d in ds)


def test_tp_only_moves_to_valid_degrees():
    # 12 heads: 8 does not divide them, so 4 is the top even though the spec allows 8.
    config = {**LLAMA_8B, "num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 1536}
    spec, shape = make_spec(TP_ON, tensor={"min": 1, "max": 8}, config=config)
    assert valid_degrees(spec, shape) == [1, 2, 4]
    hot = lambda n, tp: pods(n, kv=1.0, queue=50, tp=tp)
    ds = run(spec, shape, [(t, hot) for t in range(0, 2000, 10)], replicas=2)
    assert {d.tp for d in ds} <= {1, 2, 4} and ds[-1].tp == 4


def test_tp_never_changes_during_a_rollout_or_when_disabled():
    spec, shape = make_spec(TP_ON, tensor={"min": 1, "max": 4})
    hot = pods(2, kv=1.0, queue=50)
    d = None
    state = AutoscalerState()
    for t in range(0, 200, 10):
        d = decide(spec, shape, Observation(t, 2, 1, hot, rollout_in_progress=True), state)
        state = d.state
        assert d.tp == 1
    mixed = pods(1, kv=1.0, queue=50, tp=1) + pods(1, kv=1.0, queue=50, tp=2, start=1)
    assert decide(spec, shape, Observation(500, 2, 1, mixed), AutoscalerState()).tp == 1
    off, shape = make_spec({"maxReplicas": 2}, tensor={"min": 1, "max": 4})
    ds = run(off, shape, [(t, lambda n, tp: pods(n, kv=1.0, queue=50)) for t in range(0, 200, 10)], replicas=2)
    assert all(d.tp == 1 for d in ds)


def test_tp_is_fixed_without_a_model_shape():
    spec, _ = make_spec(TP_ON, tensor={"min": 1, "max": 4})
    ds = run(spec, None, [(t, lambda n, tp: pods(n, kv=1.0, queue=50)) for t in range(0, 200, 10)], replicas=2)
    assert all(d.tp == 1 for d in ds)


# --- properties -----------------------------------------------------------------------------------

pod_st = st.builds(
    PodSignals, name=st.just("p"), ready=st.booleans(), stale=st.booleans(),
    sample_age_seconds=st.floats(0, 30), kv_cache_utilization=st.floats(0, 1),
    queue_depth=st.floats(0, 200), requests_running=st.floats(0, 64),
    kv_cache_capacity_tokens=st.integers(0, 500_000), tensor_parallel_size=st.sampled_from([None, 1, 2, 4, 8]))

FAST = settings(max_examples=int(__import__("os").environ.get("HYP_N", "60")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(lo=st.integers(1, 5), span=st.integers(0, 10), tp_lo=st.sampled_from([1, 2]),
       tp_hi=st.sampled_from([2, 4, 8]), steps=st.lists(st.tuples(st.integers(1, 120), st.lists(pod_st, max_size=12)),
                                                        min_size=1, max_size=25),
       start=st.integers(1, 20))
def test_never_outside_bounds_and_tp_only_valid(lo, span, tp_lo, tp_hi, steps, start):
    config = {**LLAMA_8B, "num_attention_heads": 24, "num_key_value_heads": 8, "hidden_size": 3072}
    spec, shape = make_spec({"minReplicas": lo, "maxReplicas": lo + span, "tensorParallel": {"enabled": True}},
                            tensor={"min": tp_lo, "max": tp_hi}, config=config)
    allowed = set(valid_degrees(spec, shape))
    replicas, tp, t, state = start, tp_lo, 0.0, AutoscalerState()
    for dt, fleet in steps:
        t += dt
        d = decide(spec, shape, Observation(t, replicas, tp, tuple(fleet)), state)
        if d.metrics_available or replicas != d.replicas:
            assert lo <= d.replicas <= lo + span
        assert d.tp == tp or d.tp in allowed
        assert not (d.tp != tp and d.replicas != replicas)  # one kind of change at a time
        replicas, tp, state = d.replicas, d.tp, d.state


@FAST
@given(load=st.floats(0.3, 12.0), start=st.integers(1, 12), seed=st.integers(0, 2**32 - 1),
       noise=st.floats(0.0, 0.05))
# A load just under a size boundary: noisy samples keep asking for one more replica, so the long
# scale-down window holds the size until a quiet window lets it take its one step down, late.
@example(load=2.96875, start=4, seed=0, noise=0.03125)
def test_no_flapping_under_noisy_steady_load(load, start, seed, noise):
    """A steady load (in replicas' worth at target) with per-pod noise inside the tolerance settles.

    Flapping means the size keeps moving. Allowed: one overshoot and its correction (panic mode
    jumps on a noisy sample, as Knative's does), and one late settling step of a load that sits on
    a size boundary. Not allowed: a second reversal, or more than one change in the second half
    hour.
    """
    spec, shape = make_spec({"minReplicas": 1, "maxReplicas": 15})
    target = spec.autoscaling.target_kv_utilization
    rng = random.Random(seed)

    def fleet(n, tp):
        return tuple(PodSignals(f"p{i}", kv_cache_utilization=min(1.0, load * target / n * (1 + rng.uniform(-noise, noise))))
                     for i in range(n))

    ds = run(spec, shape, [(t, fleet) for t in range(0, 3600, 15)], replicas=start)
    moves = [d.replicas - d.from_replicas for d in ds if d.replicas != d.from_replicas]
    reversals = sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))
    assert reversals <= 1, moves
    late_moves = [d for d in ds[len(ds) // 2:] if d.replicas != d.from_replicas]
    assert len(late_moves) <= 1, moves


@FAST
@given(levels=st.lists(st.tuples(st.integers(1, 40), st.floats(0, 1)), min_size=1, max_size=20),
       window=st.sampled_from([60, 300]), start=st.integers(1, 10))
def test_scale_down_only_after_its_window(levels, window, start):
    spec, shape = make_spec({"scaleDownStabilizationSeconds": window, "maxReplicas": 10})
    replicas, state, t = start, AutoscalerState(), 0
    raws: list[tuple[int, int]] = []
    for ticks, kv in levels:
        for _ in range(ticks):
            t += 15
            d = decide(spec, shape, Observation(t, replicas, 1, pods(replicas, kv=kv)), state)
            raws.append((t, d.state.recommendations[-1][1]))
            if d.replicas < replicas and d.reason == "ScaleDown":
                assert t - raws[0][0] >= window  # history covers the window
                assert all(r < replicas for tt, r in raws if tt >= t - window)
            replicas, state = d.replicas, d.state


@FAST
@given(fresh=st.integers(1, 6), others=st.lists(st.tuples(st.sampled_from(["unready", "stale", "old"]),
                                                         st.floats(0, 1)), min_size=1, max_size=6),
       extra=st.integers(0, 3))
def test_pods_without_fresh_data_never_cause_a_scale_down(fresh, others, extra):
    """Fresh pods exactly at target plus any not-fresh pods (idle-looking numbers): no scale-down."""
    spec, shape = make_spec({"maxReplicas": 20})
    pods_ = list(pods(fresh, kv=0.5, queue=0))
    for i, (kind, kv) in enumerate(others):
        pods_.append(PodSignals(f"x{i}", ready=kind != "unready", stale=kind == "stale",
                                sample_age_seconds=60.0 if kind == "old" else 0.0, kv_cache_utilization=kv * 0.1))
    current = len(pods_) + extra  # some pods may not even exist yet
    state = AutoscalerState(recommendations=tuple((t, current) for t in range(-400, 0, 15)),
                            history_start=-10_000)
    for t in range(0, 1200, 15):  # long past the down window
        d = decide(spec, shape, Observation(t, current, 1, tuple(pods_)), state)
        assert d.replicas >= current, d
        state = d.state


def test_idle_at_min_replicas_says_so_and_changes_nothing():
    """Regression: 1 -> 1 at minReplicas with no load was `ScaleDownStabilizing` (then `OutsideBounds`)."""
    spec, shape = make_spec({"minReplicas": 1})
    for state in (AutoscalerState(), AutoscalerState(history_start=-10_000)):
        d = decide(spec, shape, Observation(0, 1, 1, pods(1, kv=0.0, running=0)), state)
        assert (d.replicas, d.reason, d.changed) == (1, "AtMinReplicas", False)


def test_loaded_at_max_replicas_says_so_and_is_limited():
    spec, shape = make_spec({"maxReplicas": 3, "panicThreshold": 100})
    d = decide(spec, shape, Observation(0, 3, 1, pods(3, kv=1.0, queue=20)), AutoscalerState())
    assert (d.replicas, d.reason, d.changed, d.limited) == (3, "AtMaxReplicas", False, "TooManyReplicas")


def test_a_move_clamped_by_the_bounds_keeps_its_direction():
    """Regression: 1 -> 3 clamped at maxReplicas 3 and 2 -> 1 clamped at min were `OutsideBounds`."""
    spec, shape = make_spec({"maxReplicas": 3, "panicThreshold": 100})
    d = decide(spec, shape, Observation(0, 1, 1, pods(1, kv=1.0, queue=20)), AutoscalerState())
    assert (d.replicas, d.reason, d.limited) == (3, "ScaleUp", "TooManyReplicas")
    assert "clamped at maxReplicas 3" in d.message
    spec, shape = make_spec({"maxReplicas": 3})  # panic: the same, labelled PanicScaleUp
    d = decide(spec, shape, Observation(0, 1, 1, pods(1, kv=1.0, queue=20)), AutoscalerState())
    assert (d.replicas, d.reason, d.limited) == (3, "PanicScaleUp", "TooManyReplicas")
    spec, shape = make_spec({"minReplicas": 1, "maxScaleDownStep": 4})
    d = decide(spec, shape, Observation(1000, 2, 1, pods(2, kv=0.0)), AutoscalerState(history_start=0))
    assert (d.replicas, d.reason) == (1, "ScaleDown") and "clamped at minReplicas 1" in d.message
