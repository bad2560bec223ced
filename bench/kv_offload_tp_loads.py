"""What agreeing on tier loads across tensor-parallel ranks costs.

    python bench/kv_offload_tp_loads.py                  # tiny Llama, TP 2 (gloo), 3 rounds
    python bench/kv_offload_tp_loads.py --rounds 5 --conversations 12

A tier load at TP > 1 goes to every rank at once and each rank answers with the blocks it could
not read, before any forward pass reads them (runtime/executor/multiproc.py, KV_OPS/KV_DONE): a
block one rank cannot read is recomputed instead of failing the step. Before, the other ranks
loaded with the next step's message and a failure there failed the step. This runs the same
returning conversations both ways, in alternating rounds on one engine (the old way is the base
executor's `_load_on_every_rank`, which queues the loads with the next step), and reports the
returning pass's wall time and the time rank 0 spends per admission with tier hits.

A tiny random-weight Llama (testing/tinymodels.py): the forward pass is cheap, so the control
messages' share is as large as it gets. Prints a table and writes
bench/results/kv_offload_tp_loads.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from kvserve.runtime import LLMEngine, SamplingParams  # noqa: E402
from kvserve.runtime.executor.base import Executor  # noqa: E402
from kvserve.testing.tinymodels import build_tiny_model  # noqa: E402


def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni")
                return " ".join(f for f in wanted if f in line.split())
    except OSError:
        pass
    return "?"


def run(engine, prompts, params, tag):
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        engine.step()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_offload_tp_loads.json")
    args = p.parse_args(argv)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-tp-loads-") as tmp:
        model = build_tiny_model(Path(tmp) / "model", "llama")
        engine = LLMEngine.from_args(model=str(model), block_size=4, num_kv_blocks=48, max_model_len=256,
                                     max_num_batched_tokens=256, tensor_parallel_size=args.tp,
                                     kv_offload_bytes=1 << 26, kv_offload_dir=str(Path(tmp) / "tier"))
        ex = engine.executor
        agreed = ex._load_on_every_rank
        deferred = types.MethodType(Executor._load_on_every_rank, ex)
        timings: list[float] = []
        apply = ex.kv_offload_apply

        def timed(ops):
            t0 = time.perf_counter()
            out = apply(ops)
            if any(op[0] == "load" for op in ops):
                timings.append(time.perf_counter() - t0)
            return out

        engine.offload._apply = timed
        rows = {"agreed": [], "deferred": []}
        try:
            for r in range(args.rounds):
                for mode in (("agreed", "deferred") if r % 2 == 0 else ("deferred", "agreed")):
                    ex._load_on_every_rank = agreed if mode == "agreed" else deferred
                    rng = random.Random(1000 * r + (mode == "agreed"))
                    prompts = [[rng.randrange(3, 512) for _ in range(args.prompt_tokens)]
                               for _ in range(args.conversations)]
                    run(engine, prompts, params, f"{mode}{r}a")  # stored: the pool is far smaller
                    timings.clear()
                    hits = engine.get_stats().kv_offload_hit_tokens_total
                    t0 = time.perf_counter()
                    run(engine, prompts, params, f"{mode}{r}b")  # returning: loads from the tier
                    wall = time.perf_counter() - t0
                    rows[mode].append({"wall_s": wall, "admissions": len(timings),
                                       "load_ms_p50": 1e3 * statistics.median(timings) if timings else None,
                                       "hit_tokens": engine.get_stats().kv_offload_hit_tokens_total - hits})
                    print(f"round {r} {mode:8s}: returning pass {wall:.3f} s, {len(timings)} admissions with "
                          f"tier loads, rank 0's load call p50 {rows[mode][-1]['load_ms_p50']:.2f} ms", flush=True)
        finally:
            engine.close()

    def med(mode, key):
        return statistics.median(x[key] for x in rows[mode])

    result = {
        "command": "python bench/kv_offload_tp_loads.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "flags": cpu_flags(), "load": os.getloadavg()},
        "tp": args.tp, "rounds": rows,
        "returning_wall_ratio_agreed_over_deferred": med("agreed", "wall_s") / med("deferred", "wall_s"),
        "load_call_ms_p50": {m: med(m, "load_ms_p50") for m in rows},
    }
    print("| mode | returning pass wall (median) | rank 0's load call p50 |")
    print("|---|---|---|")
    for m in rows:
        print(f"| {m} | {med(m, 'wall_s'):.3f} s | {med(m, 'load_ms_p50'):.2f} ms |")
    print(f"agreed / deferred wall: {result['returning_wall_ratio_agreed_over_deferred']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
