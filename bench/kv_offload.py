"""KV offload tier benchmark: multi-turn chat whose working set is about 4x the KV pool.

    python bench/kv_offload.py                    # SmolLM2-135M, 8 conversations x 4 turns, a 56-block pool
    python bench/kv_offload.py --conversations 8 --turns 4 --num-kv-blocks 56 --max-num-seqs 2

What runs: one real `kvserve serve` process (one torch thread) per configuration, driven by the
router benchmark's conversations (tests/router_harness.py's Workload: the official openai client,
streaming, greedy, fixed answer length; turn n+1 sends turn n's messages, its answer and a new
user message). Every conversation is in flight at once, so between two turns of one conversation
the others' prefills push its blocks out of the pool. By default the next turn follows its answer at
once: the engine stays saturated and a returning turn's TTFT is mostly its wait behind the others'
turns, which no tier shortens. `--think-seconds S` puts a user's pause before each next turn
(conversations start spread over one pause), so a returning turn mostly finds the engine free and
its TTFT is its own prefill: what the tier changes.

1. Multi-turn: the pool alone vs the pool plus a file tier (`--kv-offload-dir` on local disk).
   Reported: TTFT p50/p99 over all turns and over the returning turns (turn 2 on, which have a
   history to find), output throughput, prefix-cache and tier hits.
2. Warm restart: a server with a persistent tier serves the conversations and is stopped
   (SIGTERM); a new server on the same directory gets each conversation's next turn (its whole
   history plus a new message), one at a time. The same turns to a restarted server without a
   tier are the baseline. Reported: TTFT p50/p99 of those returning conversations.

Writes bench/results/kv_offload.json (or --out) and prints a table. On a busy 2-core machine the
numbers are noisy: compare the runs of one invocation, and note the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

from kvserve.testing.router_harness import RuntimePods, Workload, percentile, ttft_p50_by_turn  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=40)
    p.add_argument("--user-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=56, help="the KV pool (blocks of 16 tokens)")
    p.add_argument("--max-num-seqs", type=int, default=2, help="requests the engine runs at once")
    p.add_argument("--think-seconds", type=float, default=0.0,
                   help="a user's pause before each next turn (0: at once, the engine stays saturated and "
                        "a returning turn's TTFT is mostly queueing behind the others' turns)")
    p.add_argument("--kv-offload-bytes", type=int, default=1 << 30)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--tier-first", action="store_true",
                   help="run the file tier before the pool alone (load on a shared machine drifts: swap the order "
                        "to see how much of a ratio is drift)")
    p.add_argument("--rounds", type=int, default=1,
                   help="multi-turn rounds with both servers up, the order alternating each round and each round "
                        "new conversations (seed + round): the two configurations see the same load drift")
    p.add_argument("--no-restart", action="store_true", help="skip the warm-restart part")
    p.add_argument("--out", type=Path, default=RESULTS / "kv_offload.json")
    return p.parse_args(argv)


def default_model() -> Path:
    from kvserve.testing.realmodel import ensure_smollm2

    return Path(ensure_smollm2().hf_dir)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
            if 'phase="' in name:  # the step histogram per phase (its plain sum adds the phases)
                key = name.split("{")[0] + ":" + name.split('phase="')[1].split('"')[0]
                out[key] = out.get(key, 0.0) + float(value)
    return out


class Server:
    def __init__(self, args, model: Path, logs: Path, name: str, extra: list[str]):
        argv = ["--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
                "--max-model-len", "4096", *extra]
        self.pods = RuntimePods(model, ["127.0.0.1"], args=argv, logs=logs, threads=args.threads,
                                served_name="m", prefix=name).wait_ready(timeout=600)
        self.url = next(iter(self.pods.pods.values())).url

    def stop(self) -> None:
        self.pods.stop()


def ttft_row(name: str, ttfts: list[float], later: list[float], tokens: int, duration: float,
             before: dict, after: dict) -> dict:
    def delta(metric):
        return after.get(metric, 0.0) - before.get(metric, 0.0)

    return {"run": name, "requests": len(ttfts), "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99), "ttft_p50_returning_s": percentile(later, 0.5),
            "ttft_p99_returning_s": percentile(later, 0.99), "output_tokens_per_s": tokens / duration,
            "duration_s": duration, "prompt_tokens": delta("vllm:prefix_cache_queries_total"),
            "pool_hit_tokens": delta("vllm:prefix_cache_hits_total") - delta("vllm:external_prefix_cache_hits_total"),
            "tier_hit_tokens": delta("vllm:external_prefix_cache_hits_total"),
            "preemptions": delta("vllm:num_preemptions_total"),
            # Where the time goes, summed over the run's requests / steps (server side).
            "queue_s_per_request": delta("vllm:request_queue_time_seconds_sum") / max(1, len(ttfts)),
            "step_s_total": delta("kvserve:step_duration_seconds_sum"),  # every phase
            "forward_s_total": delta("kvserve:step_duration_seconds_sum:forward"),
            "steps": delta("kvserve:step_duration_seconds_count:forward"),
            "tier_load_s_total": delta("kvserve:kv_offload_load_seconds_sum"),
            "tier_loads": delta("kvserve:kv_offload_load_seconds_count"),
            "tier_store_s_total": delta("kvserve:kv_offload_store_seconds_sum"),
            "tier_prefetched_blocks": delta("kvserve:kv_offload_prefetched_blocks_total"),
            "tier_loaded_blocks": delta("kvserve:kv_offload_hits_total")}


def run_workload(args, server: Server, name: str, seed: int) -> tuple[list, float, dict, dict, Workload]:
    before = scrape(server.url)
    workload = Workload(conversations=args.conversations, turns=args.turns, concurrency=args.conversations,
                        user_words=args.user_words, system_words=args.system_words, max_tokens=args.max_tokens,
                        seed=seed, model="m", think_seconds=args.think_seconds)
    started = time.perf_counter()
    asyncio.run(workload.run(server.url, timeout=1200))
    duration = time.perf_counter() - started
    after = scrape(server.url)
    ok = [r for r in workload.results if r.ok]
    if len(ok) != len(workload.results):
        raise SystemExit(f"{name}: {len(workload.results) - len(ok)} requests failed: "
                         f"{[r.error for r in workload.results if not r.ok][:3]}")
    return ok, duration, before, after, workload


def row_of(name: str, ok: list, duration: float, before: dict, after: dict) -> dict:
    row = ttft_row(name, [r.ttft for r in ok], [r.ttft for r in ok if r.turn > 0], sum(r.tokens for r in ok),
                   duration, before, after)
    # The p50 over "returning turns" depends on how long the conversations are; per turn it does not.
    row["ttft_p50_by_turn_s"] = ttft_p50_by_turn(ok)
    return row


def multi_turn(args, model: Path, work: Path, name: str, extra: list[str]) -> tuple[dict, Workload]:
    server = Server(args, model, work, name, extra)
    try:
        ok, duration, before, after, workload = run_workload(args, server, name, args.seed)
    finally:
        server.stop()
    row = row_of(name, ok, duration, before, after)
    print_row(row)
    return row, workload


def interleaved(args, model: Path, work: Path, tier_flags: list[str]) -> tuple[dict, dict, list[dict]]:
    """Both servers up; each round runs new conversations on one then the other (the order
    alternating), so a load change on a shared machine hits both alike. Returns the pooled rows
    (every round's requests together) and each round's ratios."""
    servers = {"pool-only": Server(args, model, work, "pool-only", []),
               "file-tier": Server(args, model, work, "file-tier", tier_flags)}
    pooled: dict[str, list] = {name: [[], 0.0, None, None] for name in servers}
    rounds = []
    try:
        for r in range(args.rounds):
            order = ["pool-only", "file-tier"]
            if (r % 2 == 1) != args.tier_first:
                order.reverse()
            rows = {}
            for name in order:
                ok, duration, before, after, _ = run_workload(args, servers[name], name, args.seed + r)
                rows[name] = row_of(f"{name} (round {r + 1})", ok, duration, before, after)
                print_row(rows[name])
                acc = pooled[name]
                acc[0] += ok
                acc[1] += duration
                acc[2] = acc[2] or before
                acc[3] = after
            rounds.append({"round": r + 1, "order": order,
                           "ttft_p50_returning_ratio": rows["pool-only"]["ttft_p50_returning_s"]
                           / rows["file-tier"]["ttft_p50_returning_s"]})
            print(f"  round {r + 1}: returning TTFT p50 {rounds[-1]['ttft_p50_returning_ratio']:.2f}x lower "
                  f"with the file tier", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    base, tier = (row_of(f"{name} (all rounds)", *pooled[name]) for name in ("pool-only", "file-tier"))
    for row in (base, tier):
        print_row(row)
    return base, tier, rounds


def returning_requests(args, workload: Workload) -> list[list[dict]]:
    """Each conversation's next turn after the workload: its whole history plus a new message
    (the histories rebuilt as Workload.run built them: same seed, same text, the answers it got)."""
    rng = random.Random(workload.seed)
    system = f"[{workload.seed}] " + workload._text(rng, workload.system_words)
    plans = [[workload._text(rng, workload.user_words) for _ in range(workload.turns)]
             for _ in range(workload.conversations)]
    answers = {(r.conversation, r.turn): r.text for r in workload.results}
    out = []
    for c in range(workload.conversations):
        messages = [{"role": "system", "content": system}]
        for t, user in enumerate(plans[c]):
            messages.append({"role": "user", "content": f"conversation {workload.seed}.{c} turn {t}: {user}"})
            messages.append({"role": "assistant", "content": answers[(c, t)] or "ok"})
        messages.append({"role": "user", "content": f"conversation {workload.seed}.{c} returns: "
                                                    f"{workload._text(rng, 8)}"})
        out.append(messages)
    return out


async def send_one_by_one(url: str, requests: list[list[dict]], max_tokens: int) -> tuple[list[float], int]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    ttfts, prompt_tokens = [], 0
    try:
        for messages in requests:
            start = time.perf_counter()
            first = None
            stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True},
                                                          extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.usage:
                    prompt_tokens = max(prompt_tokens, chunk.usage.prompt_tokens)
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.perf_counter()
            ttfts.append((first or time.perf_counter()) - start)
    finally:
        await client.close()
    return ttfts, prompt_tokens


def warm_restart(args, model: Path, work: Path, tier_dir: Path, workload: Workload) -> list[dict]:
    requests = returning_requests(args, workload)
    rows = []
    for name, extra in [("restart, no tier", []),
                        ("restart, persistent tier", ["--kv-offload-bytes", str(args.kv_offload_bytes),
                                                      "--kv-offload-dir", str(tier_dir)])]:
        server = Server(args, model, work, name.replace(", ", "-").replace(" ", "-"), extra)
        try:
            before = scrape(server.url)
            started = time.perf_counter()
            ttfts, longest = asyncio.run(send_one_by_one(server.url, requests, args.max_tokens))
            duration = time.perf_counter() - started
            after = scrape(server.url)
        finally:
            server.stop()
        row = ttft_row(name, ttfts, ttfts, args.max_tokens * len(ttfts), duration, before, after)
        row["longest_prompt_tokens"] = longest
        print_row(row)
        rows.append(row)
    return rows


def print_row(row: dict) -> None:
    print(f"  {row['run']:<26} TTFT p50 {row['ttft_p50_s'] * 1000:7.0f} ms  p99 {row['ttft_p99_s'] * 1000:7.0f} ms  "
          f"returning p50 {row['ttft_p50_returning_s'] * 1000:7.0f} ms  {row['output_tokens_per_s']:5.1f} tok/s  "
          f"pool hits {row['pool_hit_tokens']:.0f} / tier hits {row['tier_hit_tokens']:.0f} of "
          f"{row['prompt_tokens']:.0f} prompt tokens  ({row['duration_s']:.0f} s, load {os.getloadavg()[0]:.1f})",
          flush=True)
    print(f"  {'':<26} queued {row['queue_s_per_request']:.2f} s/request; steps {row['step_s_total']:.1f} s in "
          f"{row['steps']:.0f} (forward {row['forward_s_total']:.1f} s); "
          f"tier loads {row['tier_load_s_total']:.2f} s in {row['tier_loads']:.0f}, "
          f"stores {row['tier_store_s_total']:.2f} s; {row['tier_prefetched_blocks']:.0f} of "
          f"{row['tier_loaded_blocks']:.0f} loaded blocks were read ahead", flush=True)
    print(f"  {'':<26} TTFT p50 by turn: " + ", ".join(f"{t}: {v * 1000:.0f} ms"
                                                      for t, v in row["ttft_p50_by_turn_s"].items()), flush=True)


def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags)
    except OSError:
        pass
    return ""


def main(argv=None) -> int:
    args = parse_args(argv)
    tier_root = Path(tempfile.mkdtemp(prefix="kvserve-kv-tier-"))  # local disk
    try:
        return _run(args, argv, tier_root)
    finally:
        # Hundreds of MB of blocks that nothing reads after the run (the logs stay in `work`).
        shutil.rmtree(tier_root, ignore_errors=True)


def _run(args, argv, tier_root: Path) -> int:
    model = args.model or default_model()
    work = Path(tempfile.mkdtemp(prefix="kvserve-bench-offload-"))
    print(f"model {model}: {args.conversations} conversations x {args.turns} turns, all in flight, "
          f"{args.num_kv_blocks}-block pool, max {args.max_num_seqs} running; logs in {work}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    load_before = os.getloadavg()
    tier_flags = ["--kv-offload-bytes", str(args.kv_offload_bytes), "--kv-offload-dir", str(tier_root / "multi")]
    rounds = []
    if args.rounds > 1:
        base, tier, rounds = interleaved(args, model, work, tier_flags)
    elif args.tier_first:
        tier, _ = multi_turn(args, model, work, "file-tier", tier_flags)
        base, _ = multi_turn(args, model, work, "pool-only", [])
    else:
        base, _ = multi_turn(args, model, work, "pool-only", [])
        tier, _ = multi_turn(args, model, work, "file-tier", tier_flags)
    restart = []
    if not args.no_restart:
        # The warm restart's first server: the same conversations, its tier persisted at shutdown.
        warm_dir = tier_root / "restart"
        _, served = multi_turn(args, model, work, "before-restart",
                               ["--kv-offload-bytes", str(args.kv_offload_bytes), "--kv-offload-dir", str(warm_dir)])
        restart = warm_restart(args, model, work, warm_dir, served)
    load_after = os.getloadavg()
    pool_tokens = args.num_kv_blocks * 16
    # A conversation's final history: its last turn's prompt (the restart's requests add a little).
    longest = max([r["longest_prompt_tokens"] for r in restart] or [0])
    result = {
        "command": "python bench/kv_offload.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "flags": cpu_flags(), "load_before": load_before, "load_after": load_after},
        "model": str(model), "pool_tokens": pool_tokens,
        "working_set_tokens_approx": longest * args.conversations if longest else None,
        "working_set_over_pool": longest * args.conversations / pool_tokens if longest else None,
        "multi_turn": [base, tier],
        "rounds": rounds,
        "ttft_p50_returning_ratio": base["ttft_p50_returning_s"] / tier["ttft_p50_returning_s"],
        "ttft_p99_returning_ratio": base["ttft_p99_returning_s"] / tier["ttft_p99_returning_s"],
        "throughput_ratio": tier["output_tokens_per_s"] / base["output_tokens_per_s"],
        "ttft_p50_ratio_by_turn": {t: base["ttft_p50_by_turn_s"][t] / v
                                   for t, v in tier["ttft_p50_by_turn_s"].items() if t in base["ttft_p50_by_turn_s"]},
        "warm_restart": restart,
        "warm_restart_ttft_p50_ratio": restart[0]["ttft_p50_s"] / restart[1]["ttft_p50_s"] if restart else None,
    }
    if longest:
        print(f"working set ~{result['working_set_tokens_approx']} tokens = "
              f"{result['working_set_over_pool']:.1f}x the {pool_tokens}-token pool")
    print(f"returning turns: TTFT p50 {result['ttft_p50_returning_ratio']:.2f}x lower with the file tier, "
          f"p99 {result['ttft_p99_returning_ratio']:.2f}x; throughput {result['throughput_ratio']:.2f}x")
    print("TTFT p50 ratio by turn: " + ", ".join(f"turn {t} {v:.2f}x"
                                                 for t, v in result["ttft_p50_ratio_by_turn"].items()))
    if restart:
        print(f"warm restart: TTFT p50 {result['warm_restart_ttft_p50_ratio']:.2f}x lower with the persistent tier")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
