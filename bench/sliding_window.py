"""Sliding window: KV memory and capacity for long contexts, window vs full attention, measured
from the block manager.

    python bench/sliding_window.py                          # window 256, contexts 128..4096
    python bench/sliding_window.py --window 1024 --contexts 512 2048 8192 --device cuda

One random-weight Mistral-shaped model (~3M parameters, built on the fly) is served twice with
identical weights: with `sliding_window` = W (every layer local, so the scheduler gives back the
blocks behind each sequence's window) and with `sliding_window: null` (full attention).

1. Per sequence: one request per context length, stepped to the end; the most blocks it held at
   once (read from the block manager after every step) in tokens and KV bytes, next to what the
   capacity model predicts (`kv_tokens_held`).
2. Capacity: N requests submitted at once into one fixed pool, each a short prompt decoded out to
   a long context (so that they all run together: chunked prefill admits one long prompt at a
   time, which would hide the memory limit); the most sequences that ran at once and the most
   blocks in use, preemptions, wall time, and the capacity model's
   `max_sequences_at_context_len` for that pool.

3. Local and global layers (Gemma): a random-weight Gemma 2-shaped model (alternating local and
   global layers, the same window) serves one `--gemma-context`-token sequence with the hybrid
   KV cache manager (one block table and pool per layer group: the local layers hold their
   window) and with `disable_hybrid_kv_cache_manager` (one table: every layer holds the context);
   the most KV bytes held at once, summed over the groups, next to the capacity model's
   `kv_tokens_held` with and without groups. `--parts gemma` runs only this part and merges it
   into an existing JSON.

Greedy outputs of the two models are not compared: they are different models once a context is
longer than the window. Prints a table and writes bench/results/sliding_window.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--pool-blocks", type=int, default=256, help="KV pool of the capacity run, in blocks")
    p.add_argument("--num-requests", type=int, default=8, help="requests of the capacity run")
    p.add_argument("--capacity-context", type=int, default=1024, help="context each capacity-run request reaches")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of each capacity-run request")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--gemma-context", type=int, default=4096, help="context of the Gemma-shaped run (part 3)")
    p.add_argument("--parts", nargs="+", choices=("sequence", "capacity", "gemma"),
                   default=["sequence", "capacity", "gemma"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "sliding_window.json")
    return p.parse_args(argv)


def build_models(root: Path, window: int, max_len: int) -> tuple[Path, Path]:
    """The same random weights twice: config sliding_window = window, and null."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    windowed, full = root / f"mistral-3m-w{window}", root / "mistral-3m-full"
    if not (windowed / "config.json").is_file():
        config = transformers.MistralConfig(
            vocab_size=8000, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
            sliding_window=window, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        transformers.MistralForCausalLM(config).save_pretrained(windowed, safe_serialization=True)
        specials = ["<pad>", "<s>", "</s>", "<unk>"]
        vocab = {tok: i for i, tok in enumerate(specials)}
        vocab.update({f"w{i}": i for i in range(len(specials), config.vocab_size)})
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                             eos_token="</s>", unk_token="<unk>").save_pretrained(windowed)
    cfg = json.loads((windowed / "config.json").read_text())
    if cfg.get("max_position_embeddings", 0) < max_len:
        cfg["max_position_embeddings"] = max_len
        (windowed / "config.json").write_text(json.dumps(cfg, indent=2))
    if full.exists():
        shutil.rmtree(full)
    shutil.copytree(windowed, full)
    (full / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}, indent=2))
    return windowed, full


