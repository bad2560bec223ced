"""LoRA on MoE experts and MLA (runtime/lora/moe.py, runtime/lora/mla.py): what adapters cost on
a mixture-of-experts model (Mixtral layout) and on DeepSeek V3 (MLA + routed experts).

    python bench/lora_moe_mla.py                 # both families, float32 CPU
    python bench/lora_moe_mla.py --arch mixtral --num-requests 32

Random-weight models of a few million parameters (testing/tinymodels.py with larger sizes),
built once under build/bench-lora-moe; adapters of rank 16 built with peft on every attention
projection and on the routed experts (`target_parameters`). Per family, the same requests (seeded
lengths, `ignore_eos`) through `LLM.generate`, the three runs interleaved for `--rounds` rounds:
  base        an engine without LoRA;
  lora-base   an engine with enable_lora whose requests all use the base model;
  lora-mixed  the same engine, requests round-robin over the adapters and the base model.
A step with adapters runs the experts one at a time (not the fused kernel), which is the cost
this measures beside the adapter products themselves. Throughput is generated tokens per CPU
second of the process (wall time on a shared machine measures the neighbours).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BUILD = ROOT / "build" / "bench-lora-moe"

SIZES = {
    "mixtral": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                        q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                        v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                        intermediate_size=512, n_group=4, topk_group=2),
}
ATTENTION = {"mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
             "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=[*SIZES, "all"], default="all")
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "lora_moe_mla.json")
    return p.parse_args(argv)


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))
    return []


def build(arch: str, num_adapters: int, rank: int):
    from kvserve.testing.adapters import build_lora_adapters
    from kvserve.testing.tinymodels import build_tiny_model

    base = BUILD / arch
    if not (base / "config.json").exists():
        build_tiny_model(base, arch, **SIZES[arch])
    paths = [BUILD / f"{arch}-r{rank}-{i}" for i in range(num_adapters)]
    todo = {p: dict(r=rank, seed=100 + i, std=0.05, target_modules=ATTENTION[arch], target_parameters=EXPERTS)
            for i, p in enumerate(paths) if not (p / "adapter_config.json").exists()}
    if todo:
        build_lora_adapters(base, todo)
    return base, paths


def timed(llm, prompts, params, loras=None):
    """Generated tokens per CPU second of this process (the engine runs in it): on a shared
    machine, wall time measures the neighbours as much as the code."""
    t0 = time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    dt = time.process_time() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def run_arch(arch: str, args) -> dict:
    from kvserve.runtime import LLM, LoRARequest, SamplingParams

    base, paths = build(arch, args.num_adapters, args.rank)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 64))] for _ in range(args.num_requests)]
    params = [SamplingParams(max_tokens=rng.randint(16, 48), temperature=0, ignore_eos=True) for _ in prompts]
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    cycle = [*requests, None]
    mixed = [cycle[i % len(cycle)] for i in range(len(prompts))]
    kw = dict(num_kv_blocks=512, block_size=16)
    rows = {"base": [], "lora-base": [], "lora-mixed": []}
    with LLM(str(base), **kw) as plain, LLM(str(base), enable_lora=True, max_loras=args.num_adapters,
                                            max_lora_rank=args.rank, **kw) as lora:
        # Warm both with the whole workload: first steps of each shape build caches (the CPU's
        # native decode stack among them) and would be counted otherwise.
        timed(plain, prompts, params)
        timed(lora, prompts, params, mixed)
        for _ in range(args.rounds):
            rows["base"].append(timed(plain, prompts, params))
            rows["lora-base"].append(timed(lora, prompts, params))
            rows["lora-mixed"].append(timed(lora, prompts, params, mixed))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    archs = list(SIZES) if args.arch == "all" else [args.arch]
    record = dict(command=" ".join(["python", "bench/lora_moe_mla.py", *(argv or sys.argv[1:])]),
                  machine=dict(cpu=platform.processor() or platform.machine(), cpu_flags=cpu_flags(),
                               threads=torch.get_num_threads()),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), requests=args.num_requests,
                  adapters=args.num_adapters, rank=args.rank, results={})
    print(f"{args.num_requests} requests, {args.num_adapters} adapters of rank {args.rank} + base, "
          f"float32 CPU, {torch.get_num_threads()} threads")
    print(f"\n{'model':<12}{'run':<12}" + "".join(f"{'round ' + str(i + 1) + ' tok/cpu-s':>18}"
                                                 for i in range(args.rounds)) + f"{'ratio to base':>16}")
    for arch in archs:
        rows = run_arch(arch, args)
        record["results"][arch] = rows
        for name, runs in rows.items():
            ratios = [r / b for r, b in zip(runs, rows["base"])]
            print(f"{arch:<12}{name:<12}" + "".join(f"{r:>18.1f}" for r in runs)
                  + f"{min(ratios):>8.2f}-{max(ratios):.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
