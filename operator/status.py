"""Status and conditions of an InferenceService, computed from what the operator knows: pure.

Conditions follow the Kubernetes convention (type, status "True"/"False", reason in CamelCase,
message, lastTransitionTime that moves only when status flips, observedGeneration).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from kvserve.runtime.capacity import ModelShape

from .autoscaler import Decision, Signals
from .spec import ServiceSpec, shape_unknown_message

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "ScalingActive", "ScalingLimited")
MAX_DECISIONS = 5


def iso(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    out = {"type": type_, "status": "True" if status else "False", "reason": reason, "message": message}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def merge_conditions(previous: Iterable[Mapping[str, Any]] | None, updates: Iterable[Mapping[str, Any]],
                     now: dt.datetime) -> list[dict[str, Any]]:
    """`previous` with `updates` laid over by type; lastTransitionTime kept unless status flips."""
    by_type = {c["type"]: dict(c) for c in previous or () if isinstance(c, Mapping) and "type" in c}
    for update in updates:
        old = by_type.get(update["type"])
        new = dict(update)
        if old is not None and old.get("status") == new["status"] and old.get("lastTransitionTime"):
            new["lastTransitionTime"] = old["lastTransitionTime"]
        else:
            new["lastTransitionTime"] = iso(now)
        by_type[update["type"]] = new
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(by_type.values(), key=lambda c: (order.get(c["type"], len(order)), c["type"]))


def degraded_conditions(reason: str, message: str, generation: int | None) -> list[dict[str, Any]]:
    """A spec the operator cannot serve, or a failure applying it."""
    return [
        condition("Degraded", True, reason, message, generation),
        condition("Ready", False, reason, message, generation),
        condition("Progressing", False, reason, "waiting for the spec to be fixed", generation),
        condition("ScalingActive", False, reason, "the autoscaler waits for a valid spec", generation),
    ]


def rollout_conditions(*, desired: int, ready: int, rollout_in_progress: bool, generation: int | None,
                       ) -> list[dict[str, Any]]:
    """Ready/Progressing/Degraded from the pods' state, for a healthy spec."""
    out = [condition("Degraded", False, "AsExpected", "spec is valid and owned objects are applied", generation)]
    if desired == 0:
        out.append(condition("Ready", False, "ScaledToZero", "replicas is 0", generation))
    elif ready >= desired and not rollout_in_progress:
        out.append(condition("Ready", True, "AllReplicasReady", f"{ready}/{desired} replicas ready", generation))
    elif ready > 0:
        out.append(condition("Ready", True, "Available", f"{ready}/{desired} replicas ready", generation))
    else:
        out.append(condition("Ready", False, "ReplicasNotReady", f"0/{desired} replicas ready", generation))
    if rollout_in_progress:
        out.append(condition("Progressing", True, "RollingOut", "pods from an older template are being replaced",
                             generation))
    elif ready != desired:
        out.append(condition("Progressing", True, "Scaling", f"{ready} ready, {desired} desired", generation))
    else:
        out.append(condition("Progressing", False, "Stable", f"{desired} replicas ready", generation))
    return out


def scaling_conditions(decision: Decision | None, *, enabled: bool, generation: int | None,
                       note: str = "") -> list[dict[str, Any]]:
    """`note` (e.g. why TP cannot be autoscaled) is appended to ScalingActive's message."""
    out = _scaling_conditions(decision, enabled=enabled, generation=generation)
    if note and enabled:
        out[0]["message"] = f"{out[0]['message']}; {note}"
    return out


def tp_note(spec: ServiceSpec, shape: ModelShape | None) -> str:
    """Why TP autoscaling, though enabled, cannot run: the model's shape is unknown."""
    return shape_unknown_message(spec) if spec.autoscaling.tensor.enabled and shape is None else ""


