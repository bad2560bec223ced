"""Prefix caching: time to first token for requests that share a long system prompt.

    python bench/prefix_cache.py                      # 1024-token shared prefix, 8 requests
    python bench/prefix_cache.py --prefix-len 2048 --suffix-len 64 --model DIR --device cuda

Each request is the shared prefix plus its own random suffix, sent one after another (each arrives
when the previous one has finished, so TTFT is the request's own prefill, not queueing). The same
requests run on an engine with prefix caching off and on. With caching on, the first request
computes the prefix (cold) and every later one computes only its suffix (warm). Outputs of the two
runs are compared token for token. Default model: the ~50M random Llama of
bench/offline_throughput.py (built on the fly), greedy, float32 on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from offline_throughput import build_bench_model  # sibling script: bench/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="local HF model directory (default: ~50M Llama)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.json")
    return p.parse_args(argv)


def run(model_dir, prompts, args, caching: bool):
    from kvserve.runtime import LLMEngine, SamplingParams

    engine = LLMEngine.from_args(model=str(model_dir), device=args.device, dtype=args.dtype,
                                 block_size=args.block_size, enable_prefix_caching=caching,
                                 max_model_len=args.prefix_len + args.suffix_len + args.output_len + 16,
                                 kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # One throwaway request of unrelated tokens: first-call warm-up must not count as "cold".
    engine.add_request("warmup", [5] * 64, params)
    while engine.has_unfinished_requests():
        engine.step()
    ttfts, outputs = [], []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"r{i}", prompt, params)
        ttft = None
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - start
                if out.finished:
                    final = out
        ttfts.append(ttft)
        outputs.append(final.outputs[0].token_ids)
    stats = engine.get_stats()
    return ttfts, outputs, stats


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or build_bench_model(RESULTS / "models" / "llama-50m-gqa4")
    from kvserve.runtime.model_config import ModelConfig

    mcfg = ModelConfig.from_pretrained(model_dir)
    rng = random.Random(args.seed)
    usable = range(4, mcfg.vocab_size)
    prefix = [rng.choice(usable) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.choice(usable) for _ in range(args.suffix_len)] for _ in range(args.num_requests)]
    print(f"model {model_dir} ({mcfg.architecture}), {args.device}, {torch.get_num_threads()} threads; "
          f"{args.num_requests} requests = {args.prefix_len}-token shared prefix + {args.suffix_len}-token "
          f"suffix, {args.output_len} output tokens, one after another", flush=True)

    results = {}
    for caching in (False, True):
        ttfts, outs, stats = run(model_dir, prompts, args, caching)
        results[caching] = dict(ttft_s=ttfts, outputs=outs, hits=stats.prefix_cache_hits_total,
                                queries=stats.prefix_cache_queries_total)
    off, on = results[False], results[True]
    identical = off["outputs"] == on["outputs"]
    off_mean = statistics.mean(off["ttft_s"])
    warm = on["ttft_s"][1:]
    warm_mean = statistics.mean(warm) if warm else float("nan")
    rows = [
        ("caching off (every request)", off_mean * 1e3, statistics.median(off["ttft_s"]) * 1e3, 1.0),
        ("caching on, first (cold)", on["ttft_s"][0] * 1e3, on["ttft_s"][0] * 1e3, off_mean / on["ttft_s"][0]),
        ("caching on, later (warm)", warm_mean * 1e3, statistics.median(warm) * 1e3, off_mean / warm_mean),
    ]
    print(f"\n{'run':<30}{'mean TTFT ms':>14}{'median ms':>12}{'speedup':>10}")
    for name, mean, med, speed in rows:
        print(f"{name:<30}{mean:>14.1f}{med:>12.1f}{speed:>9.2f}x")
    hit_rate = on["hits"] / on["queries"] if on["queries"] else 0.0
    print(f"\nprefix cache: {on['hits']} of {on['queries']} queried tokens hit ({hit_rate:.1%}); "
          f"outputs identical on/off: {identical}")

    record = dict(
        benchmark="prefix_cache", model=str(model_dir), device=args.device, threads=torch.get_num_threads(),
        prefix_len=args.prefix_len, suffix_len=args.suffix_len, num_requests=args.num_requests,
        output_len=args.output_len, block_size=args.block_size,
        ttft_off_s=off["ttft_s"], ttft_on_s=on["ttft_s"], ttft_off_mean_s=off_mean, ttft_on_warm_mean_s=warm_mean,
        warm_speedup=off_mean / warm_mean, prefix_cache_hits=on["hits"], prefix_cache_queries=on["queries"],
        outputs_identical=identical, machine=platform.platform(), cpu_count=os.cpu_count(),
        date=time.strftime("%Y-%m-%d"),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
