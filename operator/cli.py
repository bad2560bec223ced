"""`kvserve-operator`: `run` the operator, or `plan` one autoscaling decision without a cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from . import kvcache as K
from . import netpol as N
from .autoscaler import AutoscalerState, Observation, decide, valid_degrees
from .spec import API_VERSION, KIND, SpecError, check_servable, parse_spec, shape_unknown_message


def _number(kind: type, low: float, high: float | None = None, *, open_low: bool = False):
    """An argparse type: a finite `kind` in range, else a usage error (exit 2) naming the bound."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if (value <= low if open_low else value < low) or (high is not None and value > high):
            bound = f"> {low:g}" if open_low else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}{f' and <= {high:g}' if high is not None else ''}"
                                             f", got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


POSITIVE_SECONDS = _number(float, 0, open_low=True)
POSITIVE_INT = _number(int, 1)
PORT = _number(int, 1, 65535)
PORT_OR_OFF = _number(int, 0, 65535)
METRICS_PORT = 8082  # 8080 is kopf's liveness endpoint, 8081 the agent contract port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve-operator",
                                     description="Kubernetes operator for kvserve InferenceServices")
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="reconcile InferenceServices (in-cluster config or KUBECONFIG)")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[],
                       help="namespace to serve (repeatable; globs allowed); default: the pod's own namespace")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="serve the whole cluster")
    run.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                     help="liveness endpoint URL, or '' to disable")
    run.add_argument("--metrics-port", type=PORT_OR_OFF, default=METRICS_PORT,
                     help="serve the operator's Prometheus metrics on this port at /metrics; 0 disables")
    run.add_argument("--peering", default="default",
                     help="kopf peering object name (one active operator among replicas)")
    run.add_argument("--standalone", action="store_true", help="no peering (a single operator)")
    run.add_argument("--priority", type=int, default=0, help="peering priority of this instance")
    run.add_argument("--scrape-interval", type=POSITIVE_SECONDS, default=15.0, help="autoscaler period, seconds")
    run.add_argument("--scrape-timeout", type=POSITIVE_SECONDS, default=3.0)
    run.add_argument("--scrape-concurrency", type=POSITIVE_INT, default=16)
    run.add_argument("--agent-port", type=PORT, default=8081)
    run.add_argument("--router-port", type=PORT, default=8000,
                     help="where router pods (spec.router) answer /router/demand")
    run.add_argument("--wake-interval", type=POSITIVE_SECONDS, default=2.0,
                     help="how often a service scaled to zero asks its router whether requests wait, seconds")
    run.add_argument("--max-sample-age", type=POSITIVE_SECONDS, default=10.0,
                     help="older agent samples count as stale (never drive a scale-down)")
    run.add_argument("--prometheus-url", default=None,
                     help="read kvserve_* signals from this Prometheus instead of scraping agents")
    run.add_argument("--operator-namespace", default=None,
                     help="namespace of the operator's own pods, which InferenceServices' NetworkPolicies "
                          "let reach the agents and routers (default: $POD_NAMESPACE, else the service "
                          "account's namespace, else kvserve-system)")
    run.add_argument("--verbose", "-v", action="store_true")

    plan = sub.add_parser("plan", help="print the autoscaler's decision for live agents or runtimes")
    plan.add_argument("--spec", required=True, help="InferenceService YAML (the whole object or its spec)")
    plan.add_argument("--metrics-url", action="append", required=True,
                      help="an agent (http://host:8081) or runtime (http://host:8000/metrics); repeatable, one per pod")
    plan.add_argument("--replicas", type=_number(int, 0), default=None, help="current replicas (default: one per URL)")
    plan.add_argument("--tp", type=POSITIVE_INT, default=None, help="current TP (default: what the pods report, else initial)")
    plan.add_argument("--steady", action="store_true",
                      help="treat the sample as steady for the whole windows (a scale-down may show)")
    plan.add_argument("--timeout", type=POSITIVE_SECONDS, default=5.0)
    return parser


