"""LoRA adapters on the real SmolLM2-135M-Instruct: mixed-adapter throughput against the base
model alone, adapter load time and memory per adapter.

    python bench/lora.py                         # 48 requests, 8 rank-16 adapters + base, float32 CPU
    python bench/lora.py --quick                 # 16 requests, shorter outputs
    python bench/lora.py --device cuda --dtype bfloat16

Same requests (seeded prompt and output lengths, `ignore_eos`), all at once, through `LLM.generate`
in one process, the three runs interleaved for `--rounds` rounds (ratios are taken within a round):
  base         an engine without LoRA (the model's own path, the CPU's native decode stack);
  lora-base    an engine with enable_lora (max_loras 8) whose requests all use the base model;
  lora-mixed   the same engine, requests spread round-robin over 8 adapters and the base model.
Adapters: rank 16 on every q/k/v/o/gate/up/down, built with peft (kvserve.testing.adapters,
cached under build/smollm2-loras). Load time is `add_lora` (read the PEFT directory, check it,
keep it in host memory) and, separately, copying it into a device slot; memory is the host copy
(float32) and one device slot.
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
RESULTS = ROOT / "bench" / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--lora-dtype", default="auto", help="the adapters' slot dtype (vLLM's --lora-dtype)")
    p.add_argument("--quick", action="store_true", help="16 requests, outputs 16-64")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "lora.json")
    return p.parse_args(argv)


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]


def workload(args, vocab: int):
    rng = random.Random(args.seed)
    n = 16 if args.quick else args.num_requests
    out_range = (16, 64) if args.quick else (32, 128)
    prompts, lens = [], []
    for _ in range(n):
        plen = rng.randint(32, 256)
        prompts.append({"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(plen)]})
        lens.append(rng.randint(*out_range))
    return prompts, lens


def timed_generate(llm, prompts, lens, loras=None):
    from kvserve.runtime import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(wall_s=wall, output_tokens=tokens, tok_per_s=tokens / wall), [o.outputs[0].token_ids for o in outs]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kvserve.runtime import LLM, LoRARequest
    from kvserve.testing.adapters import ensure_smollm2_adapters
    from kvserve.testing.realmodel import ensure_smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    model = ensure_smollm2().hf_dir
    dirs = ensure_smollm2_adapters(model, args.num_adapters, r=args.rank)
    requests = [LoRARequest(f"adapter-{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
    kw = dict(device=args.device, dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    flags = cpu_flags()
    print(f"model {model}, {args.device}/{args.dtype}, {torch.get_num_threads()} threads, "
          f"CPU flags {' '.join(flags) or '?'}, {args.num_adapters} adapters of rank {args.rank}")

    results: dict = {"base": [], "lora-base": [], "lora-mixed": []}
    # Both engines stay up and the runs interleave, round after round: on a shared machine the
    # load moves between minutes, so only ratios within a round are compared.
    with LLM(str(model), **kw) as plain, LLM(str(model), enable_lora=True, max_loras=args.max_loras,
                                             max_lora_rank=args.rank, lora_dtype=args.lora_dtype,
                                             max_cpu_loras=max(args.max_loras, args.num_adapters), **kw) as llm:
        prompts, lens = workload(args, plain.engine.vocab_size)
        engine = llm.engine
        load_s = []
        for r in requests:
            t = time.perf_counter()
            engine.add_lora(r)
            load_s.append(time.perf_counter() - t)
        worker = engine.executor.driver_worker.lora
        host_bytes = [worker.load(r).nbytes for r in requests]
        slot_s = []
        for i, r in enumerate(requests[: args.max_loras]):
            t = time.perf_counter()
            worker._fill_slot(i % args.max_loras, worker.load(r))
            if args.device != "cpu":
                torch.cuda.synchronize()
            slot_s.append(time.perf_counter() - t)
        engine.executor.lora_manager.slots = type(engine.executor.lora_manager.slots)(args.max_loras)  # forget
        timed_generate(plain, prompts[:2], [4, 4])  # warm-up (native kernels, allocator)
        timed_generate(llm, prompts[:2], [4, 4])
        groups = [*requests, None]
        loras = [groups[i % len(groups)] for i in range(len(prompts))]
        for _ in range(args.rounds):
            r, base_out = timed_generate(plain, prompts, lens)
            results["base"].append(r)
            r, _ = timed_generate(llm, prompts, lens, loras)
            results["lora-mixed"].append(r)
            r, lora_base_out = timed_generate(llm, prompts, lens)
            results["lora-base"].append(r)
        slot_bytes = worker.slot_bytes // args.max_loras
    ratios = {name: [r["tok_per_s"] / b["tok_per_s"] for r, b in zip(runs, results["base"])]
              for name, runs in results.items()}

    print(f"\n{'run':<14}" + "".join(f"{'round ' + str(i + 1) + ' tok/s':>16}" for i in range(args.rounds))
          + f"{'median vs base':>16}")
    for name, runs in results.items():
        print(f"{name:<14}" + "".join(f"{r['tok_per_s']:>16.1f}" for r in runs)
              + f"{statistics.median(ratios[name]):>15.2f}x")
    print(f"\nadapter load (add_lora: read + check + host copy), rank {args.rank}: median "
          f"{statistics.median(load_s) * 1e3:.0f} ms, max {max(load_s) * 1e3:.0f} ms (first {load_s[0] * 1e3:.0f} ms)")
    print(f"copy into a device slot: median {statistics.median(slot_s) * 1e3:.1f} ms")
    peft_bytes = sum(f.stat().st_size for f in dirs[0].glob("adapter_model.*"))
    print(f"memory per adapter: PEFT file {peft_bytes / 2**20:.1f} MiB, host cache {host_bytes[0] / 2**20:.1f} MiB "
          f"(slot images), "
          f"device slot {slot_bytes / 2**20:.1f} MiB ({args.dtype if args.lora_dtype == 'auto' else args.lora_dtype}, "
          f"padded to rank {args.rank}; the embedding's and head's slots included)")
    print(f"base-model outputs identical with and without enable_lora: {base_out == lora_base_out}")
    record = dict(
        command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.platform(),
        cpu_count=os.cpu_count(), cpu_flags=flags, threads=torch.get_num_threads(), load=os.getloadavg(),
        device=args.device, dtype=args.dtype, lora_dtype=args.lora_dtype,
        requests=len(prompts), adapters=args.num_adapters, rank=args.rank,
        max_loras=args.max_loras, rounds=args.rounds, runs=results, ratios_vs_base=ratios,
        median_ratio_mixed_vs_base=statistics.median(ratios["lora-mixed"]),
        median_ratio_lora_base_vs_base=statistics.median(ratios["lora-base"]),
        load_ms=[s * 1e3 for s in load_s], slot_copy_ms=[s * 1e3 for s in slot_s],
        host_bytes_per_adapter=host_bytes[0], slot_bytes_per_adapter=slot_bytes, peft_file_bytes=peft_bytes,
        base_outputs_identical=base_out == lora_base_out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
