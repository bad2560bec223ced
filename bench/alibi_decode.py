"""ALiBi (and rotary Falcon) decode on the CPU: before and after the native paths, side by side.

    python bench/alibi_decode.py                       # MPT and BLOOM, 16 layers x 576, batches 1 and 8
    python bench/alibi_decode.py --families bloom --batches 1 --threads 2
    python bench/alibi_decode.py --families falcon-7b,falcon-40b   # rotary Falcon's parallel layers

Variants, interleaved round by round on the same engine (float32, the torch attention backend):
  before   the per-op path with torch gather + SDPA attention (what ALiBi layers ran before the
           native kernel had a slope term)
  per-op   the per-op path with the native paged decode kernel (its ALiBi term)
  stack    one native call per decode step (models/native_decode.py; the default now)
Decode tokens/s = batch * (N - 1) / (time of N tokens - time of 1 token): the prefill and the
first token cancel. With one thread the times are process CPU time, with more wall time.
Random weights (testing/tinymodels.py) with a SmolLM2-like width.
Writes bench/results/alibi_decode.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# Rotary Falcon layouts (the parallel layer): Falcon-7B's multi-query attention with one
# LayerNorm, Falcon-40B's grouped KV heads with a LayerNorm per branch.
FAMILIES = {
    "falcon-7b": ("falcon", dict(alibi=False, parallel_attn=True, bias=False, multi_query=True,
                                 new_decoder_architecture=False)),
    "falcon-40b": ("falcon", dict(alibi=False, parallel_attn=True, bias=False, multi_query=True,
                                  new_decoder_architecture=True, num_kv_heads=3)),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="mpt,bloom")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request in the long run")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "alibi_decode.json")
    return p.parse_args(argv)


@contextlib.contextmanager
def variant(model, name: str):
    from kvserve.kernels.cpu import native

    stack, supported = model._native_stack, native.decode_supported
    if name != "stack":
        model._native_stack = None
    if name == "before":
        native.decode_supported = lambda q, k: False
    try:
        yield
    finally:
        model._native_stack, native.decode_supported = stack, supported


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "?"
    return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni") if f in flags)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kvserve.runtime import LLM, SamplingParams
    from kvserve.testing.tinymodels import build_tiny_model

    torch.set_num_threads(args.threads)
    # One thread: process CPU time (what the work costs; steadier on a shared machine); more: wall time.
    clock = time.process_time if args.threads == 1 else time.perf_counter
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            arch, extra = FAMILIES.get(family, (family, {}))
            path = build_tiny_model(Path(tmp) / family, arch, hidden_size=args.hidden,
                                    num_attention_heads=args.heads, num_hidden_layers=args.layers,
                                    vocab_size=4096, max_position_embeddings=2048, **extra)
            llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=512, block_size=16,
                      enable_prefix_caching=False)
            model = llm.engine.model
            for batch in (int(b) for b in args.batches.split(",")):
                prompts = [{"prompt_token_ids": [(7 * i + j) % 4000 + 3 for j in range(args.prompt)]}
                           for i in range(batch)]

                def run(n: int) -> float:
                    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                    t0 = clock()
                    llm.generate(prompts, params, use_tqdm=False)
                    return clock() - t0

                run(4)  # builds the stack, warms the kernels
                times: dict[str, list[float]] = {"before": [], "per-op": [], "stack": []}
                for _ in range(args.rounds):
                    for name in times:
                        with variant(model, name):
                            times[name].append(run(args.tokens) - run(1))
                row = {"family": family, "batch": batch}
                for name, ts in times.items():
                    row[f"{name}_tok_s"] = batch * (args.tokens - 1) / statistics.median(ts)
                row["stack_vs_before"] = row["stack_tok_s"] / row["before_tok_s"]
                results.append(row)
                print(f"{family:10s} batch {batch:2d}: before {row['before_tok_s']:7.1f} tok/s  per-op "
                      f"{row['per-op_tok_s']:7.1f}  stack {row['stack_tok_s']:7.1f}  "
                      f"stack/before {row['stack_vs_before']:.2f}x", flush=True)
            llm.close()
    meta = {"clock": clock.__name__, "threads": args.threads, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "prompt": args.prompt, "tokens": args.tokens, "rounds": args.rounds, "cpu_flags": cpu_flags(),
            "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
