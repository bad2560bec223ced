"""Weight formats on the real SmolLM2-135M-Instruct: kvserve float32 / bf16 / int8 / int4 (and the
Q4_1 GGUF through kvserve's GGUF loader) against llama.cpp's server on F32, Q8_0 and Q4_1 GGUFs,
side by side in one run, the same threads for every engine.

  decode   batch-1 decode ms/token: a 128-token prompt, then --decode-tokens greedy tokens
           (median of --decode-repeats runs; llama.cpp: its own per-token timing)
  offline  --num-requests requests at once (prompts 32-256, outputs 32-96 tokens, greedy,
           ignore_eos): generated tokens per second
  memory   kvserve: bytes of weights the model holds (kvserve:model_weight_bytes), per parameter,
           against the format's bytes per parameter (values + scales/zeros); llama.cpp: tensor
           bytes of the GGUF file

    export KVSERVE_LLAMACPP_DIR=/work/main/build/llamacpp
    python bench/quantization.py                  # ~10 min on 2 busy cores
    python bench/quantization.py --quick          # fewer tokens and requests

Writes bench/results/quantization.json and prints one table; the targets (issue 11): kvserve int8
at most 1.2x llama.cpp Q8_0's decode ms/token, int4 at most 1.2x Q4_1's, weight memory within 10%
of the format's bytes per parameter.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

from vs_llamacpp import decode_llamacpp, load_average, offline_llamacpp, prompt_ids  # noqa: E402

# (label, dtype, quantization, nominal bytes per parameter of the format's values)
KVSERVE_ROWS = [
    ("kvserve float32", "float32", None, 4.0),
    ("kvserve bfloat16", "bfloat16", None, 2.0),
    ("kvserve int8", "float32", "int8", 1.0),
    ("kvserve int4", "float32", "int4", 0.5),
    ("kvserve Q4_1 GGUF", "float32", "gguf", 0.625),
]
LLAMACPP_ROWS = [("llama.cpp F32", "f32"), ("llama.cpp Q8_0", "q8_0"), ("llama.cpp Q4_1", "q4_1")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--rows", default="", help="comma-separated row labels to run (default: all)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "quantization.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.decode_tokens, args.decode_repeats, args.num_requests = 32, 2, 8
    return args


def _workload(n: int):
    import random

    rng = random.Random(0)
    prompts = [prompt_ids(rng.randint(32, 256), 1000 + i) for i in range(n)]
    outputs = [rng.randint(32, 96) for _ in range(n)]
    return prompts, outputs


def gguf_files(model) -> dict[str, Path]:
    return {"f32": ROOT / "build" / "gguf" / "SmolLM2-135M-Instruct.f32.gguf",
            "q8_0": ROOT / "build" / "gguf" / "SmolLM2-135M-Instruct.q8_0.gguf",
            "q4_1": Path(model.gguf)}


def gguf_tensor_bytes(path: Path) -> tuple[int, int]:
    """(tensor bytes, parameters) of a GGUF file."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return (sum(int(t.n_bytes) for t in reader.tensors), sum(int(t.n_elements) for t in reader.tensors))


def run_kvserve(model_path: str, dtype: str, quantization: str | None, prompt, args) -> dict:
    import torch
    from vs_llamacpp import batch1_decode_ms

    from kvserve.kernels.cpu.native import status as native_status
    from kvserve.runtime import LLM, SamplingParams
    from kvserve.runtime.models.quantization.packed import cpu_packed_enabled

    torch.set_num_threads(args.threads)
    kw = dict(dtype=dtype, device="cpu", max_model_len=2048)
    if quantization:
        kw["quantization"] = quantization
    llm = LLM(model_path, **kw)
    eng = llm.engine
    decode_ms = batch1_decode_ms(llm, prompt, args.decode_tokens, args.decode_repeats)
    prompts, outputs = _workload(args.num_requests)
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    params_count = _parameter_count(eng)
    out = {"decode_ms_per_token": decode_ms,
           "offline_tok_per_s": sum(outputs) / wall,
           "weight_bytes": eng.model_weight_bytes, "parameters": params_count,
           "quantization": eng.quantization, "dtype": str(eng.dtype).removeprefix("torch."),
           "cpu_packed_kernels": cpu_packed_enabled(), "native_cpu_kernels": native_status()}
    llm.close()
    return out


def _parameter_count(engine) -> int:
    from kvserve.runtime.capacity import weight_bytes_per_gpu

    return weight_bytes_per_gpu(engine.model_config.shape, 1, 1)


