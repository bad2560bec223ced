"""Routing benchmark: a multi-turn chat workload through `kvserve router`, round-robin vs prefix.

    python bench/router.py                        # SmolLM2-135M, 3 replicas, 2 rounds x 6 conversations x 4 turns
    python bench/router.py --quick                # 1 round, 3 turns, shorter messages
    python bench/router.py --concurrency 3 --conversations 6 --turns 5 --user-words 60 --max-tokens 24 --rounds 1
    python bench/router.py --model DIR --replicas 3 --conversations 24 --turns 4

What runs: `--replicas` real `kvserve serve` processes (one torch thread each), each on its own
loopback address like a pod; their Pod objects in the Kubernetes API emulator; two real routers
watching that API, one with `--policy round-robin` (what a plain Service does) and one with the
default `--policy prefix`. Each conversation's turn n+1 sends turn n's messages, its answer and a
new user message (the official openai client, streaming, greedy, fixed answer length). Every run
has its own system prompt and conversations, so nothing one run cached helps another.

Reported per run: prefix-cache hit rate summed over the pods (`vllm:prefix_cache_hits` /
`vllm:prefix_cache_queries`), TTFT p50/p99 and output throughput; the "ceiling" run sends the same
kind of workload to a single pod, which by construction finds every earlier turn in its cache.
Then scale from zero: with no pod ready the router holds requests; a new runtime process is
started, and its Pod is made Ready once its /ready answers (what kubelet and the endpoints
controller do). Reported: time from the first held request to its first token, of which the
runtime's own start, and whether every held request was answered.

Writes bench/results/router.json (or --out) and prints a table; TTFT is also given for the turns
that have a history (turn 2 on), where the prefix cache can help. Numbers from a busy 2-core machine are
noisy: compare the runs of one invocation (they are side by side), and note the load average.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_common import RESULTS, Run, default_model, paired_rounds, print_table, ttft_ratio  # noqa: E402

from kvserve.testing.router_harness import Cluster, RouterProcess, RuntimePods, Workload, wait_for  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="HF model directory (default: SmolLM2-135M-Instruct from build/smollm2)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=6, help="per round and policy")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of round-robin then prefix (alternating which goes first), so both see the "
                        "same background load on a shared machine")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=6, help="conversations in flight at once")
    p.add_argument("--system-words", type=int, default=40)
    p.add_argument("--user-words", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=32, help="answer length (ignore_eos)")
    p.add_argument("--held", type=int, default=4, help="requests held during the scale from zero")
    p.add_argument("--num-kv-blocks", type=int, default=1536)
    p.add_argument("--quick", action="store_true", help="6 conversations x 3 turns, shorter messages")
    p.add_argument("--out", type=Path, default=RESULTS / "router.json")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.turns, args.user_words, args.max_tokens = 1, 3, 60, 16
    return args


def scale_from_zero(args, model: Path, cluster: Cluster, router: RouterProcess, work: Path, served: str,
                    port: int) -> dict:
    cluster.set_pods([])
    router.wait_ready(0)
    workload = Workload(seed=99, conversations=args.held, turns=1, concurrency=args.held, model=served,
                        system_words=args.system_words, user_words=args.user_words, max_tokens=args.max_tokens)

    async def go():
        task = asyncio.create_task(workload.run(router.url, timeout=600))
        t0 = time.perf_counter()
        await asyncio.to_thread(wait_for, lambda: router.demand().get("held") == args.held, 30, "held requests")
        held_at = time.perf_counter()
        pods = RuntimePods(model, ["127.0.2.9"], args=["--num-kv-blocks", str(args.num_kv_blocks)], logs=work,
                           served_name=served, port=port, prefix="woken")
        try:
            await asyncio.to_thread(pods.wait_ready, 600)
            ready_at = time.perf_counter()
            cluster.set_pods(list(pods.pods.values()))
            await task
        finally:
            pods.stop()
        return t0, held_at, ready_at

    t0, held_at, ready_at = asyncio.run(go())
    ok = [r for r in workload.results if r.ok]
    for r in workload.results:
        if not r.ok:
            print(f"    lost: {r.error[:200]}")
    # Turn.ttft counts from each request's own start: all started at t0 (within milliseconds).
    first = min(r.ttft for r in ok if r.ttft is not None) if ok else float("nan")
    row = {"held_requests": args.held, "answered": len(ok), "lost": args.held - len(ok),
           "first_held_to_first_token_s": first, "runtime_start_to_ready_s": ready_at - held_at,
           "ready_to_first_token_s": first - (ready_at - t0)}
    print(f"  scale from zero: {len(ok)}/{args.held} held requests answered; first token {first:.1f} s after the "
          f"first held request (runtime start to ready {row['runtime_start_to_ready_s']:.1f} s, ready to first "
          f"token {row['ready_to_first_token_s']:.2f} s)", flush=True)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the pods and routers on the way out
    model = args.model or default_model()
    served = model.name
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="kvserve-router-bench-"))
    ips = [f"127.0.2.{i + 2}" for i in range(args.replicas)]
    print(f"model {model}, {args.replicas} replicas, {args.rounds} round(s) per policy of {args.conversations} "
          f"conversations x {args.turns} turns, {args.concurrency} at a time; logs in {work}; load average "
          f"{load_before[0]:.2f}", flush=True)
    pods = RuntimePods(model, ips, args=["--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "4096"],
                       logs=work, served_name=served)
    cluster = Cluster(work)
    routers = []
    try:
        port = ("--runtime-port", str(pods.port))
        rr = RouterProcess("--inferenceservice", "tiny", *port, "--policy", "round-robin", "--agent-port", "0",
                           cluster=cluster, log=work / "router-rr.log")
        prefix = RouterProcess("--inferenceservice", "tiny", *port, "--agent-port", "0", "--hold-timeout", "600",
                               cluster=cluster, log=work / "router-prefix.log")
        routers += [rr, prefix]
        pods.wait_ready(600)
        first = list(pods.pods.values())[0]
        shape = dict(conversations=args.conversations, turns=args.turns, concurrency=args.concurrency,
                     system_words=args.system_words, user_words=args.user_words, max_tokens=args.max_tokens,
                     model=served)
        # Warm-up: every pod runs one request first (first-call costs are not routing costs).
        cluster.set_pods(list(pods.pods.values()))
        rr.wait_ready(args.replicas)
        asyncio.run(Workload(seed=1000, conversations=args.replicas, turns=1, concurrency=args.replicas,
                             model=served, max_tokens=4).run(rr.url, timeout=600))
        cluster.set_pods([first])
        prefix.wait_ready(1)
        ceiling = Run("1 pod (ceiling)")
        ceiling.add(pods, prefix.url, Workload(seed=1, **shape))
        cluster.set_pods(list(pods.pods.values()))
        rr.wait_ready(args.replicas)
        prefix.wait_ready(args.replicas)
        by_rr = Run(f"{args.replicas} pods, round-robin")
        by_prefix = Run(f"{args.replicas} pods, prefix")
        paired_rounds(pods, [(by_rr, rr.url), (by_prefix, prefix.url)], args.rounds, shape, seed=10)
        rows = [ceiling.row(), by_rr.row(), by_prefix.row()]
        pods.stop()
        zero = scale_from_zero(args, model, cluster, prefix, work, served, pods.port)
    finally:
        for r in routers:
            r.stop()
        pods.stop()
        cluster.stop()
    load_after = os.getloadavg()
    ceiling, rr_row, prefix_row = rows
    result = {
        "benchmark": "router", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or
        platform.machine(), "cpus": os.cpu_count(), "load_average_before": load_before[0],
        "load_average_after": load_after[0], "model": str(model), "args": {k: str(v) for k, v in vars(args).items()},
        "runs": rows, "scale_from_zero": zero,
        "hit_rate_vs_ceiling": prefix_row["hit_rate"] / ceiling["hit_rate"] if ceiling["hit_rate"] else None,
        "ttft_p50_round_robin_over_prefix": rr_row["ttft_p50_s"] / prefix_row["ttft_p50_s"],
        "ttft_p50_round_robin_over_prefix_per_round": ttft_ratio(by_rr, by_prefix)["per_round"],
        "throughput_prefix_over_round_robin": prefix_row["output_tokens_per_s"] / rr_row["output_tokens_per_s"],
    }
    print()
    print_table(rows)
    print(f"\nprefix hit rate / ceiling: {result['hit_rate_vs_ceiling']:.2f} (target >= 0.90); "
          f"TTFT p50 round-robin / prefix: {result['ttft_p50_round_robin_over_prefix']:.2f}x (target >= 2); "
          f"throughput prefix / round-robin: {result['throughput_prefix_over_round_robin']:.2f}x; "
          f"scale from zero: first token {zero['first_held_to_first_token_s']:.1f} s after the first held request, "
          f"{zero['lost']} lost; load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
