"""Each pod's parallel layout (data-parallel engines x tensor-parallel ranks over its
`spec.parallelism.devicesPerPod` devices): the pure policy that picks it. No I/O.

More data parallelism serves more requests at once (each engine batches its own); a higher
tensor-parallel degree runs each token over more devices (lower TPOT) and gives one request a
pool G/TP times larger (long contexts). So:
  * at high load (running + waiting per pod above `highLoadRequests`) the pods take the most
    data-parallel layout;
  * at low load (at or below `lowLoadRequests`), or when KV is saturated while few requests run
    (long contexts), the highest tensor-parallel layout;
  * between the two, the layout stays (the band is the hysteresis);
  * with a TPOT SLO (`tpotSloSeconds`), low load alone is no reason to reshape: the highest
    tensor-parallel layout is wanted only while the measured TPOT (the pods' inter-token latency
    over the last interval) misses the SLO, at any load short of high;
  * a move to a higher TP for latency is refused (`LayoutTPOTGated`) when that layout's TPOT,
    measured the last time the pods ran it at low load (within the last hour), was no better than
    the current layout's:
    on hosts where the extra ranks only add communication (CPU ranks sharing cores), a higher TP
    is slower and every reshape to it would be pure cost. Long contexts are not gated (they need
    the larger pool, whatever the TPOT);
  * a wish must hold for `stabilizationSeconds`, and a layout is kept at least
    `reshapeCostMultiple` x the last measured reshape duration, so the time spent reshaping stays
    a small share however slow a reshape turns out to be: it never flaps.

The operator's timer records the decision in status (status.layout, status.decisions); the
reconcile brings every pod whose agent reports another layout to it, in place (handlers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.runtime.capacity import ModelShape

from .autoscaler import Signals
from .spec import TP_DEGREES, ServiceSpec


@dataclass(frozen=True, order=True)
class PodLayout:
    data_parallel: int
    tensor_parallel: int

    def __str__(self) -> str:
        return f"{self.data_parallel}xTP{self.tensor_parallel}"

    def as_status(self, devices: int) -> dict:
        return {"devicesPerPod": devices, "dataParallel": self.data_parallel, "tensorParallel": self.tensor_parallel}


@dataclass(frozen=True)
class LayoutState:
    wish: PodLayout | None = None  # the layout the load asks for, different from the current one
    wish_since: float | None = None
    last_change: float | None = None
    last_reshape_seconds: float | None = None  # measured by the latest in-place reshape
    # The pods' inter-token latency totals (sum of seconds, count) at the previous decision: the
    # TPOT of an interval is the difference (Signals carry totals, as the engines' histograms).
    itl_totals: tuple[float, float] | None = None
    # (layout, TPOT seconds, when) measured while the pods ran that layout at low load, newest kept.
    tpot_by_layout: tuple[tuple[PodLayout, float, float], ...] = ()

    def tpot_at(self, layout: PodLayout, now: float) -> float | None:
        """The TPOT remembered for `layout`, unless older than TPOT_MEMORY_SECONDS (the pods may
        have changed since: a new image, another node type; a gated layout is then tried again)."""
        return next((t for lay, t, at in self.tpot_by_layout if lay == layout and now - at <= TPOT_MEMORY_SECONDS),
                    None)


# How long a layout's measured TPOT gates moves to it (LayoutTPOTGated) before it is measured again.
TPOT_MEMORY_SECONDS = 3600.0


# Fewer output tokens than this in an interval: its TPOT is not measured (too noisy).
MIN_TPOT_TOKENS = 16


def interval_tpot(previous: tuple[float, float] | None, signals: Signals) -> tuple[float | None, tuple[float, float]]:
    """The mean TPOT of the interval since `previous` totals, and the totals to keep. None when
    too few tokens were generated, or the totals went back (a pod restarted, one joined or left)."""
    totals = (signals.itl_seconds_sum, signals.itl_seconds_count)
    if previous is None:
        return None, totals
    d_sum, d_count = totals[0] - previous[0], totals[1] - previous[1]
    if d_count < MIN_TPOT_TOKENS or d_sum < 0:
        return None, totals
    return d_sum / d_count, totals


@dataclass(frozen=True)
class LayoutDecision:
    layout: PodLayout
    from_layout: PodLayout
    reason: str
    message: str
    state: LayoutState

    @property
    def changed(self) -> bool:
        return self.layout != self.from_layout


def pod_layouts(spec: ServiceSpec, shape: ModelShape | None) -> list[PodLayout]:
    """The layouts a pod of `spec` can run, most data-parallel first: TP within the spec's tensor
    bounds and dividing the devices (and the model's heads when its shape is known), one
    tensor-parallel group per pod (the runtime's limit today: DP > 1 only with TP 1)."""
    g = spec.devices_per_pod or 1
    out = []
    for tp in TP_DEGREES:
        if tp > g or g % tp or not spec.tensor.min <= tp <= spec.tensor.max:
            continue
        dp = g // tp
        if dp > 1 and tp > 1:
            continue
        if shape is not None and tp > 1 and shape.tp_error(tp):
            continue
        out.append(PodLayout(dp, tp))
    return sorted(out, key=lambda layout: layout.tensor_parallel)


def initial_layout(spec: ServiceSpec) -> PodLayout:
    """What the pod template starts (the Deployment never changes for a layout)."""
    g = spec.devices_per_pod or 1
    return PodLayout(g // spec.tensor.initial, spec.tensor.initial)


def decide_layout(spec: ServiceSpec, shape: ModelShape | None, current: PodLayout, signals: Signals,
                  state: LayoutState, now: float) -> LayoutDecision:
    la, ta = spec.autoscaling.layout, spec.autoscaling.tensor
    layouts = pod_layouts(spec, shape)

    def keep(reason: str, message: str, new_state: LayoutState) -> LayoutDecision:
        return LayoutDecision(current, current, reason, message, new_state)

    if not la.enabled or len(layouts) < 2 or current not in layouts:
        return keep("LayoutFixed", f"{len(layouts)} layout(s) possible; keeping {current}", state)
    if signals.pods == 0:
        return keep("NoMetrics", "no fresh signals; layout held", replace(state, wish=None, wish_since=None))
    per_pod = (signals.requests_running + signals.queue_depth) / signals.pods
    tpot, totals = interval_tpot(state.itl_totals, signals)
    state = replace(state, itl_totals=totals)
    if tpot is not None and per_pod <= la.low_load_requests:  # what this layout gives one request
        state = replace(state, tpot_by_layout=tuple(
            [entry for entry in state.tpot_by_layout if entry[0] != current] + [(current, tpot, now)]))
    long_context = (signals.kv_cache_utilization >= ta.kv_saturation
                    and signals.requests_running / signals.pods <= ta.few_running_requests)
    slo = la.tpot_slo_seconds
    slo_missed = bool(slo) and tpot is not None and tpot > slo
    if per_pod > la.high_load_requests and not long_context:
        wish, why = layouts[0], f"{per_pod:.1f} requests per pod > {la.high_load_requests:g}: throughput"
        reason = "LayoutDataParallel"
    elif long_context or slo_missed or (per_pod <= la.low_load_requests and not slo):
        wish = layouts[-1]
        why = ("KV saturated while few requests run: long contexts" if long_context
               else f"TPOT {tpot:.3f}s > SLO {slo:g}s at {per_pod:.1f} requests per pod: latency" if slo_missed
               else f"{per_pod:.1f} requests per pod <= {la.low_load_requests:g}: latency")
        reason = "LayoutTensorParallel"
        if not long_context and wish != current:
            there, here = state.tpot_at(wish, now), state.tpot_at(current, now)
            if there is not None and here is not None and there >= here:
                return keep("LayoutTPOTGated", f"{why}; but {wish} measured TPOT {there:.3f}s against "
                            f"{here:.3f}s at {current}: a higher TP is not faster on these pods; keeping {current}",
                            replace(state, wish=None, wish_since=None))
    elif per_pod <= la.low_load_requests:
        return keep("LayoutTPOTMet", f"{per_pod:.1f} requests per pod, TPOT "
                    f"{'not measured' if tpot is None else f'{tpot:.3f}s'} within SLO {slo:g}s; keeping {current}",
                    replace(state, wish=None, wish_since=None))
    else:
        return keep("LayoutWithinBand", f"{per_pod:.1f} requests per pod within "
                    f"({la.low_load_requests:g}, {la.high_load_requests:g}]; keeping {current}",
                    replace(state, wish=None, wish_since=None))
    if wish == current:
        return keep("LayoutSettled", f"{why}; already {current}", replace(state, wish=None, wish_since=None))
    since = state.wish_since if state.wish == wish and state.wish_since is not None else now
    state = replace(state, wish=wish, wish_since=since)
    if now - since < la.stabilization_seconds:
        return keep("LayoutStabilizing", f"{why}; {wish} wanted for {now - since:.0f}s of "
                    f"{la.stabilization_seconds:g}s", state)
    dwell = la.reshape_cost_multiple * (state.last_reshape_seconds or 0.0)
    if state.last_change is not None and now - state.last_change < dwell:
        return keep("LayoutCostGated", f"{why}; {current} kept {dwell:.0f}s ({la.reshape_cost_multiple:g} x the "
                    f"last reshape's {state.last_reshape_seconds:.2f}s), {now - state.last_change:.0f}s so far", state)
    return LayoutDecision(wish, current, reason, f"{why}; {current} -> {wish} in place",
                          replace(state, wish=None, wish_since=None, last_change=now))