def format_bytes_per_param(quantization: str | None, dtype: str, model_shape) -> float:
    """Bytes per parameter the format itself implies (values + its scales/zeros as kvserve keeps
    them on CPU: per int4 group of 64, a float32 scale and offset with the native kernels (bf16
    ones with torch's), a scale per int8 row)."""
    from kvserve.kernels.cpu import native
    from kvserve.runtime.capacity import weight_bytes_per_gpu, weight_format

    size = {"float32": 4, "bfloat16": 2}[dtype]
    if quantization == "int4":  # group 64 (hidden 576)
        linear = 0.5 + (8 if native.available() else 4) / 64
        fmt = type("F", (), {"linear_bytes": linear, "vocab_bytes": linear})()
    elif quantization in (None, "int8"):
        fmt = weight_format(quantization, size, model_shape.hidden_size)
    else:
        return float("nan")
    return weight_bytes_per_gpu(model_shape, size, 1, fmt) / weight_bytes_per_gpu(model_shape, 1, 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    from kvserve.testing.realmodel import ensure_smollm2

    model = ensure_smollm2()
    hf_dir = Path(model.hf_dir)
    prompt = prompt_ids(128, 7)
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
    result = {"command": "python bench/quantization.py" + (" --quick" if args.quick else ""),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads,
              "load_average_start": load_average(), "rows": {}}
    from kvserve.runtime.model_config import ModelConfig

    shape = ModelConfig.from_pretrained(hf_dir).shape
    for label, dtype, quantization, nominal in KVSERVE_ROWS:
        if wanted and label not in wanted:
            continue
        path = str(model.gguf) if quantization == "gguf" else str(hf_dir)
        try:
            row = run_kvserve(path, dtype, None if quantization == "gguf" else quantization, prompt, args)
        except Exception as exc:  # a row that cannot run says why, the others still run
            result["rows"][label] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{label}: {exc}", file=sys.stderr)
            continue
        row["bytes_per_param"] = row["weight_bytes"] / row["parameters"]
        row["nominal_bytes_per_param"] = nominal
        if quantization != "gguf":  # a GGUF file mixes formats (Q4_1 layers, a Q8_0 table): no single figure
            row["format_bytes_per_param"] = format_bytes_per_param(quantization, dtype, shape)
        result["rows"][label] = row
        print(label, json.dumps(row), flush=True)
    files = gguf_files(model)
    prompts, outputs = _workload(args.num_requests)
    for label, key in LLAMACPP_ROWS:
        if wanted and label not in wanted:
            continue
        path = files[key]
        if not path.is_file():
            result["rows"][label] = {"error": f"missing {path}"}
            continue
        decode = decode_llamacpp(path, prompt, args.decode_tokens, args.decode_repeats, args.threads)
        wall = offline_llamacpp(path, prompts, outputs, slots=args.num_requests, threads=args.threads,
                                max_len=256 + 96)
        tensor_bytes, params = gguf_tensor_bytes(path)
        result["rows"][label] = {"decode_ms_per_token": decode, "offline_tok_per_s": sum(outputs) / wall,
                                 "weight_bytes": tensor_bytes, "parameters": params,
                                 "bytes_per_param": tensor_bytes / params}
        print(label, json.dumps(result["rows"][label]), flush=True)
    result["load_average_end"] = load_average()
    result["targets"] = targets(result["rows"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


def targets(rows: dict) -> dict:
    def ratio(a, b, key="decode_ms_per_token"):
        try:
            return rows[a][key] / rows[b][key]
        except (KeyError, ZeroDivisionError):
            return None

    out = {"int8_vs_q8_0_decode": ratio("kvserve int8", "llama.cpp Q8_0"),
           "int4_vs_q4_1_decode": ratio("kvserve int4", "llama.cpp Q4_1")}
    for label, row in rows.items():
        if label.startswith("kvserve") and "format_bytes_per_param" in row:
            fb = row["format_bytes_per_param"]
            if fb == fb:  # not NaN
                out[f"{label} memory vs format"] = row["bytes_per_param"] / fb
    return out


def print_table(result: dict) -> None:
    print(f"\n{result['date']}  threads={result['threads']}  load average {result['load_average_start']} -> "
          f"{result.get('load_average_end')}")
    print(f"{'engine / format':22} {'decode ms/tok':>14} {'offline tok/s':>14} {'weight MB':>10} {'B/param':>8}")
    for label, row in result["rows"].items():
        if "error" in row:
            print(f"{label:22} {row['error'][:60]}")
            continue
        print(f"{label:22} {row['decode_ms_per_token']:14.1f} {row['offline_tok_per_s']:14.1f} "
              f"{row['weight_bytes'] / 1e6:10.1f} {row['bytes_per_param']:8.3f}")
    for key, value in result["targets"].items():
        print(f"  {key}: {value:.2f}" if value is not None else f"  {key}: n/a")


if __name__ == "__main__":
    sys.exit(main())
