"""One decode step of the CPU's native decode stack with and without adapter rows: what a mixed
step's adapters cost, measured where it is spent, and the bytes behind it.

    python bench/lora_decode_step.py                    # real SmolLM2, 16 rows over 8 adapters
    python bench/lora_decode_step.py --rows 48 --threads 1 --lora-dtypes auto,bfloat16

The same step (the same rows, positions and KV blocks) runs alternately without adapters and with
`--rows` rows spread round-robin over `--adapters` rank-`--rank` adapters (every ninth row the base
model), `--pairs` times; the ratio of the medians is the step's throughput with adapters against
without. Alternating step by step keeps a shared machine's load changes out of the ratio far
better than whole runs do (bench/lora.py). Beside it: the bytes the stack reads, the decoder
layers' weights (float32) against the adapters' A and B (only B's diagonal blocks are read),
which bound the ratio when the step is memory bound. A whole decode step also reads the LM head
after the stack (113 MiB for SmolLM2), which this ratio leaves out.
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
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--context", type=int, default=128, help="tokens already in each row's KV cache")
    p.add_argument("--pairs", type=int, default=25)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--lora-dtypes", default="auto,bfloat16")
    p.add_argument("--out", type=Path, default=RESULTS / "lora_decode_step.json")
    return p.parse_args(argv)


def adapter_bytes(worker, row_slots) -> int:
    """Bytes of A and B the step's adapters read: per adapted layer and adapter, A [in, parts x r]
    and B's diagonal blocks (r x each part's outputs)."""
    total = 0
    slots = {s for s in row_slots if s >= 0}
    for _, w in worker.wrappers:
        if not hasattr(w, "a_t"):
            continue  # the embedding / head wrapper: not in the decode stack
        for s in slots:
            r = worker.state.slot_ranks[s]
            total += (w.a_t.shape[1] * len(w.parts) * r + r * w.b_t.shape[2]) * w.a_t.element_size()
    return total


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kvserve.kernels.cpu import native
    from kvserve.runtime import LLM, LoRARequest, SamplingParams
    from kvserve.testing.adapters import ensure_smollm2_adapters
    from kvserve.testing.realmodel import ensure_smollm2

    sys.path.insert(0, str(ROOT / "bench"))
    from lora import cpu_flags

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_smollm2().hf_dir
    dirs = ensure_smollm2_adapters(model_dir, args.adapters, r=args.rank)
    requests = [LoRARequest(f"adapter-{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
    row_slots = [i % (args.adapters + 1) if i % (args.adapters + 1) < args.adapters else -1 for i in range(args.rows)]
    print(f"model {model_dir}, float32, {torch.get_num_threads()} threads, CPU flags {' '.join(cpu_flags())}; "
          f"{args.rows} rows over {args.adapters} rank-{args.rank} adapters, context {args.context}")
    results = []
    for lora_dtype in args.lora_dtypes.split(","):
        with LLM(str(model_dir), enable_lora=True, lora_dtype=lora_dtype, max_loras=args.adapters,
                 max_lora_rank=args.rank, max_cpu_loras=args.adapters, device="cpu", dtype="float32",
                 max_model_len=1024, kv_cache_memory_bytes=1 << 29) as llm:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)  # builds the stack
            worker = llm.engine.executor.driver_worker
            model, lora = worker.model, worker.lora
            for i, r in enumerate(requests):
                lora._fill_slot(i, lora.load(r))
            stack = model._native_stack
            bs = worker.kv_caches[0][0].shape[1]
            per = -(-args.context // bs)
            tables = torch.arange(args.rows * per, dtype=torch.int32).view(args.rows, per)
            lens = torch.full((args.rows,), args.context, dtype=torch.int32)
            pos = torch.full((args.rows,), args.context - 1, dtype=torch.long)
            slot_mapping = tables[:, (args.context - 1) // bs].long() * bs + (args.context - 1) % bs
            hidden = torch.randn(args.rows, model.config.hidden_size)

            def run(adapters: bool) -> float:
                step = native.lora_step(stack.lora_slots, row_slots, lora.state.slot_ranks) if adapters else None
                t = time.perf_counter()
                stack.run(hidden, pos, slot_mapping, tables, lens, worker.kv_caches, step)
                return time.perf_counter() - t

            for adapters in (False, True) * 3:  # warm-up
                run(adapters)
            base, with_adapters = [], []
            for _ in range(args.pairs):
                base.append(run(False))
                with_adapters.append(run(True))
            # The stack's own weights: the LM head (the embedding table here) is read after it.
            base_bytes = sum(p.numel() * p.element_size() for p in model.layers.parameters())
            row = dict(lora_dtype=lora_dtype, slot_dtype=str(model.layers[0].self_attn.qkv_proj.a_t.dtype),
                       base_ms=statistics.median(base) * 1e3, adapters_ms=statistics.median(with_adapters) * 1e3,
                       base_bytes=base_bytes, adapter_bytes=adapter_bytes(lora, row_slots))
            row["ratio"] = row["base_ms"] / row["adapters_ms"]
            row["bandwidth_bound"] = base_bytes / (base_bytes + row["adapter_bytes"])
            results.append(row)
    print(f"\n{'lora_dtype':<12}{'base ms':>10}{'adapters ms':>13}{'ratio':>8}{'base MiB':>10}{'adapter MiB':>13}"
          f"{'bytes bound':>13}")
    for r in results:
        print(f"{r['lora_dtype']:<12}{r['base_ms']:>10.1f}{r['adapters_ms']:>13.1f}{r['ratio']:>7.2f}x"
              f"{r['base_bytes'] / 2**20:>10.0f}{r['adapter_bytes'] / 2**20:>13.0f}{r['bandwidth_bound']:>12.2f}x")
    record = dict(command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.platform(),
                  cpu_flags=cpu_flags(), threads=torch.get_num_threads(), load=os.getloadavg(), rows=args.rows,
                  adapters=args.adapters, rank=args.rank, context=args.context, pairs=args.pairs, results=results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
