"""Pipeline parallelism on CPU: PP=2 against TP=2 and TP=1, the same requests.

A random-weight Llama-shaped model (testing/tinymodels.py, 8 layers, hidden 512, 8 heads / 4 KV
heads: SmolLM2-135M's 9 heads do not split in two), float32, offline `LLM`. Every rank gets one
torch thread, so PP=2 and TP=2 use two cores and TP=1 one. Per layout:

- TTFT: one request, max_tokens 1 (prefill of a 64-token prompt), median of 3;
- TPOT: one request of 64 output tokens, (total - TTFT) / 63;
- throughput: 16 requests of 64 output tokens at once, output tokens per second;
- bubble: kvserve:pipeline_bubble_fraction after the batch (stage 0's idle share of a step).

Then one PP=2 engine alternates one step in flight (the bubble) with one micro-batch per stage
(the default, max_concurrent_batches = P), `--rounds` rounds of `--batch` requests, so both
see the same machine load. `--only PP` runs only the layouts whose name starts with PP.

    python bench/pipeline.py            # prints a table, writes bench/results/pipeline.json
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvserve.runtime import LLM, SamplingParams
from kvserve.testing.tinymodels import build_tiny_model

SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=8192)
LAYOUTS = [("TP=1", dict()), ("TP=2", dict(tensor_parallel_size=2)), ("PP=2", dict(pipeline_parallel_size=2))]


def prompts(n: int, length: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, SHAPE["vocab_size"], (length,), generator=g).tolist() for _ in range(n)]


def measure(model_dir: Path, kw: dict) -> dict:
    out = {}
    with LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=256 << 20, **kw) as llm:
        llm.generate(prompts(1), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
        ttfts = []
        for _ in range(3):
            t = time.perf_counter()
            llm.generate(prompts(1), SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            ttfts.append(time.perf_counter() - t)
        out["ttft_s"] = statistics.median(ttfts)
        t = time.perf_counter()
        llm.generate(prompts(1), SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
        out["tpot_s"] = (time.perf_counter() - t - out["ttft_s"]) / 63
        t = time.perf_counter()
        outs = llm.generate(prompts(16), SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - t
        out["throughput_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / wall
        out["bubble_fraction"] = llm.engine.get_stats().pipeline_bubble_fraction
    return out


def measure_overlap(model_dir: Path, rounds: int, batch: int) -> dict:
    """One PP=2 engine, its steps alternately one in flight (depth 1: the bubble) and one
    micro-batch per stage (depth 2), round after round, so both see the same machine load; the
    median round of each. The depth is the engine core's own switch (EngineCore.depth)."""
    out = {1: [], 2: []}
    bubbles = {1: [], 2: []}
    with LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=256 << 20,
             pipeline_parallel_size=2) as llm:
        core, executor = llm.engine.core, llm.engine.executor
        llm.generate(prompts(2), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
        for _ in range(rounds):
            for depth in (1, 2):
                core.depth = depth
                executor.pipeline_bubble_fraction = 0.0
                t = time.perf_counter()
                outs = llm.generate(prompts(batch), SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
                out[depth].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
                bubbles[depth].append(executor.pipeline_bubble_fraction)
    return {f"depth{d}": dict(throughput_tok_s=statistics.median(out[d]), rounds_tok_s=out[d],
                              bubble_fraction=statistics.median(bubbles[d])) for d in (1, 2)}


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="run only the layouts whose name starts with this")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the PP=2 depth comparison")
    parser.add_argument("--batch", type=int, default=16, help="requests per round of the depth comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", "llama", **SHAPE)
        for name, kw in LAYOUTS:
            if name.startswith(args.only):
                results[name] = measure(model_dir, kw)
    base = next(iter(results.values()))
    print(f"{'layout':14} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>8} {'bubble':>7}  vs {next(iter(results))} (tok/s)")
    for name, r in results.items():
        print(f"{name:14} {r['ttft_s'] * 1e3:9.1f} {r['tpot_s'] * 1e3:9.1f} {r['throughput_tok_s']:8.1f} "
              f"{r['bubble_fraction']:7.2f}  {r['throughput_tok_s'] / base['throughput_tok_s']:.2f}x")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", "llama", **SHAPE)
        overlap = measure_overlap(model_dir, args.rounds, args.batch)
    one, two = overlap["depth1"], overlap["depth2"]
    print(f"\nPP=2, {args.batch} requests x 64 tokens, median of {args.rounds} alternating rounds")
    print(f"{'in flight':14} {'tok/s':>8} {'bubble':>7}  rounds (tok/s)")
    for name, r in (("1 step", one), ("2 micro-batches", two)):
        print(f"{name:14} {r['throughput_tok_s']:8.1f} {r['bubble_fraction']:7.2f}  "
              + " ".join(f"{x:.0f}" for x in r["rounds_tok_s"]))
    print(f"micro-batches vs one step: {two['throughput_tok_s'] / one['throughput_tok_s']:.2f}x")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "shape": SHAPE,
              "command": " ".join(["python bench/pipeline.py", *sys.argv[1:]]), "results": results,
              "pp2_overlap": overlap, "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    path = Path(__file__).parent / "results" / "pipeline.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
