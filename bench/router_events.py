"""Routing benchmark with KV events: event-fed vs served-based vs round-robin `kvserve router`.

    python bench/router_events.py                 # SmolLM2-135M, 3 pods, 6 conversations x 6 turns per policy
    python bench/router_events.py --rounds 2 --conversations 3      # alternating orders, same total work
    python bench/router_events.py --num-kv-blocks 64 --user-words 150    # a tighter pool: evictions

What runs: `--replicas` real `kvserve serve` processes (one torch thread each), each on its own
loopback address like a pod and publishing KV events (`--kv-events-config`, a port pair of its own
named on its Pod by the kvserve.dev/kv-events-port annotation); their Pod objects in the
Kubernetes API emulator; three real routers watching that API: `--policy round-robin`, `--policy
prefix --no-kv-events` (ranks pods by what they served: the approximate index) and `--policy
prefix --tokenizer MODEL` (follows every pod's KV events and ranks pods by the blocks they hold).
The workload is bench/router.py's multi-turn chat (streaming, greedy, fixed answer length); each
policy gets its own conversations, so nothing one run cached helps another. Short answers and
one conversation per pod at a time keep TTFT about prefill, not about decode steps that compete
for the same cores.

Writes bench/results/router_events.json (or --out) and prints a table, TTFT also for the turns
with a history (turn 2 on). Numbers from a busy 2-core machine are noisy: compare the runs of one
invocation, and note the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

from router import Run, default_model  # noqa: E402

from kvserve.testing.router_harness import Cluster, RouterProcess, RuntimePods, Workload, get_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="HF model directory (default: SmolLM2-135M-Instruct from build/smollm2)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=6, help="per policy")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=3, help="conversations in flight at once")
    p.add_argument("--system-words", type=int, default=20)
    p.add_argument("--user-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=4, help="answer length (ignore_eos)")
    p.add_argument("--num-kv-blocks", type=int, default=256, help="each pod's KV pool, in 16-token blocks")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of the three policies, each round in the opposite order of the one before, so "
                        "that every policy sees the machine's drifting background load alike")
    p.add_argument("--reverse", action="store_true", help="start with event-fed (and round-robin last)")
    p.add_argument("--out", type=Path, default=RESULTS / "router_events.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = args.model or default_model()
    served = model.name
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="kvserve-router-events-bench-"))
    ips = [f"127.0.3.{i + 2}" for i in range(args.replicas)]
    print(f"model {model}, {args.replicas} pods of {args.num_kv_blocks} KV blocks, {args.conversations} "
          f"conversations x {args.turns} turns per policy, {args.concurrency} at a time; logs in {work}; load "
          f"average {load_before[0]:.2f}", flush=True)
    pods = RuntimePods(model, ips, args=["--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "4096"],
                       logs=work, served_name=served, kv_events=True)
    cluster = Cluster(work)
    routers = []
    try:
        port = ("--runtime-port", str(pods.port), "--agent-port", "0")
        rr = RouterProcess("--inferenceservice", "tiny", *port, "--policy", "round-robin", cluster=cluster,
                           log=work / "router-rr.log")
        served_router = RouterProcess("--inferenceservice", "tiny", *port, "--no-kv-events", cluster=cluster,
                                      log=work / "router-served.log")
        events = RouterProcess("--inferenceservice", "tiny", *port, "--tokenizer", str(model), cluster=cluster,
                               log=work / "router-events.log")
        routers += [rr, served_router, events]
        pods.wait_ready(600)
        cluster.set_pods(list(pods.pods.values()))
        for r in routers:
            r.wait_ready(args.replicas, timeout=120)
        # Warm-up: every pod runs one request first (first-call costs are not routing costs).
        asyncio.run(Workload(seed=1000, conversations=args.replicas, turns=1, concurrency=args.replicas,
                             model=served, max_tokens=4).run(rr.url, timeout=600))
        shape = dict(conversations=args.conversations, turns=args.turns, concurrency=args.concurrency,
                     system_words=args.system_words, user_words=args.user_words, max_tokens=args.max_tokens,
                     model=served)
        runs = [(Run(f"{args.replicas} pods, round-robin"), rr), (Run(f"{args.replicas} pods, served-based"),
                                                                   served_router),
                (Run(f"{args.replicas} pods, event-fed"), events)]
        seed = 20
        for r in range(args.rounds):
            for run, router in (runs[::-1] if (r % 2 == 1) != args.reverse else runs):
                run.add(pods, router.url, Workload(seed=seed, **shape))
                seed += 1
        status = get_json(events.url + "/router/kv-events")
        rows = [run.row() for run, _ in runs]
    finally:
        for r in routers:
            r.stop()
        pods.stop()
        cluster.stop()
    load_after = os.getloadavg()
    rr_row, served_row, events_row = rows
    result = {
        "benchmark": "router_events", "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average_before": load_before[0], "load_average_after": load_after[0], "model": str(model),
        "args": {k: str(v) for k, v in vars(args).items()}, "runs": rows, "event_router": status,
        "ttft_p50_round_robin_over_events": rr_row["ttft_p50_s"] / events_row["ttft_p50_s"],
        "ttft_p50_served_over_events": served_row["ttft_p50_s"] / events_row["ttft_p50_s"],
    }
    print()
    print("| run | hit rate | TTFT p50 | TTFT p99 | TTFT p50, turns 2+ | output tok/s | failed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['hit_rate']:.2f} | {r['ttft_p50_s'] * 1000:.0f} ms | {r['ttft_p99_s'] * 1000:.0f} ms "
              f"| {r['ttft_p50_later_turns_s'] * 1000:.0f} ms | {r['output_tokens_per_s']:.1f} | {r['failed']} |")
    print(f"\nTTFT p50 round-robin / event-fed: {result['ttft_p50_round_robin_over_events']:.2f}x (target >= 2); "
          f"served-based / event-fed: {result['ttft_p50_served_over_events']:.2f}x; requests ranked by events: "
          f"{status.get('ranked_by_events')}; load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
