"""Pipeline parallelism on CPU: PP=2 against TP=2 and TP=1, the same requests.

A random-weight Llama-shaped model (testing/tinymodels.py, 8 layers, hidden 512, 8 heads / 4 KV
heads: SmolLM2-135M's 9 heads do not split in two), float32, offline `LLM`. Every rank gets one
torch thread, so PP=2 and TP=2 use two cores and TP=1 one. Per layout:

- TTFT: one request, max_tokens 1 (prefill of a 64-token prompt), median of 3;
- TPOT: one request of 64 output tokens, (total - TTFT) / 63;
- throughput: 16 requests of 64 output tokens at once, output tokens per second;
- bubble: kvserve:pipeline_bubble_fraction after the batch (stage 0's idle share of a step).

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


def main() -> int:
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", "llama", **SHAPE)
        for name, kw in LAYOUTS:
            results[name] = measure(model_dir, kw)
    base = results["TP=1"]
    print(f"{'layout':8} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>8} {'bubble':>7}  vs TP=1 (tok/s)")
    for name, r in results.items():
        print(f"{name:8} {r['ttft_s'] * 1e3:9.1f} {r['tpot_s'] * 1e3:9.1f} {r['throughput_tok_s']:8.1f} "
              f"{r['bubble_fraction']:7.2f}  {r['throughput_tok_s'] / base['throughput_tok_s']:.2f}x")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "shape": SHAPE,
              "command": "python bench/pipeline.py", "results": results}
    path = Path(__file__).parent / "results" / "pipeline.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
