"""What the routing benchmarks share (bench/router.py, bench/router_events.py): the model, the
multi-turn chat workload run through a router, its measurement and the table.

A policy's `Run` accumulates rounds. Every round is one `Workload` (conversations of its own, so
nothing one round cached helps another) sent through one router while the pods' prefix-cache
counters are read before and after. `paired_rounds` runs several policies' rounds interleaved,
each round in the opposite order of the one before (A B C, C B A, ...), so that a machine's
drifting background load falls on every policy alike; the ratio of two policies' TTFT p50 is
then reported over all their requests together and per round (its median: a round's ratio
compares runs minutes apart, the pooled p50 runs that may be half an hour apart).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path

from kvserve.testing.router_harness import RuntimePods, Workload, percentile, ttft_p50_by_turn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def default_model() -> Path:
    from kvserve.testing.realmodel import ensure_smollm2

    return Path(ensure_smollm2().hf_dir)


def summarize(name: str, workload: Workload, hits: float, queries: float, duration: float, rounds: int = 1) -> dict:
    ok = [r for r in workload.results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    later = [r.ttft for r in ok if r.ttft is not None and r.turn > 0]  # turns that have a history
    return {"run": name, "rounds": rounds, "requests": len(workload.results), "failed": len(workload.results) - len(ok),
            "ttft_p50_later_turns_s": percentile(later, 0.5),
            "hit_rate": hits / queries if queries else 0.0, "prompt_tokens_cached": int(hits),
            "prompt_tokens": int(queries),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "ttft_p99_s": percentile(ttft, 0.99),
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else float("nan"),
            "output_tokens_per_s": sum(r.tokens for r in ok) / duration if duration else 0.0,
            "requests_per_s": len(ok) / duration if duration else 0.0, "duration_s": duration,
            "ttft_p50_by_turn_s": ttft_p50_by_turn(ok)}


class Run:
    """One policy's rounds, accumulated; `rounds` keeps each round's own row."""

    def __init__(self, name: str):
        self.name, self.workload = name, Workload()
        self.hits = self.queries = self.duration = 0.0
        self.rounds: list[dict] = []

    def add(self, pods: RuntimePods, url: str, workload: Workload) -> dict:
        hits0, queries0 = pods.prefix_counters()
        started = time.perf_counter()
        asyncio.run(workload.run(url, timeout=600))
        duration = time.perf_counter() - started
        hits1, queries1 = pods.prefix_counters()
        self.hits += hits1 - hits0
        self.queries += queries1 - queries0
        self.duration += duration
        self.workload.results += workload.results
        row = summarize(self.name, workload, hits1 - hits0, queries1 - queries0, duration)
        row["load_average"] = os.getloadavg()[0]
        self.rounds.append(row)
        print(f"  {self.name:<22} hit rate {row['hit_rate']:.2f}  TTFT p50 {row['ttft_p50_s'] * 1000:.0f} ms  "
              f"p90 {row['ttft_p90_s'] * 1000:.0f} ms  {row['output_tokens_per_s']:.1f} tok/s  "
              f"({row['duration_s']:.0f} s, {row['failed']} failed, load {row['load_average']:.1f})", flush=True)
        return row

    def row(self) -> dict:
        return summarize(self.name, self.workload, self.hits, self.queries, self.duration, len(self.rounds))


def paired_rounds(pods: RuntimePods, runs: list[tuple[Run, str]], rounds: int, shape: dict, *, seed: int = 20,
                  reverse: bool = False) -> None:
    """`rounds` rounds of every (run, router url), alternating the order round by round."""
    for r in range(rounds):
        for run, url in (runs[::-1] if (r % 2 == 1) != reverse else runs):
            run.add(pods, url, Workload(seed=seed, **shape))
            seed += 1


def warm_up(urls: list[str], replicas: int, model: str) -> None:
    """Every router sends one short request to every pod first: first-call costs (a pod's
    first step, a router's connections and first tokenization) are not routing costs."""
    for url in urls:
        asyncio.run(Workload(seed=1000, conversations=replicas, turns=1, concurrency=replicas, model=model,
                             max_tokens=2).run(url, timeout=600))


def ttft_ratio(slow: Run, fast: Run) -> dict:
    """slow's TTFT p50 over fast's: over all their requests, and per round (median, min, max)."""
    pooled = slow.row()["ttft_p50_s"] / fast.row()["ttft_p50_s"]
    per_round = [a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in zip(slow.rounds, fast.rounds)]
    return {"pooled": pooled, "per_round": per_round,
            "per_round_median": statistics.median(per_round) if per_round else float("nan")}


def print_table(rows: list[dict]) -> None:
    print("| run | rounds x requests | hit rate | TTFT p50 | TTFT p90 | TTFT p99 | TTFT p50, turns 2+ | output tok/s "
          "| failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['rounds']} x {r['requests'] // max(1, r['rounds'])} | {r['hit_rate']:.2f} "
              f"| {r['ttft_p50_s'] * 1000:.0f} ms | {r['ttft_p90_s'] * 1000:.0f} ms | {r['ttft_p99_s'] * 1000:.0f} ms "
              f"| {r['ttft_p50_later_turns_s'] * 1000:.0f} ms | {r['output_tokens_per_s']:.1f} | {r['failed']} |")
