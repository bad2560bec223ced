"""The GPU half of issue 13's benchmark: CUDA graphs vs eager, and batch-1 decode vs the roofline.

    python bench/gpu_fastpath.py               # on a CUDA machine (exits with a message elsewhere)
    python bench/gpu_fastpath.py --quick       # 32 sequences, lengths 100-256

Model: a Qwen2-shaped decoder of about 0.5B parameters (Qwen2.5-0.5B's shape: hidden 896, 24
layers, 14 query / 2 KV heads, intermediate 4864, vocab 151936, tied embeddings) with random
weights, bfloat16, built on the fly (no hub access needed) with a word-level tokenizer.

  roofline   measured device copy bandwidth; weight bytes / bandwidth = the fastest a batch-1
             decode step can be (it reads every weight once)
  batch-1    ms/token of one 128-token-prompt request, graphs on vs --enforce-eager: wall time per
             step, and next to it the GPU's kernel time per step (torch.profiler, summed), so the
             host's share (wall - GPU) is visible
  offline    nano-vllm's workload: 256 sequences, input and output lengths uniform in 100-1024,
             ignore_eos, output tokens/s, graphs on vs off

Targets (issue 13): batch-1 within 1.3x of the roofline; graphs >= 2x eager at batch 1.
Writes bench/results/gpu_fastpath.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model-dir", type=Path, default=RESULTS / "models" / "qwen2-0.5b-random")
    p.add_argument("--out", type=Path, default=RESULTS / "gpu_fastpath.json")
    args = p.parse_args(argv)
    if args.quick:
        args.num_seqs, args.max_len, args.decode_tokens = 32, 256, 64
    return args


def build_model(path: Path) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab = 151936
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, rope_theta=1000000.0, torch_dtype="bfloat16",
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    words.update({f"w{i}": i for i in range(4, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                         eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    return path


def copy_bandwidth_GBps() -> float:
    import torch

    n = 256 * 1024 * 1024  # 1 GiB of bytes
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * n / sorted(times)[len(times) // 2] / 1e9


def batch1(model_dir: Path, eager: bool, n: int) -> float:
    from kvserve.runtime import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", enforce_eager=eager, max_model_len=4096)
    eng = llm.engine
    eng.add_request("w", {"prompt_token_ids": list(range(10, 42))}, SamplingParams(max_tokens=8, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("b1", {"prompt_token_ids": list(range(10, 138))},
                    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    eng.step()
    t0 = time.perf_counter()
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    ms = (time.perf_counter() - t0) / steps * 1000
    gpu_ms, kernels = gpu_ms_per_step(eng, min(n, 64))
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    llm.close()
    return ms, gpu_ms, kernels, weight_bytes


KERNEL_ROWS = 15


def gpu_ms_per_step(eng, n: int) -> tuple[float | None, list[dict]]:
    """The GPU's kernel time per batch-1 decode step: the self device time of every op the
    profiler saw over n steps of a fresh request (graph replays included), divided by n, and the
    kernels that took most of it. None if the profiler cannot see the device."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvserve.runtime import SamplingParams

    eng.add_request("gpu", {"prompt_token_ids": list(range(10, 138))},
                    SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
    eng.step()  # the prefill stays out of the window
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps = 0
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
            torch.cuda.synchronize()
        averages = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    except Exception as exc:  # a build without CUPTI, a profiler already running
        print(f"GPU time not measured: {exc}", flush=True)
        while eng.has_unfinished_requests():
            eng.step()
        return None, []
    steps = max(1, steps)
    total_us = sum(e.self_device_time_total for e in averages)
    # Where a step's GPU time goes, by kernel: what a fusion or a better kernel would have to win.
    top = sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)[:KERNEL_ROWS]
    kernels = [{"name": e.key[:90], "us_per_step": e.self_device_time_total / steps, "calls_per_step": e.count / steps}
               for e in top]
    return total_us / 1000 / steps, kernels


def offline(model_dir: Path, eager: bool, args) -> dict:
    from kvserve.runtime import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 151000) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_seqs)]
    outputs = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_seqs)]
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", enforce_eager=eager, max_model_len=4096)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    llm.close()
    return {"seconds": wall, "output_tokens": sum(outputs), "output_tokens_per_s": sum(outputs) / wall}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU (not measured)")
        return 0
    model_dir = build_model(args.model_dir)
    bw = copy_bandwidth_GBps()
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "copy_GBps": bw, "batch1_ms": {}, "batch1_gpu_ms": {}, "batch1_kernels": {}, "offline": {}}
    for eager in (False, True):
        key = "eager" if eager else "graphs"
        ms, gpu_ms, kernels, weight_bytes = batch1(model_dir, eager, args.decode_tokens)
        res["batch1_ms"][key] = ms
        res["batch1_gpu_ms"][key] = gpu_ms
        res["batch1_kernels"][key] = kernels
        res["roofline_ms"] = weight_bytes / (bw * 1e9) * 1000
        res["offline"][key] = offline(model_dir, eager, args)
        gpu = "not measured" if gpu_ms is None else f"{gpu_ms:.2f} ms"
        print(f"{key}: batch-1 {ms:.2f} ms/token wall, GPU {gpu}; offline {res['offline'][key]['output_tokens_per_s']:.0f} tok/s",
              flush=True)
    g, e, roof = res["batch1_ms"]["graphs"], res["batch1_ms"]["eager"], res["roofline_ms"]
    print(f"\n{res['device']}: copy {bw:.0f} GB/s, roofline {roof:.2f} ms/token")
    print(f"batch-1 graphs {g:.2f} ms ({g / roof:.2f}x roofline; target <= 1.3x: {'met' if g <= 1.3 * roof else 'NOT met'})")
    for key, gpu_ms in res["batch1_gpu_ms"].items():
        if gpu_ms is not None:
            wall = res["batch1_ms"][key]
            print(f"batch-1 {key}: {wall:.2f} ms wall = {gpu_ms:.2f} ms GPU + {wall - gpu_ms:.2f} ms host and gaps")
    if res["batch1_kernels"]["graphs"]:
        print(f"\nbatch-1 graphs, GPU time per step by kernel (top {KERNEL_ROWS}):")
        print(f"{'us/step':>8} {'calls/step':>10}  kernel")
        for k in res["batch1_kernels"]["graphs"]:
            print(f"{k['us_per_step']:8.1f} {k['calls_per_step']:10.1f}  {k['name']}")
        print()
    print(f"batch-1 eager {e:.2f} ms: graphs {e / g:.2f}x faster (target >= 2x: {'met' if e >= 2 * g else 'NOT met'})")
    print(f"offline graphs {res['offline']['graphs']['output_tokens_per_s']:.0f} tok/s, eager "
          f"{res['offline']['eager']['output_tokens_per_s']:.0f} tok/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