def build_gemma(root: Path, window: int, max_len: int, tokenizer_from: Path) -> Path:
    """A Gemma 2-shaped random model: 4 layers, local (window) and global alternating."""
    import torch
    import transformers

    path = root / f"gemma2-3m-w{window}-{max_len}"
    if not (path / "config.json").is_file():
        config = transformers.Gemma2Config(
            vocab_size=8000, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=max_len, sliding_window=window,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        transformers.Gemma2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
        for f in tokenizer_from.iterdir():
            if "token" in f.name:
                shutil.copy(f, path / f.name)
    return path


def gemma_part(args, rng, params, tokenizer_from: Path) -> dict:
    """One long sequence with and without KV cache groups: the most KV bytes held at once."""
    import torch

    from kvserve.runtime import LLMEngine
    from kvserve.runtime.capacity import kv_bytes_per_token, kv_tokens_held

    context = args.gemma_context
    model_dir = build_gemma(RESULTS / "models", args.window, context + 64, tokenizer_from)
    prompt = [rng.randrange(4, 8000) for _ in range(context - args.output_len)]
    blocks = context // args.block_size + 8
    out = dict(context=context, window=args.window, layers="4 (2 local, 2 global)")
    for name, disable in (("groups", False), ("one_table", True)):
        engine = LLMEngine.from_args(model=str(model_dir), device=args.device, block_size=args.block_size,
                                     num_kv_blocks=blocks, max_model_len=context + 64, enable_prefix_caching=False,
                                     max_num_batched_tokens=args.max_num_batched_tokens,
                                     disable_hybrid_kv_cache_manager=disable)
        shape = engine.model_config.shape
        size = torch.empty((), dtype=engine.dtype).element_size()
        layer_token_bytes = kv_bytes_per_token(shape, size) // shape.num_layers
        bm = engine.block_manager
        managers = getattr(bm, "managers", [bm])
        layers = [len(g.layers) for g in engine.kv_groups] if engine.kv_groups else [shape.num_layers]
        engine.add_request("0", {"prompt_token_ids": prompt}, params)
        peaks = [0] * len(managers)
        peak_bytes = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            used = [m.num_used_blocks for m in managers]
            peaks = [max(p, u) for p, u in zip(peaks, used)]
            peak_bytes = max(peak_bytes, sum(u * n for u, n in zip(used, layers)) * args.block_size * layer_token_bytes)
        seconds = time.perf_counter() - start
        assert bm.num_used_blocks == 0, "leaked KV blocks"
        predicted = kv_tokens_held(shape, context - 1, block_size=args.block_size,
                                   max_step_tokens=args.max_num_batched_tokens, kv_cache_groups=not disable)
        out[name] = dict(peak_blocks_per_group=peaks, peak_kv_bytes=peak_bytes,
                         predicted_kv_bytes=predicted * kv_bytes_per_token(shape, size), seconds=seconds)
    g, one = out["groups"], out["one_table"]
    print(f"\n3. Gemma 2-shaped (4 layers: 2 local with window {args.window}, 2 global), one {context}-token "
          f"sequence: the most KV held at once, model prediction in ()")
    print(f"{'':>24} {'KiB held':>9} {'(model)':>9} {'blocks per group':>18} {'seconds':>8}")
    for label, r in (("hybrid KV cache groups", g), ("one block table", one)):
        print(f"{label:>24} {r['peak_kv_bytes'] / 1024:>9.0f} ({r['predicted_kv_bytes'] / 1024:>6.0f}) "
              f"{str(r['peak_blocks_per_group']):>18} {r['seconds']:>8.1f}")
    print(f"one table / groups: {one['peak_kv_bytes'] / g['peak_kv_bytes']:.2f}x the KV bytes")
    return out


def engine_for(model_dir: Path, args, num_blocks: int, max_len: int):
    from kvserve.runtime import LLMEngine

    return LLMEngine.from_args(model=str(model_dir), device=args.device, block_size=args.block_size,
                               num_kv_blocks=num_blocks, max_model_len=max_len, enable_prefix_caching=False,
                               max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256)


def drive(engine, prompts, params):
    """Submits every prompt at once and steps to the end: (peak blocks, peak running, seconds)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    peak_blocks = peak_running = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
        peak_running = max(peak_running, engine.scheduler.num_running)
    elapsed = time.perf_counter() - start
    assert engine.block_manager.num_used_blocks == 0, "leaked KV blocks"
    return peak_blocks, peak_running, elapsed


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kvserve.runtime import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    max_len = max(max(args.contexts), args.capacity_context) + 64
    windowed, full = build_models(RESULTS / "models", args.window, max_len)
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    load = os.getloadavg()
    print(f"Mistral-shaped 3M model, window {args.window} vs full attention, block {args.block_size}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, {args.device}, {torch.get_num_threads()} "
          f"threads, load average {load[0]:.2f}", flush=True)

    record = dict(benchmark="sliding_window", window=args.window, block_size=args.block_size,
                  max_num_batched_tokens=args.max_num_batched_tokens, output_len=args.output_len)
    if set(args.parts) != {"sequence", "capacity", "gemma"} and args.out.is_file():
        record = {**json.loads(args.out.read_text()), **record}  # a partial run updates its parts only
    if "sequence" in args.parts:
        record["per_sequence"] = per_sequence_part(args, rng, params, windowed, full, max_len)
    if "capacity" in args.parts:
        record.update(capacity_part(args, rng, windowed, full, max_len))
    if "gemma" in args.parts:
        record["gemma"] = gemma_part(args, rng, params, windowed)
    record.update(device=args.device, threads=torch.get_num_threads(), load_average=load,
                  machine=platform.platform(), cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0


def per_sequence_part(args, rng, params, windowed: Path, full: Path, max_len: int) -> list:
    import torch

    from kvserve.runtime.capacity import kv_bytes_per_token, kv_tokens_held

    per_seq = []
    big = max(args.contexts) // args.block_size + 8
    for context in args.contexts:
        prompt = [rng.randrange(4, 8000) for _ in range(context - args.output_len)]
        row = dict(context=context)
        for name, model_dir in (("window", windowed), ("full", full)):
            engine = engine_for(model_dir, args, big, max_len)
            shape = engine.model_config.shape
            per_token = kv_bytes_per_token(shape, torch.empty((), dtype=engine.dtype).element_size())
            blocks, _, seconds = drive(engine, [prompt], params)
            # K/V slots the sequence needs: its context minus the last sampled token.
            predicted = kv_tokens_held(shape, context - 1, block_size=args.block_size,
                                       max_step_tokens=args.max_num_batched_tokens)
            row[name] = dict(peak_blocks=blocks, peak_tokens=blocks * args.block_size,
                             peak_kv_bytes=blocks * args.block_size * per_token, predicted_tokens=predicted,
                             seconds=seconds)
        per_seq.append(row)

    print("\n1. one sequence: the most KV it holds at once (block manager), model prediction in ()")
    print(f"{'context':>8} {'window: tokens':>18} {'KiB':>8} {'full: tokens':>16} {'KiB':>8} {'full / window':>14}")
    for row in per_seq:
        w, f = row["window"], row["full"]
        print(f"{row['context']:>8} {w['peak_tokens']:>10} ({w['predicted_tokens']:>5}) {w['peak_kv_bytes'] / 1024:>8.0f} "
              f"{f['peak_tokens']:>8} ({f['predicted_tokens']:>5}) {f['peak_kv_bytes'] / 1024:>8.0f} "
              f"{f['peak_tokens'] / w['peak_tokens']:>13.2f}x")
    return per_seq


def capacity_part(args, rng, windowed: Path, full: Path, max_len: int) -> dict:
    import torch

    from kvserve.runtime import SamplingParams
    from kvserve.runtime.capacity import kv_bytes_per_token, plan_capacity, weight_bytes_per_gpu

    context = args.capacity_context
    prompts = [[rng.randrange(4, 8000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    long_params = SamplingParams(temperature=0, max_tokens=context - args.prompt_len, ignore_eos=True)
    capacity = {}
    for name, model_dir in (("window", windowed), ("full", full)):
        engine = engine_for(model_dir, args, args.pool_blocks, max_len)
        shape = engine.model_config.shape
        size = torch.empty((), dtype=engine.dtype).element_size()
        pool_bytes = args.pool_blocks * args.block_size * kv_bytes_per_token(shape, size)
        # A "GPU" holding exactly the weights and this pool: the plan's KV budget is the pool.
        plan = plan_capacity(shape, dtype_size=size, block_size=args.block_size, tp=1, gpu_memory_utilization=1.0,
                             gpu_memory_bytes=weight_bytes_per_gpu(shape, size) + pool_bytes,
                             activation_reserve_bytes=0, context_len=context - 1,
                             max_step_tokens=args.max_num_batched_tokens)
        assert plan.kv_blocks == args.pool_blocks
        blocks, running, seconds = drive(engine, prompts, long_params)
        stats = engine.get_stats()
        generated = args.num_requests * (context - args.prompt_len)
        capacity[name] = dict(pool_blocks=args.pool_blocks, pool_tokens=args.pool_blocks * args.block_size,
                              pool_kv_bytes=pool_bytes, peak_blocks=blocks, peak_running=running,
                              predicted_max_sequences=plan.max_sequences_at_context_len,
                              preemptions=stats.num_preemptions_total, seconds=seconds,
                              generated_tokens_per_second=generated / seconds)
    print(f"\n2. {args.num_requests} requests at once, {args.prompt_len}-token prompts decoded to {context} tokens, "
          f"in {args.pool_blocks} blocks ({args.pool_blocks * args.block_size} token slots)")
    print(f"{'model':>8} {'most running':>13} {'model says':>11} {'most blocks':>12} {'preemptions':>12} "
          f"{'seconds':>9} {'gen tok/s':>10}")
    for name, c in capacity.items():
        print(f"{name:>8} {c['peak_running']:>13} {c['predicted_max_sequences']:>11} {c['peak_blocks']:>12} "
              f"{c['preemptions']:>12} {c['seconds']:>9.1f} {c['generated_tokens_per_second']:>10.0f}")
    ratio = capacity["full"]["seconds"] / capacity["window"]["seconds"]
    print(f"window vs full wall time: {ratio:.2f}x faster")
    return dict(capacity_context=context, capacity_prompt_len=args.prompt_len, capacity=capacity)


if __name__ == "__main__":
    sys.exit(main())
