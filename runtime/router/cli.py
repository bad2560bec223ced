"""`kvserve router` flags and entry point. No heavy imports (no torch): the router is a small process."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .kv_index import KVIndexConfig
from .policy import POLICIES, PolicyConfig


def add_router_parser(sub) -> argparse.ArgumentParser:
    from kvserve.runtime.server.args import LOG_LEVELS, _bounded

    p = sub.add_parser("router", help="cache-aware router in front of runtime pods (holds requests at zero)",
                       description="Routes OpenAI requests to the pods of one InferenceService (watched through "
                                   "the Kubernetes API) or to fixed URLs. See docs/router.md.")
    where = p.add_argument_group("pods (one of --endpoints or --inferenceservice/--selector)")
    where.add_argument("--endpoints", default=None, metavar="URL[,URL...]",
                       help="fixed runtime URLs, e.g. http://10.0.0.5:8000,http://10.0.0.6:8000")
    where.add_argument("--inferenceservice", default=None, metavar="NAME",
                       help="route to the Ready pods of this InferenceService (its pod labels)")
    where.add_argument("--selector", default=None, metavar="K=V[,K=V...]",
                       help="route to the Ready pods with these labels instead")
    where.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE") or None,
                       help="namespace of the pods (default: $POD_NAMESPACE, else the service account's)")
    where.add_argument("--runtime-port", type=_bounded(int, 1, 65535), default=8000,
                       help="the pods' OpenAI port")
    where.add_argument("--agent-port", type=_bounded(int, -1, 65535), default=8081,
                       help="where each pod's agent serves /v1/signals (load); 0: read the runtime's /metrics; "
                            "-1: no load signals (the router's own in-flight counts only)")

    pol = p.add_argument_group("policy")
    pol.add_argument("--policy", choices=POLICIES, default="prefix",
                     help="prefix (default): longest cached prefix, bounded consistent hashing for new ones; "
                          "least-load; round-robin")
    d = PolicyConfig()
    pol.add_argument("--block-size", type=_bounded(int, 1), default=d.block_tokens,
                     help="chunk size for token-id prompts (the runtime's KV block size)")
    pol.add_argument("--chunk-chars", type=_bounded(int, 1), default=d.chunk_chars,
                     help="chunk size for text prompts and chat messages, in characters")
    pol.add_argument("--balance-factor", type=_bounded(float, 1.0), default=d.balance_factor,
                     help="bounded load: a pod takes a new prefix only below this x the mean in-flight count")
    pol.add_argument("--max-queue-depth", type=_bounded(float, 0.0), default=d.max_queue_depth,
                     help="a pod with more waiting requests than this loses its prefix affinity")
    pol.add_argument("--max-kv-utilization", type=_bounded(float, 0.01, 1.0), default=d.max_kv_utilization,
                     help="... or with more KV-cache use than this (0..1)")
    pol.add_argument("--prefix-margin", type=_bounded(float, 0.01, 1.0), default=d.prefix_margin,
                     help="a pod wins a request by what it holds only with this fraction of the prompt more than "
                          "the pod a new prompt would get (and as much more once load counts)")
    pol.add_argument("--load-weight", type=_bounded(float, 0.0, 1.0), default=d.load_weight,
                     help="what each request a pod carries costs it, in fractions of the prompt's prefill")
    pol.add_argument("--prefix-ttl", type=_bounded(float, 1.0), default=d.prefix_ttl_seconds,
                     help="seconds a pod counts as holding a prefix it served")
    pol.add_argument("--session-ttl", type=_bounded(float, 1.0), default=d.session_ttl_seconds,
                     help="seconds a conversation not continued still counts as kept by its pod (new "
                          "conversations spread by these counts)")

    ev = p.add_argument_group("KV events (precise prefix routing; docs/kv-events.md)")
    ev.add_argument("--kv-events-port", type=_bounded(int, 0, 65534), default=0, metavar="PORT",
                    help="follow each pod's KV events (vLLM's ZMQ publisher) at this port, its replay socket at "
                         "PORT+1; a pod's kvserve.dev/kv-events-port annotation overrides it. The prefix policy "
                         "then ranks a pod by the blocks it holds, falling back to what it served while its "
                         "events are missing or lagging. 0 (default): only pods with the annotation")
    ev.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                    help="follow no pod's KV events, annotation or not: rank by what each pod served only")
    ev.add_argument("--kv-events-topic", default="", help="the publishers' topic (their kv_events_config.topic)")
    ev.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="the model's tokenizer (a Hugging Face directory), so text and chat prompts hash to the "
                         "pods' block hashes; without it only token-id prompts do")
    ev.add_argument("--kv-events-max-blocks", type=_bounded(int, 1), default=KVIndexConfig().max_blocks_per_pod,
                    metavar="N", help="block hashes remembered per pod (oldest forgotten first)")
    ev.add_argument("--kv-events-lag", type=_bounded(float, 0.1), default=KVIndexConfig().lag_seconds,
                    metavar="S", help="a pod sent a request this long ago with no event since is lagging")
    ev.add_argument("--kv-events-medium-weights", default="GPU=1,CPU=0.8,DISK=0.5", metavar="M=W[,M=W...]",
                    help="what a held block is worth by medium: the pool (GPU), an offload tier (CPU, DISK)")

    hold = p.add_argument_group("holding requests while no pod is ready (scale from zero)")
    hold.add_argument("--hold-timeout", type=_bounded(float, 0.0, 86400.0), default=300.0,
                      help="seconds a request waits for a ready pod before a 503 with Retry-After")
    hold.add_argument("--max-held", type=_bounded(int, 0), default=1024,
                      help="requests held at most; more get a 503 at once")
    hold.add_argument("--max-held-bytes", type=_bounded(int, 0), default=None, metavar="BYTES",
                      help="bytes of request bodies held at most (checked from Content-Length before a body is "
                           "read); more get a 503 at once. Default: a quarter of the container's memory limit "
                           "(cgroup), else 128 MiB")

    access = p.add_argument_group("who may call (checked before a request body is read)")
    access.add_argument("--api-key", default=None, metavar="KEY[,KEY...]",
                        help="require `Authorization: Bearer KEY` (any of the comma-separated keys) on every "
                             "forwarded route and /v1/models (or set KVSERVE_API_KEY; the same key as the "
                             "pods', forwarded unchanged). A request without one gets 401 and is never held")
    p.add_argument("--max-attempts", type=_bounded(int, 1, 16), default=3,
                   help="pods tried per request when they refuse before the first byte")
    p.add_argument("--served-model-name", default=None,
                   help="the model /v1/models lists while no pod is ready")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_bounded(int, 0, 65535), default=8000, help="0: a free port")
    p.add_argument("--drain-timeout", type=_bounded(float, 0.0, 3600.0), default=30.0,
                   help="seconds SIGTERM waits for open streams")
    p.add_argument("--max-request-body-bytes", type=_bounded(int, 1), default=None, metavar="BYTES",
                   help="one request body at most; bigger ones get 413 (from Content-Length, before reading). "
                        "Default: 8 MiB, or a sixteenth of the container's memory limit when that is less")
    p.add_argument("--max-buffered-bytes", type=_bounded(int, 0), default=None, metavar="BYTES",
                   help="request bodies in the router's memory at once, held or being forwarded; past it 503 "
                        "with Retry-After. Default: half the container's memory limit, else 256 MiB")
    p.add_argument("--max-connections", type=_bounded(int, 1), default=None, metavar="N",
                   help="open client connections at most; past it new ones are closed at once. Default: one "
                        "per 64 KiB of the container's memory limit (8192 at 512 MiB)")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    return p


def _selector(text: str) -> dict[str, str]:
    out = {}
    for term in (t.strip() for t in text.split(",")):
        if not term:
            continue
        key, eq, value = term.partition("=")
        if not eq or not key:
            raise ValueError(f"selector: {term!r} is not key=value")
        out[key.strip()] = value.strip()
    if not out:
        raise ValueError("selector: empty")
    return out


def _service_account_namespace() -> str | None:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or None
    except OSError:
        return None


def build_source(args: argparse.Namespace):
    """The endpoint source the flags describe; ValueError with the flag's name when they do not."""
    from .endpoints import KubeEndpoints, StaticEndpoints, inferenceservice_selector, parse_endpoints

    agent_port = None if args.agent_port == -1 else args.agent_port
    kube = args.inferenceservice or args.selector
    if args.endpoints is not None and kube:
        raise ValueError("--endpoints cannot be combined with --inferenceservice/--selector")
    events_port = args.kv_events_port or None
    if args.endpoints is not None:
        return StaticEndpoints(parse_endpoints(args.endpoints, agent_port=agent_port, events_port=events_port))
    if not kube:
        raise ValueError("no pods to route to: give --endpoints URL[,URL...] or --inferenceservice NAME "
                         "(or --selector K=V)")
    selector = _selector(args.selector) if args.selector else inferenceservice_selector(args.inferenceservice)
    namespace = args.namespace or _service_account_namespace()
    if not namespace:
        raise ValueError("--namespace is required outside a pod (no $POD_NAMESPACE, no service account)")
    return KubeEndpoints(namespace, selector, runtime_port=args.runtime_port, agent_port=agent_port,
                         events_port=events_port)


