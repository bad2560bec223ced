"""Routing benchmark, two parts on one set of pods: the event-fed router's --load-weight x
--prefix-margin, and what KV events add when several router replicas share the traffic.

    python bench/router_sweep.py                        # both parts, SmolLM2-135M, 3 pods
    python bench/router_sweep.py --skip-replicas --rounds 4
    python bench/router_sweep.py --skip-sweep           # the router-replica case only
    python bench/router_sweep.py --configs 0.1:0.1,0:0.1,0.3:0.1   # load_weight:prefix_margin pairs

What runs: `--replicas` real `kvserve serve` processes publishing KV events, their Pods in the
Kubernetes API emulator, and real routers watching it (as bench/router_events.py).

1. Sweep: a round-robin router and one event-fed router per (load_weight, prefix_margin) pair,
   in alternating rounds (bench/router_common.py) of bench/router.py's multi-turn chat. Prints
   TTFT p50/p90, hit rate and round-robin / config TTFT p50 per config.
2. Router replicas: two replicas behind a load balancer (each turn of a conversation goes to the
   other replica, as a round-robin Service would send it). Served-based replicas each know only
   the turns they forwarded, so a turn is often placed without its history; event-fed replicas
   each follow every pod's events and place every turn by the blocks pods hold. Also round-robin.

Writes bench/results/router_sweep.json (or --out). Numbers from a busy 2-core machine are noisy:
compare runs of one invocation, and note the load average it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_common import RESULTS, Run, default_model, paired_rounds, print_table, ttft_ratio, warm_up  # noqa: E402

from kvserve.testing.router_harness import Cluster, RouterProcess, RuntimePods  # noqa: E402

DEFAULT_CONFIGS = "0.1:0.1,0:0.1,0.3:0.1,0.1:0.02,0.1:0.3"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="HF model directory (default: SmolLM2-135M-Instruct from build/smollm2)")
    p.add_argument("--replicas", type=int, default=3, help="runtime pods")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="load_weight:prefix_margin pairs, comma-separated")
    p.add_argument("--conversations", type=int, default=3, help="per round and router")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--system-words", type=int, default=20)
    p.add_argument("--user-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--skip-replicas", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "router_sweep.json")
    args = p.parse_args(argv)
    try:
        args.configs = [tuple(float(x) for x in c.split(":")) for c in args.configs.split(",") if c]
        assert all(len(c) == 2 for c in args.configs)
    except (ValueError, AssertionError):
        p.error("--configs: expected load_weight:prefix_margin pairs, e.g. 0.1:0.1,0.3:0.1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = args.model or default_model()
    served = model.name
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="kvserve-router-sweep-bench-"))
    ips = [f"127.0.4.{i + 2}" for i in range(args.replicas)]
    print(f"model {model}, {args.replicas} pods of {args.num_kv_blocks} KV blocks, {args.rounds} rounds x "
          f"{args.conversations} conversations x {args.turns} turns per router; logs in {work}; load average "
          f"{load_before[0]:.2f}", flush=True)
    pods = RuntimePods(model, ips, args=["--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "4096"],
                       logs=work, served_name=served, kv_events=True)
    cluster = Cluster(work)
    routers: list[RouterProcess] = []
    shape = dict(conversations=args.conversations, turns=args.turns, concurrency=args.concurrency,
                 system_words=args.system_words, user_words=args.user_words, max_tokens=args.max_tokens, model=served)
    result: dict = {"benchmark": "router_sweep", "date": time.strftime("%Y-%m-%d %H:%M"),
                    "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "load_average_before": load_before[0], "model": str(model),
                    "args": {k: str(v) for k, v in vars(args).items()}}

    def router(name: str, *flags: str) -> RouterProcess:
        r = RouterProcess("--inferenceservice", "tiny", "--runtime-port", str(pods.port), "--agent-port", "0",
                          *flags, cluster=cluster, log=work / f"router-{name}.log")
        routers.append(r)
        return r

    try:
        rr = router("rr", "--policy", "round-robin")
        sweep = [] if args.skip_sweep else [
            (lw, pm, router(f"lw{lw}-pm{pm}", "--tokenizer", str(model), "--load-weight", str(lw),
                            "--prefix-margin", str(pm))) for lw, pm in args.configs]
        pairs = [] if args.skip_replicas else [
            (router("served-a", "--no-kv-events"), router("served-b", "--no-kv-events")),
            (router("events-a", "--tokenizer", str(model)), router("events-b", "--tokenizer", str(model)))]
        pods.wait_ready(600)
        cluster.set_pods(list(pods.pods.values()))
        for r in routers:
            r.wait_ready(args.replicas, timeout=120)
        warm_up([r.url for r in routers], args.replicas, served)

        if sweep:
            print("\n-- sweep: event-fed router, load_weight x prefix_margin", flush=True)
            runs = [Run("round-robin")] + [Run(f"event-fed lw={lw} pm={pm}") for lw, pm, _ in sweep]
            paired_rounds(pods, list(zip(runs, [rr.url] + [r.url for _, _, r in sweep])), args.rounds, shape)
            rows = [run.row() for run in runs]
            for (lw, pm, _), run, row in zip(sweep, runs[1:], rows[1:]):
                row.update(load_weight=lw, prefix_margin=pm, round_robin_over_this=ttft_ratio(runs[0], run))
            result["sweep"] = rows
            print()
            print_table(rows)
            for row in rows[1:]:
                ratio = row["round_robin_over_this"]
                print(f"  {row['run']}: round-robin / this TTFT p50 {ratio['pooled']:.2f}x (per round "
                      f"{', '.join(f'{x:.2f}' for x in ratio['per_round'])})")

        if pairs:
            print("\n-- two router replicas, turns alternating between them", flush=True)
            runs = [Run("round-robin"), Run("2 served-based replicas"), Run("2 event-fed replicas")]
            urls = [rr.url, [r.url for r in pairs[0]], [r.url for r in pairs[1]]]
            paired_rounds(pods, list(zip(runs, urls)), args.rounds, shape, seed=500)
            rows = [run.row() for run in runs]
            result["replicas"] = rows
            result["replicas_ratios"] = {"round_robin_over_events": ttft_ratio(runs[0], runs[2]),
                                         "served_over_events": ttft_ratio(runs[1], runs[2])}
            print()
            print_table(rows)
            r = result["replicas_ratios"]
            print(f"  TTFT p50 served-based / event-fed replicas: {r['served_over_events']['pooled']:.2f}x; "
                  f"round-robin / event-fed: {r['round_robin_over_events']['pooled']:.2f}x")
    finally:
        for r in routers:
            r.stop()
        pods.stop()
        cluster.stop()
    result["load_average_after"] = os.getloadavg()[0]
    print(f"\nload average {load_before[0]:.1f} -> {result['load_average_after']:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
