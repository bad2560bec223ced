"""Offline throughput: the same model and prompts through three engines.

    (a) a transformers text-generation pipeline, one request at a time
    (b) transformers model.generate on static, left-padded batches (arrival order)
    (c) kvserve LLM.generate (paged KV cache, continuous batching, chunked prefill)

    python bench/offline_throughput.py               # 64 requests, prompts 32-512, outputs 16-256
    python bench/offline_throughput.py --quick       # 16 requests, prompts 32-128, outputs 16-64
    python bench/offline_throughput.py --model DIR --device cuda

Every request generates exactly its own number of tokens (ignore_eos; min_new_tokens=max_new_tokens
for transformers), greedy. Throughput counts each request's requested output tokens only: a
static batch that keeps decoding for its longest member does not get credit for the padding.
The default model is a random-weight Llama of about 50M parameters with a word-level tokenizer
(one word per token), built on the fly, so prompt lengths are exact in all three engines.
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="local HF model directory (default: build a ~50M Llama)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for (b)")
    p.add_argument("--pipeline-requests", type=int, default=16,
                   help="run (a) on only the first N requests, it being one request at a time "
                        "(its tokens/s is measured on those); 0 = all")
    p.add_argument("--engines", default="a,b,c", help="which of a,b,c to run")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="passed to kvserve")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="16 requests, prompts 32-128, outputs 16-64")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/offline_throughput[-quick].json)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 16)
        args.max_prompt = min(args.max_prompt, 128)
        args.max_output = min(args.max_output, 64)
    return args


def build_bench_model(path: Path) -> Path:
    """A random-weight Llama (~50M parameters) and a word-level tokenizer: word i <-> token i."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = 32000
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
        # Llama-3's 4:1 grouped-query ratio, scaled down.
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    return path


def make_workload(args, vocab_size: int, special_ids: set[int]):
    rng = random.Random(args.seed)
    usable = [t for t in range(min(vocab_size, 32000)) if t not in special_ids]
    prompts, outputs = [], []
    for _ in range(args.num_requests):
        n = rng.randint(args.min_prompt, args.max_prompt)
        prompts.append([rng.choice(usable) for _ in range(n)])
        outputs.append(rng.randint(args.min_output, args.max_output))
    return prompts, outputs


