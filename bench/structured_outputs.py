"""Structured outputs: what the grammar mask costs per token, and how long a schema compiles.

    python bench/structured_outputs.py                    # SmolLM2-135M-Instruct, batch 1 and 32
    python bench/structured_outputs.py --batch-sizes 1,8,32 --tokens 48 --rounds 3
    python bench/structured_outputs.py --model DIR --device cuda

Decode speed: the same batch of B requests decodes --tokens tokens with no constraint and with a
JSON schema (an array of at least 100 records: it cannot finish inside the run, so every step
is a full-batch decode whose rows all carry a grammar). Only pure decode steps are timed (after
every prompt's prefill), in interleaved rounds (free, json, free, json, ...), each mode keeping
its median step; ms/token = step time / B. The mask's own share (filling the bitmask for every
grammar row and applying it) is timed inside the same steps.

Compile: a 20-field schema (strings, bounded integers, numbers, booleans, enums, an array and a
nested object), cold (a schema never seen, new field names each time) and cached, plus the
one-time vocabulary scan (xgrammar's TokenizerInfo) of the model's tokenizer.

Prints a table and writes JSON (bench/results/structured_outputs.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per mode")
    p.add_argument("--compile-repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "structured_outputs.json")
    return p.parse_args(argv)


RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0}, "name": {"type": "string"}, "score": {"type": "number"},
    "ok": {"type": "boolean"}}, "required": ["id", "name", "score", "ok"]}
LONG_JSON = {"type": "array", "items": RECORD, "minItems": 100}


def schema_20(tag: str) -> dict:
    kinds = [{"type": "string"}, {"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "number"},
             {"type": "boolean"}, {"type": "string", "enum": ["red", "green", "blue"]}]
    props = {f"{tag}_{i}": dict(kinds[i % len(kinds)]) for i in range(18)}
    props[f"{tag}_list"] = {"type": "array", "items": {"type": "string"}, "maxItems": 5}
    props[f"{tag}_nested"] = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                              "required": ["a", "b"]}
    return {"type": "object", "properties": props, "required": list(props)}


class MaskTimer:
    """Wraps the sampler's mask hook to add up the time spent filling and applying bitmasks."""

    def __init__(self):
        import kvserve.runtime.sampler as sampler_mod

        self.mod = sampler_mod
        self.inner = sampler_mod.apply_grammar_bitmask
        self.total = 0.0
        sampler_mod.apply_grammar_bitmask = self

    def __call__(self, logits, states):
        start = time.perf_counter()
        self.inner(logits, states)
        self.total += time.perf_counter() - start


def decode_round(llm, prompts, params, tokens: int, timer: MaskTimer) -> tuple[float, float]:
    """Median pure-decode step (s) and mask seconds per step for one batch."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, p)
    steps, masks = [], []
    while engine.has_unfinished_requests():
        decode = engine.scheduler.num_waiting == 0 and all(
            s.num_uncomputed_tokens == 1 for s in engine.scheduler.running)
        timer.total = 0.0
        start = time.perf_counter()
        engine.step()
        if decode:
            steps.append(time.perf_counter() - start)
            masks.append(timer.total)
    steps, masks = steps[1:tokens + 1], masks[1:tokens + 1]  # skip the first decode (warm-up)
    return statistics.median(steps), statistics.mean(masks)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from kvserve.runtime import LLM, SamplingParams, StructuredOutputsParams
    from kvserve.runtime.structured_outputs.manager import StructuredOutputManager

    model = args.model
    if model is None:
        from kvserve.testing.realmodel import ensure_smollm2

        model = ensure_smollm2().hf_dir
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(str(model), device=args.device, max_num_seqs=max(batches), max_model_len=1024,
              kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    timer = MaskTimer()

    # -- compile ------------------------------------------------------------------------------------
    start = time.perf_counter()
    fresh = StructuredOutputManager(tok, llm.engine.vocab_size, [tok.eos_token_id])
    fresh._get_compiler()
    vocab_scan = time.perf_counter() - start
    cold, cached = [], []
    for r in range(args.compile_repeats):
        so = StructuredOutputsParams(json=schema_20(f"f{r}"))
        start = time.perf_counter()
        fresh.compile(so).result()
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        fresh.compile(StructuredOutputsParams(json=schema_20(f"f{r}"))).result()
        cached.append(time.perf_counter() - start)
    fresh.close()

    # -- decode -------------------------------------------------------------------------------------
    long_json = StructuredOutputsParams(json=LONG_JSON)
    llm.engine.structured_outputs.compile(long_json).result()
    prompt = tok.apply_chat_template([{"role": "user", "content": "List 100 records as JSON."}], tokenize=False,
                                     add_generation_prompt=True)
    rows = []
    for b in batches:
        free = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.tokens + 2, ignore_eos=True) for i in range(b)]
        constrained = [p.clone(structured_outputs=long_json) for p in free]
        results = {"free": [], "json": []}
        masks = []
        for _ in range(args.rounds):
            for mode, params in (("free", free), ("json", constrained)):
                step, mask = decode_round(llm, [prompt] * b, params, args.tokens, timer)
                print(f"  batch {b} {mode}: {step * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
                results[mode].append(step)
                if mode == "json":
                    masks.append(mask)
        free_ms = statistics.median(results["free"]) * 1e3
        json_ms = statistics.median(results["json"]) * 1e3
        rows.append({"batch": b, "free_ms_per_step": free_ms, "json_ms_per_step": json_ms,
                     "free_ms_per_token": free_ms / b, "json_ms_per_token": json_ms / b,
                     "overhead_pct": 100 * (json_ms / free_ms - 1),
                     "mask_ms_per_step": statistics.mean(masks) * 1e3,
                     "mask_pct_of_step": 100 * statistics.mean(masks) * 1e3 / json_ms})

    load = os.getloadavg()
    print(f"\nstructured outputs, {Path(model).name}, {args.device}, {torch.get_num_threads()} threads, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'batch':>5} | {'free ms/tok':>11} | {'json ms/tok':>11} | {'overhead':>8} | {'mask ms/step':>12} | "
          f"{'mask share':>10}")
    for r in rows:
        print(f"{r['batch']:>5} | {r['free_ms_per_token']:>11.2f} | {r['json_ms_per_token']:>11.2f} | "
              f"{r['overhead_pct']:>7.1f}% | {r['mask_ms_per_step']:>12.2f} | {r['mask_pct_of_step']:>9.1f}%")
    print(f"\n20-field schema compile: cold median {statistics.median(cold) * 1e3:.1f} ms "
          f"(min {min(cold) * 1e3:.1f}), cached {statistics.median(cached) * 1e6:.0f} us; "
          f"vocabulary scan once per engine {vocab_scan:.2f} s")
    result = {
        "benchmark": "structured_outputs", "model": str(Path(model).name), "device": args.device,
        "threads": torch.get_num_threads(), "tokens": args.tokens, "rounds": args.rounds,
        "machine": platform.processor() or platform.machine(), "load_average": load,
        "date": time.strftime("%Y-%m-%d"), "decode": rows,
        "compile_20_fields_s": {"cold": cold, "cached": cached, "vocab_scan": vocab_scan},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