def load_spec_file(path: str) -> dict[str, Any]:
    """The spec of an InferenceService file (the whole object, or a bare spec without kind)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except UnicodeDecodeError:
        raise SpecError("spec", f"{path} is not a text (UTF-8) file") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = ", ".join(filter(None, (getattr(error, "context", None), getattr(error, "problem", None)))) \
            or str(error).splitlines()[0]
        raise SpecError("spec", f"{path} is not valid YAML{where}: {problem}") from None
    if not isinstance(doc, dict):
        raise SpecError("spec", f"{path} does not hold a YAML mapping")
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if (kind, api_version) != (None, None) and (kind != KIND or api_version != API_VERSION):
        raise SpecError("kind", f"{path} is not an InferenceService: kind {kind!r}, apiVersion "
                                f"{api_version!r} (want kind {KIND!r}, apiVersion {API_VERSION!r})")
    if kind is not None:
        return doc["spec"] if isinstance(doc.get("spec"), dict) else {}
    return doc


async def _gather_signals(urls: Sequence[str], timeout: float):
    from .sources import fetch_url_signals

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async def one(i: int, url: str):
            try:
                return await fetch_url_signals(session, url, f"pod-{i}")
            except (TimeoutError, aiohttp.ClientError, ValueError) as error:
                print(f"kvserve-operator plan: {url}: {type(error).__name__}: {error}", file=sys.stderr)
                from .autoscaler import PodSignals

                return PodSignals(f"pod-{i}", ready=True, stale=True)

        return await asyncio.gather(*(one(i, u) for i, u in enumerate(urls)))


def plan(args: argparse.Namespace) -> int:
    from .handlers import shape_for

    try:
        spec = parse_spec(load_spec_file(args.spec))
        shape = shape_for(spec)
        check_servable(spec, shape)
    except (SpecError, OSError) as error:
        print(f"kvserve-operator plan: {error}", file=sys.stderr)
        return 2
    pods = asyncio.run(_gather_signals(args.metrics_url, args.timeout))
    reported = {p.tensor_parallel_size for p in pods if p.tensor_parallel_size}
    tp = args.tp if args.tp is not None else (reported.pop() if len(reported) == 1 else spec.tensor.initial)
    replicas = args.replicas if args.replicas is not None else len(pods)
    now = 1_000_000.0
    state = AutoscalerState(history_start=now - 86_400) if args.steady else AutoscalerState()
    decision = decide(spec, shape, Observation(now, replicas, tp, tuple(pods)), state)
    out = {
        "replicas": {"from": decision.from_replicas, "to": decision.replicas},
        "tensorParallelSize": {"from": decision.from_tp, "to": decision.tp},
        "reason": decision.reason,
        "message": decision.message,
        "scalingLimited": decision.limited,
        "signals": decision.signals.as_status(),
        "validTensorParallelDegrees": valid_degrees(spec, shape) if shape else None,
        **({} if shape else {"tensorParallelNote": shape_unknown_message(spec)}),
        **({"kvOffload": K.offload_plan(spec, shape, decision.tp)} if spec.runtime.kv_offload else {}),
        "pods": [{"name": p.name, "ready": p.ready, "stale": p.stale,
                  "kvCacheUtilization": p.kv_cache_utilization, "queueDepth": p.queue_depth,
                  "requestsRunning": p.requests_running, "tensorParallelSize": p.tensor_parallel_size}
                 for p in pods],
    }
    print(json.dumps(out, indent=2))
    return 0


def find_credentials(settings: Any) -> str | None:
    """Why `run` cannot log in (one line), or None when kopf will find credentials.

    kopf retries a failing login handler forever, so an operator with nothing to log in with
    would sit up and broken; checking the same sources first lets `run` exit instead. The result
    is not kept: the login handler reads them again, so a rotated token is picked up."""
    import kopf

    try:
        if kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError, kopf.LoginError) as error:
        detail = f"{type(error).__name__}: {error}".splitlines()[0]
        return f"cannot use the kubeconfig ({os.environ.get('KUBECONFIG') or '~/.kube/config'}): {detail}"
    return ("no Kubernetes credentials: no in-cluster service account "
            "(/var/run/secrets/kubernetes.io/serviceaccount/token), KUBECONFIG is unset and there is "
            "no ~/.kube/config")


SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def operator_namespace(flag: str | None, env: Mapping[str, str], own: str | None) -> str:
    """Where the operator runs: the flag, else $POD_NAMESPACE, else its service account's namespace
    (`own`, read from the pod's token mount), else the manifests' kvserve-system."""
    return flag or env.get("POD_NAMESPACE") or own or N.DEFAULT_OPERATOR_NAMESPACE


def run(args: argparse.Namespace) -> int:
    import kopf

    from .handlers import OperatorConfig, build_registry

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    config = OperatorConfig(scrape_interval=args.scrape_interval, scrape_timeout=args.scrape_timeout,
                            scrape_concurrency=args.scrape_concurrency, agent_port=args.agent_port,
                            max_sample_age=args.max_sample_age, prometheus_url=args.prometheus_url,
                            router_port=args.router_port, wake_interval=args.wake_interval)
    own = SERVICE_ACCOUNT_NAMESPACE.read_text().strip() if SERVICE_ACCOUNT_NAMESPACE.exists() else None
    config.operator_peer = N.OperatorPeer(namespace=operator_namespace(args.operator_namespace, os.environ, own))
    namespaces = list(args.namespace)
    if not namespaces and not args.all_namespaces:
        namespaces = [own] if own else ["default"]
    if not args.standalone:
        config.peering_name, config.namespaces = args.peering, tuple(namespaces)
        config.clusterwide = args.all_namespaces
    registry, reconciler = build_registry(config)
    settings = kopf.OperatorSettings()
    problem = find_credentials(settings)
    if problem:
        print(f"kvserve-operator run: {problem}", file=sys.stderr)
        return 1
    if args.metrics_port:
        try:
            reconciler.metrics.serve(args.metrics_port)
        except OSError as error:
            print(f"kvserve-operator run: cannot serve metrics on port {args.metrics_port}: {error}", file=sys.stderr)
            return 1
    settings.peering.name = args.peering
    settings.peering.priority = args.priority
    # With peering, only the highest-priority live instance handles resources; kopf pauses the
    # others (and every instance, if the KopfPeering CRD is missing: see crds/kopf-peering.yaml).
    settings.peering.mandatory = not args.standalone
    settings.peering.standalone = args.standalone
    # Plain namespace names need no namespace listing (and no RBAC for it).
    settings.scanning.disabled = not args.all_namespaces and not any(set("*?[") & set(n) for n in namespaces)
    asyncio.run(kopf.operator(
        registry=registry, settings=settings, standalone=args.standalone, priority=args.priority,
        peering_name=None if args.standalone else args.peering, clusterwide=args.all_namespaces,
        namespaces=[] if args.all_namespaces else namespaces,
        liveness_endpoint=args.liveness or None))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "plan":
        return plan(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
