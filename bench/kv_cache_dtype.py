"""KV cache dtype: capacity per GiB and decode speed with an fp8 KV cache vs the model dtype.

    python bench/kv_cache_dtype.py                         # SmolLM2-135M-Instruct, CPU, 2 threads
    python bench/kv_cache_dtype.py --dtypes float32 --batch 1 --context 256 --rounds 1   # quick
    python bench/kv_cache_dtype.py --device cuda --dtypes bfloat16 --context 4096 --batch 1,64

For each model dtype and kv_cache_dtype (auto, fp8_e4m3, fp8_e5m2), on the real SmolLM2 model
(testing/realmodel.py): the KV tokens one GiB of pool holds, measured from the engine's allocated
pool and predicted by the capacity model; decode ms/token at each batch size over a prompt of
--context tokens (greedy, ignore_eos; engines of one dtype interleaved over --rounds, each keeping
its best round, so load drifting on a shared machine does not favour one); and how closely greedy
text follows the auto cache's (tokens before the first difference, over a few real prompts), plus
the answer to "What is the capital of France?". Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

GiB = 1 << 30
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
TEXT_PROMPTS = ["The history of the Roman Empire", "def quicksort(xs):", "Photosynthesis is the process",
                "The three laws of motion are"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    p.add_argument("--batch", default="1,8", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--pool-bytes", type=int, default=256 << 20, help="KV pool of each engine")
    p.add_argument("--agree-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "kv_cache_dtype.json")
    return p.parse_args(argv)


def decode_ms_per_step(engine, prompts, output_len):
    """Wall time per decode step (from the first generated token to the last) for these prompts
    run together."""
    from kvserve.runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{time.monotonic_ns()}", {"prompt_token_ids": p}, params)
    started: set[str] = set()
    first = None  # timing starts once every prompt is prefilled (chunked prefill may take steps)
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None:
            started |= {o.request_id for o in outs if o.outputs[0].token_ids}
            if len(started) == len(prompts):
                first = time.perf_counter()
            continue
        steps += 1
    return (time.perf_counter() - first) * 1000 / max(1, steps)


def greedy_texts(llm, tokenizer, n):
    from kvserve.runtime import SamplingParams

    ids = [tokenizer.encode(t) for t in TEXT_PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    return [list(o.outputs[0].token_ids) for o in outs], chat


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kvserve.runtime import LLM
    from kvserve.runtime.capacity import kv_bytes_per_token, kv_cache_dtype_bytes

    torch.set_num_threads(args.threads)
    if args.model is None:
        from kvserve.testing.realmodel import ensure_smollm2

        args.model = ensure_smollm2().hf_dir
    batches = [int(b) for b in args.batch.split(",")]
    kv_dtypes = args.kv_dtypes.split(",")
    load = os.getloadavg()
    print(f"{args.model.name} on {args.device}, {torch.get_num_threads()} threads; context {args.context}, "
          f"{args.output_len} output tokens, batches {batches}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
          flush=True)
    rng = random.Random(0)
    rows = []
    for dtype in args.dtypes.split(","):
        engines = {}
        for kv in kv_dtypes:
            llm = LLM(str(args.model), dtype=dtype, device=args.device, kv_cache_dtype=kv,
                      kv_cache_memory_bytes=args.pool_bytes, max_model_len=args.context + args.output_len + 64,
                      max_num_seqs=max(batches), enable_prefix_caching=False)
            engines[kv] = llm
        vocab = engines[kv_dtypes[0]].engine.model_config.vocab_size
        prompt_sets = {b: [[rng.randrange(100, vocab) for _ in range(args.context)] for _ in range(b)] for b in batches}
        for llm in engines.values():  # warm-up: first-touch of pools and workspaces
            decode_ms_per_step(llm.engine, prompt_sets[batches[0]][:1], 4)
        best = {(kv, b): float("inf") for kv in kv_dtypes for b in batches}
        for _ in range(args.rounds):
            for b in batches:
                for kv, llm in engines.items():
                    best[kv, b] = min(best[kv, b], decode_ms_per_step(llm.engine, prompt_sets[b], args.output_len))
        texts = {kv: greedy_texts(llm, llm.get_tokenizer(), args.agree_tokens) for kv, llm in engines.items()}
        ref_tokens = texts.get("auto", texts[kv_dtypes[0]])[0]
        for kv, llm in engines.items():
            engine = llm.engine
            shape = engine.model_config.shape
            pool_bytes = sum(t.numel() * t.element_size() for layer in engine.kv_caches for t in layer)
            tokens = engine.num_kv_blocks * engine.config.block_size
            predicted = round(GiB / kv_bytes_per_token(shape, kv_cache_dtype_bytes(kv, dtype)))
            agree = [common_prefix(a, r) for a, r in zip(texts[kv][0], ref_tokens)]
            pool_dtype = str(engine.kv_caches[0][0].dtype).removeprefix("torch.")
            rows.append(dict(dtype=dtype, kv_cache_dtype=kv, pool_dtype=pool_dtype,
                             kv_bytes_per_token=kv_bytes_per_token(shape, kv_cache_dtype_bytes(kv, dtype)),
                             pool_bytes=pool_bytes, pool_tokens=tokens,
                             tokens_per_gib=round(tokens * GiB / pool_bytes), predicted_tokens_per_gib=predicted,
                             decode_ms_per_step={str(b): round(best[kv, b], 2) for b in batches},
                             greedy_prefix_vs_auto=agree, chat=texts[kv][1]))
            print(f"  {dtype}/{kv}: done", flush=True)
        del engines

    head = f"{'dtype':<10}{'kv cache':<10}{'B/token':>9}{'tokens/GiB':>12}{'predicted':>11}"
    head += "".join(f"{'ms/step b=' + str(b):>15}" for b in batches)
    head += f"{'  same greedy prefix (of ' + str(args.agree_tokens) + ')':<34}chat answer"
    print("\n" + head)
    for r in rows:
        line = (f"{r['dtype']:<10}{r['kv_cache_dtype']:<10}{r['kv_bytes_per_token']:>9}{r['tokens_per_gib']:>12}"
                f"{r['predicted_tokens_per_gib']:>11}")
        line += "".join(f"{r['decode_ms_per_step'][str(b)]:>15.1f}" for b in batches)
        line += f"  {str(r['greedy_prefix_vs_auto']):<32}{r['chat']!r}"
        print(line)
    load_end = os.getloadavg()
    record = dict(benchmark="kv_cache_dtype", model=str(args.model), device=args.device, threads=args.threads,
                  context=args.context, output_len=args.output_len, batches=batches, rounds=args.rounds, rows=rows,
                  load_average_start=load, load_average_end=load_end, machine=platform.platform(),
                  cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"load average at the end {load_end[0]:.1f} {load_end[1]:.1f} {load_end[2]:.1f}; wrote {args.out}")
    ok = all(r["tokens_per_gib"] == r["predicted_tokens_per_gib"] or
             abs(r["tokens_per_gib"] - r["predicted_tokens_per_gib"]) <= r["predicted_tokens_per_gib"] * 0.001
             for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
