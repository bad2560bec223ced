"""Tensor parallelism: the same model and workload at tp=1 and tp=N, per-step latency and throughput.

    python bench/tensor_parallel.py                          # CPU: tp=1 (1 and N threads) vs tp=N (1 thread/rank)
    python bench/tensor_parallel.py --device cuda --tp 2     # GPUs: tp=1 vs tp=2 (NCCL)
    python bench/tensor_parallel.py --tiny                   # a 2-layer hidden-64 model: compute is
                                                             # ~nothing, so TPOT shows TP's fixed cost

Three measurements per configuration, all greedy with ignore_eos:
  - startup: LLM(...) construction (worker processes, process group, shard loading, KV pools);
  - TPOT: the median wall time of a pure-decode engine step at each --decode-batch, i.e. the time
    per output token a running request sees (for tp=N it includes pickling the step's inputs to
    the workers, 2 all-reduces per layer and the logits all-gather);
  - throughput: LLM.generate over --num-requests requests (prompts and outputs drawn as in
    bench/offline_throughput.py), output tokens per second.
Configurations run interleaved --repeat times; the table shows medians (noisy shared machines).
The KV pool is a fixed per-rank byte budget (--kv-cache-memory-bytes), so the block counts show
the capacity growth as well. Writes bench/results/tensor_parallel[-DEVICE].json.
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

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
RESULTS = ROOT / "bench" / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model directory (default: the ~50M Llama "
                                                            "of bench/offline_throughput.py)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel degree compared with tp=1")
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads per rank")
    p.add_argument("--decode-batch", default="1,16", help="comma-separated decode batch sizes for TPOT")
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=64 << 20, help="per rank")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, 4 heads / 2 KV heads")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--collectives", action="store_true",
                   help="CPU: also time one gloo all-reduce between 2 processes at the model's hidden size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def build_tiny_model(path: Path) -> Path:
    """The tests' tiny Llama shape with a word-level tokenizer (word i <-> token i)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    vocab_size = 1024
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", "<unk>"])}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)
    return path


def _allreduce_rank(rank: int, port: int, hidden: int, batches: list[int], iters: int, out) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    times = {}
    for b in batches:
        x = torch.ones(b, hidden)
        for _ in range(20):
            dist.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        times[b] = (time.perf_counter() - t0) / iters * 1e6
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def allreduce_latency_us(hidden: int, batches: list[int], iters: int = 300) -> dict[int, float]:
    """Mean time of one gloo all-reduce of [batch, hidden] fp32 between 2 processes."""
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, hidden, batches, iters, out)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    times = out.get(timeout=120)
    for proc in procs:
        proc.join(30)
    return times