class Timer:
    """Wall time and this process's CPU time (all threads). On a shared machine the CPU time of a
    single-threaded run is a steadier measure of the work done than the wall time."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def run_pipeline(model_dir, tok, prompts, outputs, device, dtype):
    import torch
    import transformers

    pipe = transformers.pipeline("text-generation", model=str(model_dir), tokenizer=tok, device=device,
                                 dtype=dtype)
    texts = [tok.decode(p) for p in prompts]
    pipe(texts[0], max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up, not timed
    produced = 0
    with Timer() as timer, torch.inference_mode():
        for text, n in zip(texts, outputs):
            out = pipe(text, max_new_tokens=n, min_new_tokens=n, do_sample=False, return_tensors=True)
            # generated_token_ids holds prompt + output
            produced += len(out[0]["generated_token_ids"]) - len(tok(text).input_ids)
    return timer, produced


def run_static_batches(model_dir, prompts, outputs, batch_size, device, dtype, pad_id):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    with torch.inference_mode():  # warm-up, not timed
        warm = torch.tensor([prompts[0]], device=device)
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, pad_token_id=pad_id)
    useful = 0
    with Timer() as timer, torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch, wanted = prompts[i:i + batch_size], outputs[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(batch):  # left padding, as decoder-only generation needs
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            n = max(wanted)
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=pad_id)
            assert out.shape[1] - width == n
            useful += sum(wanted)
    return timer, useful


def run_kvserve(model_dir, prompts, outputs, args, dtype_name):
    from kvserve.runtime import LLM, SamplingParams

    kwargs = dict(dtype=dtype_name, device=args.device, block_size=args.block_size,
                  max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size)
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(str(model_dir), **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:2], [SamplingParams(max_tokens=2, ignore_eos=True)] * 2, use_tqdm=False)  # warm-up
    before = llm.engine.get_stats()
    with Timer() as timer:
        results = llm.generate(requests, params, use_tqdm=True)
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    assert produced == sum(outputs), (produced, sum(outputs))
    stats = llm.engine.get_stats()
    extra = dict(num_kv_blocks=llm.engine.num_kv_blocks,
                 max_num_batched_tokens=llm.engine.max_num_batched_tokens,
                 preemptions=stats.num_preemptions_total - before.num_preemptions_total)
    llm.close()  # tensor-parallel workers would otherwise hold their cores and memory through (a)/(b)
    return timer, produced, extra


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = args.model or build_bench_model(RESULTS / "models" / "llama-50m-gqa4")
    from transformers import AutoTokenizer

    from kvserve.runtime.engine import resolve_dtype
    from kvserve.runtime.model_config import ModelConfig

    mcfg = ModelConfig.from_pretrained(model_dir)
    dtype = resolve_dtype(args.dtype, mcfg.dtype, torch.device(args.device))
    dtype_name = str(dtype).removeprefix("torch.")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    specials = set(tok.all_special_ids) | set(mcfg.eos_token_ids)
    prompts, outputs = make_workload(args, mcfg.vocab_size, specials)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    from kvserve.runtime.capacity import weight_bytes_per_gpu

    params_m = weight_bytes_per_gpu(mcfg.shape, 1) / 1e6
    print(f"model {model_dir} ({mcfg.architecture}, {params_m:.1f}M params, {dtype_name}, {args.device}, "
          f"{torch.get_num_threads()} threads); {len(prompts)} requests, prompt tokens "
          f"{sum(map(len, prompts))} ({args.min_prompt}-{args.max_prompt}), output tokens {sum(outputs)} "
          f"({args.min_output}-{args.max_output})", flush=True)

    rows = {}
    engines = set(args.engines.split(","))
    if "c" in engines:
        t, n, extra = run_kvserve(model_dir, prompts, outputs, args, dtype_name)
        rows["c"] = dict(name="(c) kvserve LLM.generate", seconds=t.wall, cpu_seconds=t.cpu, output_tokens=n,
                         **extra)
        print(f"(c) done in {t.wall:.1f}s", flush=True)
    if "b" in engines:
        t, n = run_static_batches(model_dir, prompts, outputs, args.hf_batch_size, args.device, dtype, pad_id)
        rows["b"] = dict(name=f"(b) HF generate, static batches of {args.hf_batch_size}", seconds=t.wall,
                         cpu_seconds=t.cpu, output_tokens=n)
        print(f"(b) done in {t.wall:.1f}s", flush=True)
    if "a" in engines:
        k = min(args.pipeline_requests or len(prompts), len(prompts))
        t, n = run_pipeline(model_dir, tok, prompts[:k], outputs[:k], args.device, dtype)
        name = "(a) HF pipeline, one request at a time" + (f" (first {k} requests)" if k < len(prompts) else "")
        rows["a"] = dict(name=name, seconds=t.wall, cpu_seconds=t.cpu, output_tokens=n)
        print(f"(a) done in {t.wall:.1f}s", flush=True)

    base = rows.get("b")
    print()
    print(f"{'engine':<60} {'output tok/s':>12} {'wall s':>8} {'vs (b)':>7} {'tok/CPU-s':>10} {'vs (b)':>7}")
    for key in ("a", "b", "c"):
        if key not in rows:
            continue
        r = rows[key]
        r["output_tokens_per_s"] = r["output_tokens"] / r["seconds"]
        r["output_tokens_per_cpu_s"] = r["output_tokens"] / r["cpu_seconds"]
        r["speedup_vs_b"] = r["output_tokens_per_s"] / (base["output_tokens"] / base["seconds"]) if base else None
        r["cpu_speedup_vs_b"] = (r["output_tokens_per_cpu_s"] / (base["output_tokens"] / base["cpu_seconds"])
                                 if base else None)
        speed = f"{r['speedup_vs_b']:.2f}x" if base else "-"
        cpu_speed = f"{r['cpu_speedup_vs_b']:.2f}x" if base else "-"
        print(f"{r['name']:<60} {r['output_tokens_per_s']:>12.1f} {r['seconds']:>8.1f} {speed:>7} "
              f"{r['output_tokens_per_cpu_s']:>10.1f} {cpu_speed:>7}")

    result = dict(
        benchmark="offline_throughput", date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        model=str(model_dir), architecture=mcfg.architecture, params_millions=round(params_m, 1),
        dtype=dtype_name, device=args.device,
        threads=torch.get_num_threads(), machine=platform.platform(), cpu_count=os.cpu_count(),
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)), output_tokens=sum(outputs),
        results=rows,
    )
    out = args.out or RESULTS / ("offline_throughput-quick.json" if args.quick else "offline_throughput.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
