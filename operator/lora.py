"""Multi-LoRA serving (spec.adapters, spec.lora): what it adds to a service's objects, and its
status. Pure.

The adapter list reaches the pods through a ConfigMap (`<name>-adapters`) mounted into the agent,
not through the pod template: the kubelet rewrites a mounted ConfigMap in place, the agent
(runtime/agent/adapters.py) notices, fetches what is new beside the model and loads or unloads
it through the runtime's admin routes. So adding or removing an adapter never restarts a pod; only
turning LoRA on or off, or changing its limits (runtime flags), rolls the Deployment.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .spec import ServiceSpec

ADAPTERS_DIR = "/adapters"  # fetched adapters: written by the agent, read by the runtime (same path)
LIST_DIR = "/etc/kvserve/adapters"  # the ConfigMap
LIST_KEY = "adapters.json"
LIST_FILE = f"{LIST_DIR}/{LIST_KEY}"
# Adapters are small next to their model (rank 16 on an 8B model: ~50 MB); a wrong uri pointing
# at a whole model must fill this volume, not the node's disk.
ADAPTERS_SIZE_LIMIT = "16Gi"
CONDITION = "AdaptersReady"
# The key the agent shows the engine's LoRA routes when they are not behind the admin key (vLLM).
ENGINE_API_KEY_ENV = "KVSERVE_ENGINE_API_KEY"


def configmap_name(name: str) -> str:
    return f"{name}-adapters"


def adapter_list(spec: ServiceSpec) -> str:
    """The ConfigMap's one key: what the agent keeps loaded (runtime/agent/adapters.parse_desired)."""
    return json.dumps([{"name": a.name, "uri": a.uri} for a in spec.adapters], indent=1)


def build_configmap(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    from .manifests import _metadata

    name, namespace = owner["metadata"]["name"], owner["metadata"].get("namespace", "default")
    meta = _metadata(name, namespace, owner)
    meta["name"] = configmap_name(name)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {LIST_KEY: adapter_list(spec)}}


def runtime_args(spec: ServiceSpec) -> list[str]:
    """vLLM's flags (kvserve serve takes the same). No --lora-modules: the agent loads the list
    once the runtime is up, so that one bad adapter is a status condition, not a crash loop."""
    if not spec.lora.enabled:
        return []
    lo = spec.lora
    return ["--enable-lora", "--max-loras", str(lo.max_loras), "--max-lora-rank", str(lo.max_lora_rank),
            "--max-cpu-loras", str(lo.max_cpu_loras)]


def runtime_env(spec: ServiceSpec) -> list[dict[str, str]]:
    # vLLM serves /v1/load_lora_adapter only with this set.
    if spec.lora.enabled and spec.runtime.engine == "vllm":
        return [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}]
    return []


def agent_env(spec: ServiceSpec, env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent fetches adapters: its Hugging Face cache must be writable (the models volume is
    read-only there), and a private hub repo needs the token, which then reaches this one serving
    container too (only with adapters). It loads them: on vLLM with an API key, with that key."""
    if not spec.lora.enabled:
        return env
    out = [{"name": "HF_HOME", "value": f"{ADAPTERS_DIR}/.hf-home"} if e.get("name") == "HF_HOME" else e
           for e in env]
    if spec.model.hf_token_secret and not any(e.get("name") == "HF_TOKEN" for e in out):
        name, key = spec.model.hf_token_secret
        out.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    # vLLM has no admin key: with an API key its load/unload routes want the user key, so the agent
    # gets it from the same Secret (never as a plain value in the pod template).
    if spec.runtime.engine == "vllm" and spec.runtime.api_key_secret:
        name, key = spec.runtime.api_key_secret
        out.append({"name": ENGINE_API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    return out


def agent_args(spec: ServiceSpec) -> list[str]:
    if not spec.lora.enabled:
        return []
    return ["--adapters-file", LIST_FILE, "--adapters-dir", ADAPTERS_DIR]


def volumes(name: str, spec: ServiceSpec) -> list[dict[str, Any]]:
    if not spec.lora.enabled:
        return []
    return [{"name": "adapters", "emptyDir": {"sizeLimit": ADAPTERS_SIZE_LIMIT}},
            {"name": "adapter-list", "configMap": {"name": configmap_name(name)}}]


def runtime_mounts(spec: ServiceSpec) -> list[dict[str, Any]]:
    return [{"name": "adapters", "mountPath": ADAPTERS_DIR, "readOnly": True}] if spec.lora.enabled else []


def agent_mounts(spec: ServiceSpec) -> list[dict[str, Any]]:
    if not spec.lora.enabled:
        return []
    return [{"name": "adapters", "mountPath": ADAPTERS_DIR},
            {"name": "adapter-list", "mountPath": LIST_DIR, "readOnly": True}]


# --- status -----------------------------------------------------------------------------------

def _names(value: Any) -> list[str]:
    return sorted(v for v in value if isinstance(v, str))[:256] if isinstance(value, list) else []


def pod_status(pod: str, report: Mapping[str, Any]) -> dict[str, Any]:
    """One pod's entry of status.adapters, from its agent's `adapters` report."""
    failed = report.get("failed") if isinstance(report.get("failed"), Mapping) else {}
    return {"pod": pod, "loaded": _names(report.get("loaded")), "pending": _names(report.get("pending")),
            "failed": [{"name": str(n), "message": str(m)[:1024]} for n, m in sorted(failed.items())[:256]]}


def adapters_status(reports: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [pod_status(pod, reports[pod]) for pod in sorted(reports)]


def failures(entries: list[dict[str, Any]]) -> dict[str, str]:
    """adapter -> why it failed (on the first pod, by name, that says so)."""
    out: dict[str, str] = {}
    for entry in entries:
        for f in entry["failed"]:
            out.setdefault(f["name"], f"{entry['pod']}: {f['message']}")
    return out


def condition_fields(spec: ServiceSpec, entries: list[dict[str, Any]]) -> tuple[bool, str, str] | None:
    """(status, reason, message) of the AdaptersReady condition; None without LoRA."""
    if not spec.lora.enabled:
        return None
    if not spec.adapters:
        return True, "NoAdapters", "LoRA is on; spec.adapters lists none"
    failed = failures(entries)
    if failed:
        listed = "; ".join(f"{n}: {m}" for n, m in sorted(failed.items()))
        return False, "AdapterFailed", f"{len(failed)} of {len(spec.adapters)} adapters failed: {listed}"[:4096]
    want = {a.name for a in spec.adapters}
    if not entries:
        return False, "WaitingForPods", "no ready pod has reported its adapters yet"
    missing = sorted({e["pod"] for e in entries if not want <= set(e["loaded"])})
    if missing:
        return False, "Loading", f"pods still loading adapters: {', '.join(missing)}"
    return True, "AllLoaded", f"{len(want)} adapters loaded on {len(entries)} pods"
