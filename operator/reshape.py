"""The shell of in-place layout changes: asks a pod's agent to change the runtime's layout
(`POST /admin/parallelism`, which the agent passes on with the pod's admin key) and reads the
admin key from the Secret the spec names. The decision is layout.py's; handlers.py records it
first and calls this to bring each pod to it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from .layout import PodLayout
from .manifests import AGENT_PORT
from .sources import read_json_capped

# A reshape starts the new layout's workers and loads its shards from the pod's local copy.
RESHAPE_TIMEOUT_S = 600.0
MAX_ANSWER_BYTES = 64 * 1024


class ReshapeFailed(RuntimeError):
    """The pod did not change its layout (it serves on with the old one, or cannot be reached)."""


def secret_value(secret: Mapping[str, Any] | None, key: str) -> str | None:
    """A Secret's value for `key` (data is base64; stringData as an API server would have it)."""
    if not secret:
        return None
    raw = (secret.get("data") or {}).get(key)
    if isinstance(raw, str):
        try:
            return base64.b64decode(raw).decode().strip() or None
        except (ValueError, UnicodeDecodeError):
            return None
    value = (secret.get("stringData") or {}).get(key)
    return value.strip() or None if isinstance(value, str) else None


class PodReshaper:
    def __init__(self, *, port: int = AGENT_PORT, timeout: float = RESHAPE_TIMEOUT_S):
        self.port, self.timeout = port, timeout

    async def reshape(self, ip: str, layout: PodLayout, admin_key: str) -> dict[str, Any]:
        """The runtime's answer (with `seconds`), or ReshapeFailed with the reason."""
        url = f"http://{ip}:{self.port}/admin/parallelism"
        body = {"data_parallel": layout.data_parallel, "tensor_parallel": layout.tensor_parallel}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session:
                async with session.post(url, json=body, headers={"Authorization": f"Bearer {admin_key}"}) as r:
                    answer = await read_json_capped(r, MAX_ANSWER_BYTES)
                    if r.status != 200:
                        message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
                        raise ReshapeFailed(f"HTTP {r.status}: {message or json.dumps(answer)[:300]}")
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            raise ReshapeFailed(f"{url}: {type(error).__name__}: {error}") from None
        if not isinstance(answer, dict):
            raise ReshapeFailed(f"{url}: the answer is not a JSON object")
        return answer


def recorded_layout(spec, status: Mapping[str, Any] | None) -> PodLayout:
    """The layout status records for this devicesPerPod, else the template's."""
    from .layout import initial_layout, pod_layouts

    rec = (status or {}).get("layout") or {}
    if rec.get("devicesPerPod") == spec.devices_per_pod:
        layout = PodLayout(rec.get("dataParallel"), rec.get("tensorParallel"))
        if layout in pod_layouts(spec, None):
            return layout
    return initial_layout(spec)


