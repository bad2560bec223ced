"""bitsandbytes 4-bit: memory and decode speed of the packed hold vs the dequantized hold, one run.

    python bench/bnb_memory.py                 # a 1024-wide, 8-layer Llama, NF4 + double quantization

Writes an NF4 checkpoint with transformers + bitsandbytes (CPU) from random weights, then loads it
three times in fresh subprocesses: packed with the native CPU kernel (the default where it builds:
codes repacked into panels, the codebook lookup inside the matmul), packed with the torch twin
(native kernels off: codes + float32 absmax, dequantized per matmul, a slab of rows at a time)
and dequantized at load (BnB4bitMethod.keep_packed = False). Reports the bytes the linear layers
hold, the process's peak RSS and its resident set after loading, and batch-1 decode tokens/s (process CPU time, one
thread). Writes bench/results/bnb_memory.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(1)
from kvserve.runtime.models.quantization.bitsandbytes import BnB4bitMethod
BnB4bitMethod.keep_packed = sys.argv[2] != "dequantized"
if sys.argv[2] == "packed-torch":
    from kvserve.runtime.models.quantization.packed import set_cpu_native
    set_cpu_native(False)
from kvserve.runtime import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=64, block_size=16)
model = llm.engine.model
linear = 0
for name, mod in model.named_modules():
    if hasattr(mod, "quant_method") and type(mod.quant_method).__name__ == "BnB4bitMethod":
        linear += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False) if p is not None)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
import gc; gc.collect()
now = int(open("/proc/self/statm").read().split()[1]) * 4096  # resident now: what the load left
prompt = [{"prompt_token_ids": list(range(3, 67))}]
def run(n):
    t0 = time.process_time()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return time.process_time() - t0
run(4)
times = sorted(run(33) - run(1) for _ in range(3))
print(json.dumps({"linear_bytes": linear, "peak_rss": rss, "rss_after_load": now, "decode_tok_s": 32 / times[1]}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bnb_memory.json")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from kvserve.testing.tinymodels import build_tiny_model

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = build_tiny_model(Path(tmp) / "src", "llama", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                               num_key_value_heads=args.hidden // 64, vocab_size=4096)
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=qc, device_map="cpu",
                                                     dtype=torch.float32)
        model.save_pretrained(Path(tmp) / "nf4")
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(Path(tmp) / "nf4")
        del model
        for hold in ("packed", "packed-torch", "dequantized"):
            out = subprocess.run([sys.executable, "-c", CHILD, str(Path(tmp) / "nf4"), hold], check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            rows[hold] = json.loads(out)
    params = args.layers * (4 * args.hidden * args.hidden + 3 * 4 * args.hidden * args.hidden)
    print(f"{'hold':12s} {'linear MiB':>10s} {'B/weight':>9s} {'peak RSS MiB':>12s} {'RSS after MiB':>13s} "
          f"{'decode tok/s':>12s}")
    for hold, r in rows.items():
        print(f"{hold:12s} {r['linear_bytes'] / 2**20:10.1f} {r['linear_bytes'] / params:9.3f} "
              f"{r['peak_rss'] / 2**20:12.1f} {r['rss_after_load'] / 2**20:13.1f} {r['decode_tok_s']:12.1f}")
    meta = {"hidden": args.hidden, "layers": args.layers, "linear_params": params, "threads": 1,
            "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
