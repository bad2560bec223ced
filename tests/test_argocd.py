"""The Argo CD health check, run by Lua 5.1 (what Argo CD's gopher-lua implements) on
InferenceServices shaped like the operator's status."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

lupa = pytest.importorskip("lupa.lua51")

ROOT = Path(__file__).resolve().parent.parent
HEALTH = ROOT / "deploy" / "argocd" / "health.lua"
KEY = "resource.customizations.health.kvserve.dev_InferenceService"


def health(obj: dict) -> dict:
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    # Argo CD runs the script as a chunk and reads the table it returns.
    result = lua.execute(HEALTH.read_text())
    return {"status": result["status"], "message": result["message"]}


def cond(type_: str, status: str, reason: str = "", message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "observedGeneration": 3, "lastTransitionTime": "2026-11-22T11:00:00Z"}


READY = {
    "apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "chat", "namespace": "ml", "generation": 3},
    "spec": {"model": {"uri": "hf://org/m"}},
    "status": {
        "observedGeneration": 3, "replicas": 2, "readyReplicas": 2, "desiredReplicas": 2,
        "tensorParallelSize": 2, "url": "http://chat.ml.svc:8000",
        "conditions": [cond("Ready", "True", "AllReplicasReady", "2/2 replicas ready"),
                       cond("Progressing", "False", "Stable"),
                       cond("Degraded", "False", "AsExpected"),
                       cond("ScalingActive", "True", "SignalsFresh"),
                       cond("ScalingLimited", "False", "WithinBounds")],
    },
}


def variant(**status_changes) -> dict:
    obj = copy.deepcopy(READY)
    conds = status_changes.pop("conditions", {})
    obj["status"].update(status_changes)
    obj["status"]["conditions"] = [conds.get(c["type"], c) for c in obj["status"]["conditions"]]
    return obj


def test_ready_is_healthy():
    assert health(READY) == {"status": "Healthy",
                             "message": "2 replicas ready, tensor-parallel 2"}


def test_rolling_out_a_new_tp_is_progressing_with_the_operators_message():
    obj = variant(conditions={"Progressing": cond(
        "Progressing", "True", "RollingUpdate", "rolling out tensor-parallel 2 -> 4 (1/2 updated)")})
    assert health(obj) == {"status": "Progressing",
                           "message": "rolling out tensor-parallel 2 -> 4 (1/2 updated)"}


def test_scaling_up_is_progressing_until_the_new_replicas_are_ready():
    obj = variant(replicas=4, readyReplicas=2, desiredReplicas=4)
    assert health(obj) == {"status": "Progressing", "message": "Scaling: 2/4 replicas ready"}


def test_degraded_carries_the_conditions_message_and_wins_over_everything():
    msg = "spec.parallelism.tensor.max: 4 does not divide num_attention_heads=6"
    obj = variant(readyReplicas=0, conditions={
        "Degraded": cond("Degraded", "True", "InvalidSpec", msg),
        "Ready": cond("Ready", "False", "InvalidSpec", msg),
        "Progressing": cond("Progressing", "True", "RollingUpdate", "x")})
    assert health(obj) == {"status": "Degraded", "message": msg}
    obj["status"]["conditions"][2]["message"] = ""
    assert health(obj) == {"status": "Degraded", "message": "InvalidSpec"}


def test_new_resource_and_unobserved_generation_are_progressing():
    fresh = copy.deepcopy(READY)
    del fresh["status"]
    assert health(fresh)["status"] == "Progressing"
    changed = copy.deepcopy(READY)
    changed["metadata"]["generation"] = 4
    assert health(changed) == {"status": "Progressing",
                               "message": "Waiting for the operator to observe generation 4"}


def test_not_ready_without_degraded_is_progressing_with_readys_message():
    obj = variant(readyReplicas=0, conditions={
        "Ready": cond("Ready", "False", "PodsStarting", "0/2 replicas ready: fetching model")})
    assert health(obj) == {"status": "Progressing", "message": "0/2 replicas ready: fetching model"}


def test_configmap_patch_embeds_the_same_script():
    cm = yaml.safe_load((ROOT / "deploy" / "argocd" / "argocd-cm-patch.yaml").read_text())
    assert cm["metadata"] == {"name": "argocd-cm", "namespace": "argocd"}
    assert cm["data"][KEY].strip() == HEALTH.read_text().strip()


def test_scaled_to_zero_is_healthy():
    obj = variant(replicas=0, readyReplicas=0, desiredReplicas=0, conditions={
        "Ready": cond("Ready", "False", "ScaledToZero", "replicas is 0"),
        "Progressing": cond("Progressing", "False", "Stable", "0 replicas ready")})
    assert health(obj) == {"status": "Healthy", "message": "Scaled to zero"}


@pytest.mark.parametrize("desired, ready, rolling, expected", [
    (2, 2, False, "Healthy"), (3, 2, False, "Progressing"), (2, 2, True, "Progressing"),
    (2, 0, False, "Progressing"), (0, 0, False, "Healthy"), (1, 3, False, "Progressing")])
def test_on_the_operators_own_conditions(desired, ready, rolling, expected):
    """The conditions come from the operator's pure status functions, not hand-written."""
    status = pytest.importorskip("kvserve.operator.status")
    conds = status.rollout_conditions(desired=desired, ready=ready, rollout_in_progress=rolling,
                                      generation=3)
    obj = copy.deepcopy(READY)
    obj["status"].update(replicas=max(desired, ready), readyReplicas=ready,
                         desiredReplicas=desired, conditions=conds)
    assert health(obj)["status"] == expected
    bad = copy.deepcopy(obj)
    bad["status"]["conditions"] = status.degraded_conditions(
        "InvalidSpec", "spec.runtime.engine: unknown engine 'tgi'", 3)
    assert health(bad) == {"status": "Degraded",
                           "message": "spec.runtime.engine: unknown engine 'tgi'"}