def measure(model_dir: Path, tp: int, threads: int, args, prompts, outputs) -> dict:
    import torch

    from kvserve.runtime import LLM, SamplingParams

    torch.set_num_threads(threads)  # tp workers copy the engine's thread count
    started = time.perf_counter()
    llm = LLM(str(model_dir), tensor_parallel_size=tp, device=args.device, dtype=args.dtype,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    startup = time.perf_counter() - started
    try:
        engine = llm.engine
        llm.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        tpot = {}
        rng = random.Random(args.seed)
        for batch in [int(b) for b in args.decode_batch.split(",")]:
            params = SamplingParams(temperature=0, max_tokens=args.decode_steps + 8, ignore_eos=True)
            ids = [f"tpot-{batch}-{i}" for i in range(batch)]
            for rid in ids:
                engine.add_request(rid, [rng.randrange(4, 1000) for _ in range(64)], params)
            times = []
            while engine.has_unfinished_requests():
                decode = all(seq.num_computed_tokens >= seq.num_prompt_tokens for seq in engine.scheduler.running) \
                    and engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == batch
                t0 = time.perf_counter()
                engine.step()
                if decode:
                    times.append(time.perf_counter() - t0)
            tpot[batch] = statistics.median(times[2:args.decode_steps + 2]) * 1e3
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        t0 = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        produced = sum(len(r.outputs[0].token_ids) for r in results)
        stats = engine.get_stats()
        return dict(tp=tp, threads_per_rank=threads, startup_s=startup, tpot_ms=tpot,
                    output_tokens=produced, seconds=elapsed, output_tokens_per_s=produced / elapsed,
                    kv_blocks=stats.kv_blocks_total, kv_capacity_tokens=stats.kv_cache_capacity_tokens,
                    ranks=(engine.executor.rank_reports if engine.executor else None))
    finally:
        llm.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    import offline_throughput as offline  # sibling script: bench/ is on sys.path
    import torch

    if args.tiny:
        model_dir = build_tiny_model(RESULTS / "models" / "llama-tiny")
    else:
        model_dir = args.model or offline.build_bench_model(RESULTS / "models" / "llama-50m-gqa4")
    from kvserve.runtime.model_config import ModelConfig

    mcfg = ModelConfig.from_pretrained(model_dir)
    wl = argparse.Namespace(seed=args.seed, num_requests=args.num_requests, min_prompt=args.min_prompt,
                            max_prompt=args.max_prompt, min_output=args.min_output, max_output=args.max_output)
    prompts, outputs = offline.make_workload(wl, mcfg.vocab_size, {0, 1, 2, 3} | set(mcfg.eos_token_ids))
    shape = mcfg.shape
    print(f"model {model_dir} ({mcfg.architecture}: {shape.num_layers} layers, hidden {shape.hidden_size}, "
          f"{shape.num_attention_heads} heads / {shape.num_kv_heads} KV heads), {args.device}; "
          f"{len(prompts)} requests, {sum(outputs)} output tokens", flush=True)

    if args.device == "cpu":
        configs = [(1, args.threads), (1, args.threads * args.tp), (args.tp, args.threads)]
    else:
        configs = [(1, args.threads), (args.tp, args.threads)]
    runs: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    for i in range(args.repeat):
        for tp, threads in configs:
            runs[(tp, threads)].append(measure(model_dir, tp, threads, args, prompts, outputs))
            print(f"run {i + 1}/{args.repeat} tp={tp} threads/rank={threads}: done "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    med = statistics.median
    rows = []
    for rs in runs.values():
        rows.append(dict(rs[0], startup_s=med(r["startup_s"] for r in rs),
                         tpot_ms={b: med(r["tpot_ms"][b] for r in rs) for b in rs[0]["tpot_ms"]},
                         output_tokens_per_s=med(r["output_tokens_per_s"] for r in rs), runs=rs))

    batches = [int(b) for b in args.decode_batch.split(",")]
    print(f"\nmedians of {args.repeat} interleaved runs")
    head = f"{'config':<26} {'startup s':>9} " + " ".join(f"{'TPOT ms b=' + str(b):>13}" for b in batches) + \
        f" {'output tok/s':>12} {'KV blocks':>9}"
    print(head)
    for r in rows:
        name = f"tp={r['tp']}, {r['threads_per_rank']} thread(s)/rank"
        tpots = " ".join(f"{r['tpot_ms'][b]:>13.2f}" for b in batches)
        print(f"{name:<26} {r['startup_s']:>9.2f} {tpots} {r['output_tokens_per_s']:>12.1f} {r['kv_blocks']:>9}")

    collectives = None
    if args.collectives:
        collectives = allreduce_latency_us(shape.hidden_size, batches)
        print("\ngloo all-reduce, 2 processes, fp32 [batch, hidden]: " +
              ", ".join(f"batch {b}: {us:.0f} us" for b, us in collectives.items()) +
              f"; a step runs {2 * shape.num_layers + 1} all-reduces and 1 all-gather")
    result = dict(benchmark="tensor_parallel", allreduce_us=collectives, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  model=str(model_dir), device=args.device, machine=platform.platform(), cpu_count=os.cpu_count(),
                  torch=torch.__version__, args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  results=rows)
    out = args.out or RESULTS / f"tensor_parallel-{args.device}{'-tiny' if args.tiny else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