def _scaling_conditions(decision: Decision | None, *, enabled: bool, generation: int | None) -> list[dict[str, Any]]:
    if not enabled:
        return [condition("ScalingActive", False, "AutoscalingDisabled", "spec.autoscaling.enabled is false",
                          generation),
                condition("ScalingLimited", False, "AutoscalingDisabled", "", generation)]
    if decision is None:
        return [condition("ScalingActive", False, "WaitingForMetrics", "no signals scraped yet", generation)]
    out = [condition("ScalingActive", decision.metrics_available,
                     "ValidMetrics" if decision.metrics_available else "NoMetrics", decision.message, generation)]
    if decision.limited:
        out.append(condition("ScalingLimited", True, decision.limited, decision.limited_message, generation))
    else:
        out.append(condition("ScalingLimited", False, "DesiredWithinRange",
                             "the desired size is within the replica bounds", generation))
    return out


def decision_record(decision: Decision, now: dt.datetime) -> dict[str, Any]:
    return {
        "time": iso(now),
        "fromReplicas": decision.from_replicas,
        "toReplicas": decision.replicas,
        "fromTensorParallelSize": decision.from_tp,
        "toTensorParallelSize": decision.tp,
        "reason": decision.reason,
        "message": decision.message[:1024],
        "signals": decision.signals.as_status(),
    }


def append_decision(previous: Iterable[Mapping[str, Any]] | None, record: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [dict(r) for r in (previous or ())][-(MAX_DECISIONS - 1):] + [dict(record)]


def signal_fields(s: Signals) -> dict[str, Any]:
    """The printer-column fields; nothing when no pod had fresh signals (the last values stay)."""
    if not s.pods:
        return {}
    return {"kvCacheUtilizationPercent": int(round(100 * s.kv_cache_utilization)),
            "queueDepth": int(round(s.queue_depth)), "requestsRunning": int(round(s.requests_running))}


# status.model: what the pods' agents report about the model (agent field -> status field).
MODEL_FIELDS = {
    "architecture": "architecture", "model_type": "modelType", "num_layers": "numLayers",
    "hidden_size": "hiddenSize", "num_attention_heads": "numAttentionHeads", "num_kv_heads": "numKeyValueHeads",
    "head_dim": "headDim", "intermediate_size": "intermediateSize", "vocab_size": "vocabSize",
    "dtype": "dtype", "quantization": "quantization", "weight_bytes": "weightBytes", "format": "format",
}


def model_status(info: Mapping[str, Any], *, uri: str, pod: str, now: dt.datetime) -> dict[str, Any]:
    """status.model from one agent's `model` report, for the model `uri` the spec names.

    `config` (config.json's fields) is kept only when the shared capacity model can read a shape
    from it; otherwise `shapeError` says why, and TP planning keeps waiting for spec.model.config."""
    out: dict[str, Any] = {"uri": uri, "learnedFrom": pod, "learnedAt": iso(now)}
    for src, dst in MODEL_FIELDS.items():
        value = info.get(src)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            out[dst] = value
    config = info.get("config")
    if isinstance(config, Mapping):
        try:
            ModelShape.from_hf_config(config)
            out["config"] = dict(config)
        except (ValueError, TypeError) as error:
            out["shapeError"] = str(error)[:500]
    return out


def same_model(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two status.model records describe the same model (not who reported it, or when)."""
    def key(m):
        return {k: v for k, v in (m or {}).items() if k not in ("learnedFrom", "learnedAt")}

    return key(a) == key(b)


def learned_config(status: Mapping[str, Any] | None, uri: str) -> Mapping[str, Any] | None:
    """The config the agents reported for this very model `uri` (a spec pointing at another
    model must not be planned with the old one's shape), or None."""
    model = (status or {}).get("model")
    if not isinstance(model, Mapping) or model.get("uri") != uri:
        return None
    config = model.get("config")
    return config if isinstance(config, Mapping) else None


def replacing(old: Any, new: Any) -> Any:
    """A merge patch turning `old` into `new` exactly: keys `new` lacks are deleted (null)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return new
    out = {k: replacing(old.get(k), v) for k, v in new.items()}
    out.update({k: None for k in old if k not in new})
    return out
