"""Generate the derived deployment files from their single sources.

Sources and what is derived from them:
- crds/inferenceservices.kvserve.dev.yaml and crds/kopf-peering.yaml (the operator's)
  -> manifests/crds/ and charts/kvserve/files/crds/ (kustomize and Helm cannot read crds/)
- the dashboard defined below -> manifests/monitoring/dashboards/*.json and the chart's copy
- manifests/monitoring/prometheusrule.yaml (spec) -> charts/kvserve/files/prometheus-rules.yaml
- manifests/monitoring/kube-state-metrics-crs.yaml -> the chart's copy

`python scripts/gen_manifests.py` writes them; `--check` only reports drift (exit 1), which is
what tests/test_manifests.py runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kvserve"
CRD_FILE = "inferenceservices.kvserve.dev.yaml"
DASHBOARD_FILE = "kvserve-inferenceservice.json"

SEL = 'namespace="$namespace", inferenceservice="$inferenceservice"'


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": expr,
            "legendFormat": legend, "refId": ref, "range": True}


def _panel(pid: int, title: str, targets: list[tuple[str, str]], grid: tuple[int, int, int, int],
           unit: str = "short", kind: str = "timeseries", description: str = "",
           max_value: float | None = None) -> dict:
    x, y, w, h = grid
    defaults: dict = {"unit": unit}
    if max_value is not None:
        defaults.update(min=0, max=max_value)
    panel = {
        "id": pid, "type": kind, "title": title, "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "targets": [_target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(targets)],
    }
    if kind == "timeseries":
        panel["options"] = {"legend": {"displayMode": "list", "placement": "bottom"},
                            "tooltip": {"mode": "multi"}}
    return panel


def dashboard() -> dict:
    """One dashboard for one InferenceService at a time (template variables pick it)."""
    panels = [
        _panel(1, "Ready / desired replicas",
               [(f"kvserve_inferenceservice_ready_replicas{{{SEL}}}", "ready"),
                (f"kvserve_inferenceservice_desired_replicas{{{SEL}}}", "desired")],
               (0, 0, 6, 4), kind="stat"),
        _panel(2, "Tensor-parallel degree",
               [(f"kvserve_inferenceservice_tensor_parallel_size{{{SEL}}}", "TP")],
               (6, 0, 6, 4), kind="stat"),
        _panel(3, "KV-cache utilization (avg)",
               [(f"inferenceservice:kvserve_kv_cache_utilization:avg{{{SEL}}}", "avg")],
               (12, 0, 6, 4), unit="percentunit", kind="gauge", max_value=1),
        _panel(4, "Waiting requests",
               [(f"inferenceservice:kvserve_queue_depth:sum{{{SEL}}}", "queue")],
               (18, 0, 6, 4), kind="stat"),
        _panel(5, "Replicas and tensor-parallel degree",
               [(f"kvserve_inferenceservice_desired_replicas{{{SEL}}}", "desired replicas"),
                (f"kvserve_inferenceservice_ready_replicas{{{SEL}}}", "ready replicas"),
                (f"inferenceservice:kvserve_engine_up:sum{{{SEL}}}", "engines up (agents)"),
                (f"kvserve_inferenceservice_tensor_parallel_size{{{SEL}}}", "TP")],
               (0, 4, 24, 8),
               description="Scaling decisions show as annotations (changes of desired "
                           "replicas or TP); the reasons are in the resource's "
                           "status.decisions and its Events."),
        _panel(6, "KV-cache utilization per pod",
               [(f"kvserve_kv_cache_utilization{{{SEL}}}", "{{pod}}"),
                (f"inferenceservice:kvserve_kv_cache_utilization:avg{{{SEL}}}", "average")],
               (0, 12, 12, 8), unit="percentunit", max_value=1),
        _panel(7, "Queue depth (waiting requests)",
               [(f"kvserve_queue_depth{{{SEL}}}", "{{pod}}"),
                (f"inferenceservice:kvserve_queue_depth:sum{{{SEL}}}", "total")],
               (12, 12, 12, 8)),
        _panel(8, "Running requests",
               [(f"kvserve_requests_running{{{SEL}}}", "{{pod}}"),
                (f"inferenceservice:kvserve_requests_running:sum{{{SEL}}}", "total")],
               (0, 20, 12, 8)),
        _panel(9, "Tokens per second",
               [(f"sum(rate(kvserve_prompt_tokens_total{{{SEL}}}[$__rate_interval]))", "prompt"),
                (f"sum(rate(kvserve_generation_tokens_total{{{SEL}}}[$__rate_interval]))",
                 "generation")],
               (12, 20, 12, 8), unit="short"),
        _panel(10, "Time to first token",
               [(f"inferenceservice:vllm_time_to_first_token_seconds:p50{{{SEL}}}", "p50"),
                (f"inferenceservice:vllm_time_to_first_token_seconds:p99{{{SEL}}}", "p99")],
               (0, 28, 12, 8), unit="s"),
        _panel(11, "Inter-token latency",
               [(f"inferenceservice:vllm_inter_token_latency_seconds:p50{{{SEL}}}", "p50"),
                (f"inferenceservice:vllm_inter_token_latency_seconds:p99{{{SEL}}}", "p99")],
               (12, 28, 12, 8), unit="s"),
        _panel(12, "Preemptions per second",
               [(f"sum by (pod) (rate(vllm:num_preemptions_total{{{SEL}}}[$__rate_interval]))",
                 "{{pod}}")],
               (0, 36, 12, 8)),
        _panel(13, "Prefix-cache hit rate",
               [(f"inferenceservice:vllm_prefix_cache_hit_ratio:rate5m{{{SEL}}}", "hit rate")],
               (12, 36, 12, 8), unit="percentunit", max_value=1),
        _panel(14, "Engine step time by phase (mean per step)",
               [(f"sum by (phase) (rate(kvserve:step_duration_seconds_sum{{{SEL}}}[$__rate_interval]))"
                 f" / sum by (phase) (rate(kvserve:step_duration_seconds_count{{{SEL}}}[$__rate_interval]))",
                 "{{phase}}")],
               (0, 44, 14, 8), unit="s",
               description="schedule, prepare (inputs), forward (model), sample, output (detokenize, "
                           "outputs): a regression in one phase shows here first."),
        _panel(22, "Weights per pod (format, dtype, KV cache dtype)",
               [(f"max by (pod, quantization, dtype, kv_cache_dtype) (kvserve:model_weight_bytes{{{SEL}}}"
                 f" * on (namespace, pod) group_left (quantization, dtype, kv_cache_dtype) "
                 f"kvserve:model_info{{{SEL}}})",
                 "{{pod}}: {{quantization}}, {{dtype}}, KV {{kv_cache_dtype}}")],
               (14, 44, 10, 8), unit="bytes",
               description="Weight bytes each runtime holds (per tensor-parallel rank), labelled with the "
                           "weight format (none, int8, awq, gguf, ...), compute dtype and KV cache dtype it "
                           "actually runs: a rollout that changes spec.runtime.quantization shows here."),
        # spec.parallelism.devicesPerPod (docs/reshape.md): each pod's live DP x TP layout.
        _panel(23, "Parallel layout per pod (data-parallel engines x tensor-parallel ranks)",
               [(f"max by (pod) (kvserve:data_parallel_size{{{SEL}}})", "{{pod}} DP"),
                (f"max by (pod) (kvserve:tensor_parallel_size{{{SEL}}})", "{{pod}} TP"),
                (f"sum(increase(kvserve:reshape_seconds_sum{{{SEL}}}[$__rate_interval])) / "
                 f"sum(increase(kvserve:reshape_seconds_count{{{SEL}}}[$__rate_interval]))", "reshape time (s)")],
               (0, 77, 24, 8),
               description="Layouts over time: with spec.parallelism.devicesPerPod the operator changes each "
                           "pod's layout in place (more DP at high load, higher TP at low load); each change "
                           "is a ReshapedInPlace Event, its duration kvserve:reshape_seconds."),
        # spec.adapters (docs/lora.md): empty for services without LoRA adapters.
        _panel(24, "LoRA adapters: requests per second by adapter",
               [(f"sum by (lora_name) (rate(kvserve:lora_requests_total{{{SEL}}}[$__rate_interval]))",
                 "{{lora_name}}")],
               (0, 85, 24, 8), unit="reqps",
               description="Which adapters are hot (kvserve:lora_requests_total, one series per loaded adapter); "
                           "vllm:lora_requests_info names the adapters running and waiting right now."),
        # spec.router (docs/router.md): empty for services without a router.
        {"id": 15, "type": "row", "title": "Router", "collapsed": False,
         "gridPos": {"x": 0, "y": 52, "w": 24, "h": 1}, "panels": []},
        _panel(16, "Router: requests by decision",
               [(f"sum by (decision) (rate(kvserve_router_requests_total{{{SEL}}}[$__rate_interval]))",
                 "{{decision}}")],
               (0, 53, 12, 8), unit="reqps",
               description="prefix-hit: sent to the pod holding most of the prompt; prefix-new: placed by "
                           "bounded consistent hashing; overloaded-fallback: the best pod was over its queue "
                           "or KV threshold."),
        _panel(17, "Router: requests by pod",
               [(f"sum by (upstream) (rate(kvserve_router_requests_total{{{SEL}}}[$__rate_interval]))",
                 "{{upstream}}")],
               (12, 53, 12, 8), unit="reqps"),
        _panel(18, "Router: prefix match (routed chunks the chosen pod had served)",
               [(f"sum(rate(kvserve_router_prefix_matched_chunks_total{{{SEL}}}[$__rate_interval])) / "
                 f"sum(rate(kvserve_router_prefix_query_chunks_total{{{SEL}}}[$__rate_interval]))", "match")],
               (0, 61, 8, 8), unit="percentunit", max_value=1),
        _panel(19, "Router: held requests (scale from zero)",
               [(f"sum(kvserve_router_held_requests{{{SEL}}})", "held now"),
                (f"histogram_quantile(0.99, sum by (le) (rate(kvserve_router_hold_seconds_bucket{{{SEL}}}"
                 f"[$__rate_interval])))", "hold time p99 (s)")],
               (8, 61, 8, 8)),
        _panel(20, "Router: retries by reason",
               [(f"sum by (reason) (rate(kvserve_router_retries_total{{{SEL}}}[$__rate_interval]))",
                 "{{reason}}")],
               (16, 61, 8, 8), unit="reqps",
               description="Requests sent to another pod after one refused before the first byte."),
        _panel(21, "Router: upstream time to first byte",
               [(f"histogram_quantile(0.5, sum by (le) (rate(kvserve_router_upstream_ttft_seconds_bucket{{{SEL}}}"
                 f"[$__rate_interval])))", "p50"),
                (f"histogram_quantile(0.99, sum by (le) (rate(kvserve_router_upstream_ttft_seconds_bucket"
                 f"{{{SEL}}}[$__rate_interval])))", "p99")],
               (0, 69, 24, 8), unit="s"),
    ]
    ds = {"type": "prometheus", "uid": "${datasource}"}
    annotations = [
        {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
         "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
         "type": "dashboard"},
        {"datasource": ds, "enable": True, "iconColor": "orange", "name": "Replica decisions",
         "expr": f"changes(kvserve_inferenceservice_desired_replicas{{{SEL}}}[2m]) > 0",
         "step": "30s", "titleFormat": "replicas changed",
         "textFormat": "desired replicas changed (reasons: kubectl describe isvc)"},
        {"datasource": ds, "enable": True, "iconColor": "purple", "name": "TP decisions",
         "expr": f"changes(kvserve_inferenceservice_tensor_parallel_size{{{SEL}}}[2m]) > 0",
         "step": "30s", "titleFormat": "tensor-parallel degree changed",
         "textFormat": "TP changed: rolling update of the pod template"},
    ]
    templating = [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        {"name": "namespace", "label": "Namespace", "type": "query", "datasource": ds,
         "query": {"query": "label_values(kvserve_engine_up, namespace)", "refId": "ns"},
         "definition": "label_values(kvserve_engine_up, namespace)",
         "refresh": 2, "sort": 1, "current": {}, "hide": 0},
        {"name": "inferenceservice", "label": "InferenceService", "type": "query",
         "datasource": ds,
         "query": {"query": 'label_values(kvserve_engine_up{namespace="$namespace"}, '
                            "inferenceservice)", "refId": "isvc"},
         "definition": 'label_values(kvserve_engine_up{namespace="$namespace"}, inferenceservice)',
         "refresh": 2, "sort": 1, "current": {}, "hide": 0},
    ]
    return {
        "uid": "kvserve-inferenceservice", "title": "kvserve / InferenceService",
        "description": "One kvserve InferenceService: autoscaling, KV cache, queue, latency.",
        "tags": ["kvserve", "llm"], "editable": True, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "browser",
        "graphTooltip": 1, "annotations": {"list": annotations},
        "templating": {"list": templating}, "panels": panels, "links": [],
    }


def dashboard_text() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=False) + "\n"


def rules_text() -> str:
    rule = yaml.safe_load((ROOT / "manifests/monitoring/prometheusrule.yaml").read_text())
    header = ("# Generated by scripts/gen_manifests.py from manifests/monitoring/prometheusrule.yaml;"
              " do not edit.\n")
    return header + yaml.safe_dump(rule["spec"], sort_keys=False, width=100)


def ksm_text() -> str:
    cm = yaml.safe_load((ROOT / "manifests/monitoring/kube-state-metrics-crs.yaml").read_text())
    return cm["data"]["custom-resource-state.yaml"]


def outputs() -> dict[Path, str]:
    """Every derived file and the content it must have."""
    out: dict[Path, str] = {}
    crd_src = ROOT / "crds" / CRD_FILE
    if not crd_src.exists():
        raise SystemExit(f"{crd_src} is missing: the operator's CRD is the source of truth")
    crd = crd_src.read_text()
    peering = (ROOT / "crds/kopf-peering.yaml").read_text()
    out[ROOT / "manifests/crds" / CRD_FILE] = crd
    out[ROOT / "manifests/crds/kopf-peering.yaml"] = peering
    out[CHART / "files/crds" / CRD_FILE] = crd
    # One CRD per file: the chart parses each with fromYaml, which reads a single document.
    for doc in yaml.safe_load_all(peering):
        out[CHART / "files/crds" / f'{doc["metadata"]["name"]}.yaml'] = yaml.safe_dump(
            doc, sort_keys=False)
    dash = dashboard_text()
    out[ROOT / "manifests/monitoring/dashboards" / DASHBOARD_FILE] = dash
    out[CHART / "files/dashboards" / DASHBOARD_FILE] = dash
    out[CHART / "files/prometheus-rules.yaml"] = rules_text()
    out[CHART / "files/kube-state-metrics-crs.yaml"] = ksm_text()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report drift, write nothing")
    args = parser.parse_args(argv)
    drift = []
    for path, text in outputs().items():
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            drift.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if drift:
        print("out of date (run `make manifests`): " + ", ".join(drift), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