def medium_weights(text: str) -> dict[str, float]:
    out = {}
    for term in (t.strip() for t in text.split(",") if t.strip()):
        medium, eq, weight = term.partition("=")
        try:
            out[medium.strip().upper()] = float(weight)
        except ValueError:
            raise ValueError(f"--kv-events-medium-weights: {term!r} is not MEDIUM=WEIGHT") from None
        if not eq or not medium.strip():
            raise ValueError(f"--kv-events-medium-weights: {term!r} is not MEDIUM=WEIGHT")
    return out


def kv_index_config(args: argparse.Namespace) -> KVIndexConfig | None:
    """The event index's settings; None when the policy cannot use one (the flags then do nothing).
    Pods are followed when --kv-events-port is set or they carry the annotation."""
    if args.policy != "prefix" or not args.kv_events:
        return None
    try:
        return KVIndexConfig(max_blocks_per_pod=args.kv_events_max_blocks, lag_seconds=args.kv_events_lag,
                             medium_weights=medium_weights(args.kv_events_medium_weights))
    except ValueError as error:
        raise ValueError(f"--kv-events-medium-weights: {error}") from None


def config_from_args(args: argparse.Namespace, memory_limit: int | None = None):
    """The RouterConfig the flags describe; byte limits not given follow `memory_limit`
    (the container's, limits.py). ValueError naming the flag when they do not fit."""
    from .access import parse_api_keys
    from .app import RouterConfig
    from .limits import BodyLimits, prefix_index_capacity

    derived = BodyLimits.for_memory(memory_limit)
    keys = args.api_key if args.api_key is not None else os.environ.get("KVSERVE_API_KEY")
    try:
        api_keys = parse_api_keys(keys)
    except ValueError as error:
        raise ValueError(f"--api-key / KVSERVE_API_KEY: {str(error).removeprefix('api-key: ')}") from None
    policy = PolicyConfig(policy=args.policy, block_tokens=args.block_size, chunk_chars=args.chunk_chars,
                          balance_factor=args.balance_factor, max_queue_depth=args.max_queue_depth,
                          max_kv_utilization=args.max_kv_utilization, prefix_ttl_seconds=args.prefix_ttl,
                          session_ttl_seconds=args.session_ttl,
                          prefix_margin=args.prefix_margin, load_weight=args.load_weight,
                          index_capacity=prefix_index_capacity(memory_limit))
    def pick(flag: str | None, default: int) -> int:
        return default if flag is None else flag

    return RouterConfig(policy=policy, hold_timeout_s=args.hold_timeout, max_held=args.max_held,
                        max_attempts=args.max_attempts, served_model_name=args.served_model_name,
                        max_request_body_bytes=pick(args.max_request_body_bytes, derived.max_request_body_bytes),
                        max_held_bytes=pick(args.max_held_bytes, derived.max_held_bytes),
                        max_buffered_bytes=pick(args.max_buffered_bytes, derived.max_buffered_bytes),
                        api_keys=api_keys, kv_index=kv_index_config(args), kv_events_topic=args.kv_events_topic,
                        tokenizer=args.tokenizer)


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvserve.router")
    from .limits import container_memory_limit

    memory_limit = container_memory_limit()
    try:
        source = build_source(args)
        config = config_from_args(args, memory_limit)
    except ValueError as error:
        print(f"kvserve router: {error}", file=sys.stderr)
        return 2
    import asyncio

    from .app import build_app
    from .limits import max_connections_for_memory
    from .serve import serve

    max_connections = args.max_connections or max_connections_for_memory(memory_limit)
    try:
        app = build_app(config, source)  # loads --tokenizer
    except ValueError as error:
        print(f"kvserve router: {error}", file=sys.stderr)
        return 2
    log.info("router on http://%s:%d, policy %s, pods from %s", args.host, args.port, args.policy,
             args.endpoints or f"{getattr(source, 'namespace', '')}/{args.inferenceservice or args.selector}")
    log.info("API key %s; request bodies: %d bytes each, %d held, %d buffered at most (memory limit %s)",
             f"required ({len(config.api_keys)} accepted)" if config.api_keys else "not checked (the pods check it)",
             config.max_request_body_bytes, config.max_held_bytes, config.max_buffered_bytes,
             f"{memory_limit} bytes" if memory_limit else "not set, sized for 512 MiB")
    log.info("at most %d client connections", max_connections)
    try:
        asyncio.run(serve(app, host=args.host, port=args.port, max_connections=max_connections,
                          shutdown_timeout=args.drain_timeout))
    except OSError as error:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, error.strerror or error)
        return 1
    return 0
