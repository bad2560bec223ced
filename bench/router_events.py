"""Routing benchmark with KV events: event-fed vs served-based vs round-robin `kvserve router`.

    python bench/router_events.py                 # SmolLM2-135M, 3 pods, 4 rounds x 3 conversations x 6 turns per policy
    python bench/router_events.py --rounds 6 --conversations 3      # more rounds: a steadier per-round median
    python bench/router_events.py --num-kv-blocks 64 --user-words 150    # a tighter pool: evictions
    python bench/router_events.py --conversations 6 --concurrency 6 --num-kv-blocks 160 --think-seconds 6
        # users who pause, and more conversations than one pod's pool holds: the fleet's pools
        # together hold them only if each conversation keeps to one pod

What runs: `--replicas` real `kvserve serve` processes (one torch thread each), each on its own
loopback address like a pod and publishing KV events (`--kv-events-config`, a port pair of its own
named on its Pod by the kvserve.dev/kv-events-port annotation); their Pod objects in the
Kubernetes API emulator; three real routers watching that API: `--policy round-robin`, `--policy
prefix --no-kv-events` (ranks pods by what they served: the approximate index) and `--policy
prefix --tokenizer MODEL` (follows every pod's KV events and ranks pods by the blocks they hold).
The workload is bench/router.py's multi-turn chat (streaming, greedy, fixed answer length); each
policy gets its own conversations, so nothing one run cached helps another. Short answers and
one conversation per pod at a time keep TTFT about prefill, not about decode steps that compete
for the same cores. By default each next turn follows its answer at once, so the pods stay busy and
on a machine with fewer cores than pods a turn's TTFT is also its wait for a core. With
`--think-seconds` users pause between turns (as chat users do), so a turn mostly finds its pod idle
and its TTFT is its own prefill: what the routing decides.

The policies run in alternating rounds (bench/router_common.py: A B C, C B A, ...) after a
warm-up through every router. Writes bench/results/router_events.json (or --out) and prints a
table (TTFT p50/p90/p99, also p50 for the turns with a history, turn 2 on) and the TTFT p50
ratios over all requests and per round (median): numbers from a busy 2-core machine are noisy,
so compare the runs of one invocation, and note the load average.
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

from kvserve.testing.router_harness import Cluster, RouterProcess, RuntimePods, get_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="HF model directory (default: SmolLM2-135M-Instruct from build/smollm2)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=3, help="per round and policy")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=3, help="conversations in flight at once")
    p.add_argument("--system-words", type=int, default=20)
    p.add_argument("--user-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=4, help="answer length (ignore_eos)")
    p.add_argument("--num-kv-blocks", type=int, default=256, help="each pod's KV pool, in 16-token blocks")
    p.add_argument("--think-seconds", type=float, default=0.0,
                   help="a user's pause before each next turn (0: the next turn at once)")
    p.add_argument("--think-jitter", type=float, default=0.5,
                   help="each pause is drawn from think-seconds x [1 - jitter, 1 + jitter]")
    p.add_argument("--rounds", type=int, default=4,
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
        warm_up([r.url for r in routers], args.replicas, served)
        shape = dict(conversations=args.conversations, turns=args.turns, concurrency=args.concurrency,
                     system_words=args.system_words, user_words=args.user_words, max_tokens=args.max_tokens,
                     model=served, think_seconds=args.think_seconds,
                     think_jitter=args.think_jitter)
        runs = [Run(f"{args.replicas} pods, round-robin"), Run(f"{args.replicas} pods, served-based"),
                Run(f"{args.replicas} pods, event-fed")]
        paired_rounds(pods, list(zip(runs, [r.url for r in routers])), args.rounds, shape, reverse=args.reverse)
        status = get_json(events.url + "/router/kv-events")
        rows = [run.row() for run in runs]
        ratios = {"round_robin_over_events": ttft_ratio(runs[0], runs[2]),
                  "served_over_events": ttft_ratio(runs[1], runs[2])}
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
        "ttft_p50_ratios": ratios,
        "rounds": {run.name: run.rounds for run in runs},
    }
    print()
    print_table(rows)
    for row in rows:
        print(f"  {row['run']:<22} TTFT p50 by turn: " + ", ".join(
            f"{t}: {v * 1000:.0f} ms" for t, v in row["ttft_p50_by_turn_s"].items()))
    rr_ev, sv_ev = ratios["round_robin_over_events"], ratios["served_over_events"]
    print(f"\nTTFT p50 round-robin / event-fed: {rr_ev['pooled']:.2f}x over all requests, per round median "
          f"{rr_ev['per_round_median']:.2f}x ({', '.join(f'{x:.2f}' for x in rr_ev['per_round'])}) (target >= 2); "
          f"served-based / event-fed: {sv_ev['pooled']:.2f}x, per round median {sv_ev['per_round_median']:.2f}x "
          f"({', '.join(f'{x:.2f}' for x in sv_ev['per_round'])}); requests ranked by events: "
          f"{status.get('ranked_by_events')}; load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