def pod_reports(signals, spec) -> dict[str, PodLayout]:
    """The layout each pod with fresh signals reports (pods without the DP gauge: G / TP)."""
    out = {}
    for s in signals:
        if s.stale or not s.ready or s.tensor_parallel_size is None:
            continue
        dp = s.data_parallel_size or max(1, (spec.devices_per_pod or 1) // s.tensor_parallel_size)
        out[s.name] = PodLayout(dp, s.tensor_parallel_size)
    return out


async def converge_layouts(reconciler, body, current, spec, shape, pods, signals, memo, patch, logger) -> None:
    """The timer's layout step (spec.parallelism.devicesPerPod): decide (layout.py), record the
    decision in status before acting (as every decision is), then bring every pod whose agent
    reports another layout to the recorded one, in place: a pod restarted at the template's
    layout is reshaped again, so this is level-triggered like the rest of the reconcile."""
    import kopf

    from .autoscaler import aggregate
    from .layout import LayoutState, decide_layout
    from .sources import pod_ip, pod_name, pod_terminating
    from .status import append_decision, iso

    meta = current["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    status = current.get("status") or {}
    layout = recorded_layout(spec, status)
    state = memo.get("kvserve_layout") or LayoutState(
        last_reshape_seconds=(status.get("layout") or {}).get("lastReshapeSeconds"))
    now = reconciler.config.wallclock()
    decision = decide_layout(spec, shape, layout, aggregate(signals, reconciler.config.max_sample_age), state,
                             reconciler.config.clock())
    memo["kvserve_layout"] = state = decision.state
    if decision.reason == "LayoutTPOTGated":
        # One Event per refusal spell (the reason holds tick after tick), naming both TPOTs.
        if memo.get("kvserve_layout_gated") != str(layout):
            kopf.info(body, reason="LayoutTPOTGated", message=decision.message[:1024])
            logger.info(f"LayoutTPOTGated: {decision.message}")
            memo["kvserve_layout_gated"] = str(layout)
    else:
        memo["kvserve_layout_gated"] = None
    fields = {}
    if decision.changed:
        record = {"time": iso(now), "fromLayout": str(decision.from_layout), "toLayout": str(decision.layout),
                  "reason": decision.reason, "message": decision.message[:1024],
                  "signals": aggregate(signals, reconciler.config.max_sample_age).as_status()}
        fields["decisions"] = append_decision(status.get("decisions"), record)
        layout = decision.layout
        kopf.info(body, reason=decision.reason, message=f"layout {decision.from_layout} -> {layout}: {decision.message}")
        logger.info(f"{decision.reason}: layout {decision.from_layout} -> {layout}")
    if decision.changed or (status.get("layout") or {}).get("devicesPerPod") != spec.devices_per_pod:
        fields["layout"] = {**layout.as_status(spec.devices_per_pod),
                            **({"lastReshapeSeconds": state.last_reshape_seconds}
                               if state.last_reshape_seconds is not None else {})}
        await reconciler._record_size(current, fields)

    reports = pod_reports(signals, spec)
    behind = [p for p in pods if pod_name(p) in reports and reports[pod_name(p)] != layout and pod_ip(p)
              and not pod_terminating(p)]  # a pod on its way out keeps its layout
    if not behind:
        return
    secret_name, key_name = spec.runtime.admin_api_key_secret
    admin_key = secret_value(await reconciler.client.get("Secret", namespace, secret_name), key_name)
    if admin_key is None:
        warned = f"{secret_name}/{key_name}"
        if memo.get("kvserve_layout_key_warned") != warned:
            kopf.warn(body, reason="ReshapeFailed", message=f"no admin key in Secret {secret_name} (key {key_name}): "
                      f"the pods keep their layout")
            memo["kvserve_layout_key_warned"] = warned
        return
    memo["kvserve_layout_key_warned"] = None
    reshaper = getattr(reconciler, "reshaper", None) or PodReshaper(port=reconciler.config.agent_port)
    failed = memo.setdefault("kvserve_layout_failed", {})
    for pod in behind:
        pod_id, before = pod_name(pod), reports[pod_name(pod)]
        try:
            answer = await reshaper.reshape(pod_ip(pod), layout, admin_key)
        except ReshapeFailed as error:
            if failed.get(pod_id) != (str(layout), str(error)):  # one Warning per pod and cause
                kopf.warn(body, reason="ReshapeFailed", message=f"pod {pod_id}: {before} -> {layout}: {error}")
            failed[pod_id] = (str(layout), str(error))
            continue
        failed.pop(pod_id, None)
        seconds = float(answer.get("seconds") or 0.0)
        state = memo["kvserve_layout"] = type(state)(**{**state.__dict__, "last_reshape_seconds": seconds})
        reconciler.metrics.decision(namespace, name, "ReshapedInPlace", uid=meta["uid"])
        kopf.info(body, reason="ReshapedInPlace", message=f"pod {pod_id}: {before} -> {layout} in {seconds:.2f}s "
                  f"({answer.get('resumed_requests', 0)} requests resumed), no restart")
        logger.info(f"ReshapedInPlace: pod {pod_id} {before} -> {layout} in {seconds:.2f}s")
        patch.status["layout"] = {**layout.as_status(spec.devices_per_pod), "lastReshapeSeconds": round(seconds, 3)}
