"""The `kvserve` console script: `serve`, `worker`, `router`, `agent fetch|serve|drain|model-info|admin-token`.

Heavy imports (torch, the engine) happen inside the subcommand, so `kvserve agent ...` starts
fast in its own small container.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys


def _add_agent_parsers(sub) -> None:
    from kvserve.runtime.server.args import _bounded, add_admin_key_flags

    positive = _bounded(float, 1e-3)  # a zero or negative interval would scrape in a busy loop
    agent = sub.add_parser("agent", help="the sidecar agent").add_subparsers(dest="agent_cmd", required=True)

    f = agent.add_parser("fetch", help="put a model into a directory (hf://org/name[@rev] or a path)")
    f.add_argument("source")
    f.add_argument("dest")

    s = agent.add_parser("serve", help="scrape the engine and serve standardized signals")
    s.add_argument("--engine-url", default=os.environ.get("KVSERVE_ENGINE_URL", "http://127.0.0.1:8000"))
    s.add_argument("--engine", choices=["auto", "kvserve", "vllm", "sglang"], default="auto")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=_bounded(int, 0, 65535), default=8081)
    s.add_argument("--interval", type=positive, default=1.0, help="scrape interval, seconds")
    s.add_argument("--scrape-timeout", type=positive, default=2.0)
    s.add_argument("--stale-after", type=positive, default=5.0, help="sample age that counts as stale")
    s.add_argument("--drain-timeout", type=_bounded(float, 0.0, 3600.0), default=30.0,
                   help="longest a POST /drain waits for in-flight work (its ?timeout= can only shorten it)")
    add_admin_key_flags(s, role="agent")
    s.add_argument(
        "--tensor-parallel-size", type=_bounded(int, 1), default=None, help="reported for engines that do not export it"
    )
    s.add_argument("--model-dir", default=None,
                   help="the pod's model directory (fetch's DEST): its config is reported in /v1/signals as `model`")
    s.add_argument("--adapters-file", default=None, metavar="PATH",
                   help="JSON list of LoRA adapters [{name, uri}] to keep loaded in the runtime (re-read when it "
                        "changes): each is fetched into --adapters-dir and loaded with the admin key")
    s.add_argument("--adapters-dir", default="/adapters", metavar="DIR",
                   help="where adapters are fetched (the runtime must see them at the same path)")

    m = agent.add_parser("model-info", help="print what the agent reports about a model directory (JSON)")
    m.add_argument("model_dir")

    d = agent.add_parser("drain", help="ask the local agent to drain the engine (preStop hook)")
    d.add_argument("--agent-url", default="http://127.0.0.1:8081")
    d.add_argument("--timeout", type=_bounded(float, 0.0, 3600.0), default=30.0)
    add_admin_key_flags(d, role="client")

    t = agent.add_parser("admin-token", help="write a fresh random admin key to a file, mode 0400 "
                                             "(the pod's init step; pass the file as --admin-api-key-file)")
    t.add_argument("--out", required=True, metavar="PATH",
                   help="where to write it (its directory is created; an existing regular file is replaced)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve LLM runtime and sidecar agent")
    sub = parser.add_subparsers(dest="cmd", required=True)
    from kvserve.runtime.server.args import add_serve_parser

    add_serve_parser(sub)
    from kvserve.runtime.router.cli import add_router_parser

    add_router_parser(sub)
    _add_agent_parsers(sub)
    w = sub.add_parser("worker", help="a non-leader pod of a multi-node replica: runs only its ranks "
                                      "(LeaderWorkerSet's LWS_* variables; docs/pipeline-parallel.md)")
    w.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    w.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    return parser


def _agent_admin_key(args) -> str | None:
    """The admin key from the flags or environment (None: none configured). A configured key that
    cannot be used is a usage error (exit 2), as a bad flag value is."""
    from kvserve.runtime.server.auth import AdminKeyError, load_admin_key

    try:
        return load_admin_key(args.admin_api_key, args.admin_api_key_file)
    except AdminKeyError as exc:
        print(f"kvserve agent {args.agent_cmd}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _agent(args) -> int:
    if args.agent_cmd == "fetch":
        from kvserve.runtime.agent.fetch import FetchError, fetch

        try:
            print(json.dumps(fetch(args.source, args.dest)))
        except FetchError as exc:
            print(f"kvserve agent fetch: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.agent_cmd == "serve":
        from kvserve.runtime.agent.app import AgentConfig, serve

        admin_api_key = _agent_admin_key(args)
        return serve(
            AgentConfig(
                engine_url=args.engine_url,
                engine=args.engine,
                host=args.host,
                port=args.port,
                interval_s=args.interval,
                scrape_timeout_s=args.scrape_timeout,
                stale_after_s=args.stale_after,
                drain_timeout_s=args.drain_timeout,
                admin_api_key=admin_api_key,
                tensor_parallel_size=args.tensor_parallel_size,
                model_dir=args.model_dir,
                adapters_file=args.adapters_file,
                adapters_dir=args.adapters_dir,
                engine_api_key=os.environ.get("KVSERVE_ENGINE_API_KEY") or None,
            )
        )
    if args.agent_cmd == "model-info":
        from kvserve.runtime.agent.model_info import read_model_dir

        try:
            print(json.dumps(read_model_dir(args.model_dir)))
        except (OSError, ValueError) as exc:
            print(f"kvserve agent model-info: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.agent_cmd == "drain":
        from kvserve.runtime.agent.app import request_drain

        admin_api_key = _agent_admin_key(args)
        if admin_api_key is None:
            from kvserve.runtime.server.auth import HOW_TO_CONFIGURE

            print(f"kvserve agent drain: no admin key to send; {HOW_TO_CONFIGURE.replace('start it', 'run it')}",
                  file=sys.stderr)
            return 2
        try:
            result = asyncio.run(request_drain(args.agent_url, args.timeout, admin_api_key))
        except Exception as exc:  # preStop must say why, whatever broke
            print(f"kvserve agent drain: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(result))
        return 0 if result.get("drained") else 1
    if args.agent_cmd == "admin-token":
        from kvserve.runtime.server.auth import AdminKeyError, write_token_file

        try:
            path = write_token_file(args.out)
        except (AdminKeyError, OSError) as exc:
            print(f"kvserve agent admin-token: {exc}", file=sys.stderr)
            return 1
        print(json.dumps({"path": str(path)}))  # never the token itself: logs are widely readable
        return 0
    raise AssertionError(args.agent_cmd)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "serve" and args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.cmd == "agent":
        return _agent(args)
    if args.cmd == "worker":
        from kvserve.runtime.executor.node_worker import run_node

        return run_node(args.tensor_parallel_size, args.pipeline_parallel_size)
    if args.cmd == "router":
        from kvserve.runtime.router.cli import run_router

        return run_router(args)
    from kvserve.runtime.server.main import run_server

    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())
