"""Where a CPU decode step's time goes, and what each part of the fast path buys: A/B in one run.

    python bench/cpu_decode.py                 # SmolLM2-135M-Instruct float32, 1 and 2 threads
    python bench/cpu_decode.py --threads 1     # one thread only (the steadiest on a shared box)

Sections:
  bandwidth  memory copy and read bandwidth of this machine (the roofline of a batch-1 decode)
  matmul     SmolLM2's projections at batch 1 (and the 49152 x 576 LM head): F.linear (MKL),
             MKL's packed sgemm (torch.ops.mkl._mkl_linear), the native packed kernel, and a
             plain read of the same bytes
  attention  paged decode attention of SmolLM2's shape (9 query heads, 3 KV heads, head 64) at
             batches 1, 8 and 48 and contexts 128 and 512, twelve layers' caches so nothing stays
             cached: ms per layer and GB/s of K/V read, against the machine's read bandwidth
  gemm       the projections at 48 and 512 rows (decode batches, prefill chunks): native vs
             F.linear (MKL) in GFLOP/s, against the float32 FMA peak of the cores (2 FMA units x
             8 lanes x 2 FLOPs per cycle at /proc/cpuinfo's clock)
  step       a whole batch-1 decode step of the engine (128-token context), four variants side
             by side, interleaved: (A) torch path: F.linear + torch twins + SDPA attention;
             (B) native layer ops and decode attention, F.linear; (C) B + native packed matmuls,
             still one Python call per op; (D) C as one native call per step (the default)

With one thread the times are process CPU time (what the work costs, steadier on a shared
machine); with more, wall time. Writes bench/results/cpu_decode.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--sections", default="bandwidth,matmul,attention,gemm,step")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_decode.json")
    return p.parse_args(argv)


def clock_for(threads: int):
    return time.process_time if threads == 1 else time.perf_counter


def median_time(fn, clock, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def bandwidth(clock) -> dict:
    import torch

    n = 64 * 1024 * 1024  # 256 MB of float32: far beyond any cache
    a, b = torch.randn(n), torch.empty(n)
    copy = median_time(lambda: b.copy_(a), clock, 5)
    read = median_time(lambda: a.sum(), clock, 5)
    return {"copy_GBps": 2 * n * 4 / copy / 1e9, "read_GBps": n * 4 / read / 1e9}


def matmul(clock) -> dict:
    import torch
    import torch.nn.functional as F

    from kvserve.kernels.cpu import native

    out = {}
    for name, (n, k) in SHAPES.items():
        copies = 1 if name == "lm_head" else 30  # one step's worth of distinct weights: nothing stays cached
        ws = [torch.randn(n, k) * 0.05 for _ in range(copies)]
        packed = [native.pack_weight(w) for w in ws] if native.available() else None
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in ws]
        x = torch.randn(1, k)
        variants = {
            "F.linear": lambda: [F.linear(x, w) for w in ws],
            "mkl_packed": lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, 1) for w, p in zip(ws, mkl)],
            "read": lambda: [w.sum() for w in ws],
        }
        if packed is not None:
            variants["native"] = lambda: [native.linear(x, p, n) for p in packed]
        times = {v: [] for v in variants}
        for _ in range(7):  # interleaved, so load changes hit every variant alike
            for v, fn in variants.items():
                times[v].append(median_time(fn, clock, 1))
        gb = n * k * 4 * copies / 1e9
        out[name] = {v: {"ms": statistics.median(t) / copies * 1e3, "GBps": gb / statistics.median(t)}
                     for v, t in times.items()}
    return out


def attention(clock) -> dict:
    import torch

    from kvserve.kernels.cpu import native

    heads, kv_heads, head_dim, block_size, layers = 9, 3, 64, 16, 12
    out = {}
    for batch in (1, 8, 48):
        for context in (128, 512):
            blocks_per_seq = context // block_size + 1
            blocks = batch * blocks_per_seq
            caches = [(torch.randn(blocks, block_size, kv_heads, head_dim),
                       torch.randn(blocks, block_size, kv_heads, head_dim)) for _ in range(layers)]
            tables = torch.arange(blocks, dtype=torch.int32).view(batch, blocks_per_seq)
            lens = torch.full((batch,), context, dtype=torch.int32)
            q = torch.randn(batch, heads, head_dim)
            t = median_time(lambda: [native.paged_decode_attention(q, k, v, tables, lens, 0.125)
                                     for k, v in caches], clock, 5) / layers
            kv_bytes = batch * context * kv_heads * head_dim * 4 * 2
            out[f"b{batch}_ctx{context}"] = {"ms_per_layer": t * 1e3, "GBps": kv_bytes / t / 1e9}
    return out


def cpu_mhz() -> float | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1])
    except (OSError, ValueError):
        pass
    return None


def gemm(clock, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    from kvserve.kernels.cpu import native

    mhz = cpu_mhz()
    out = {"peak_GFLOPs": threads * 32 * mhz / 1e3 if mhz else None, "rows": {}}
    for rows in (48, 512):
        for name, (n, k) in SHAPES.items():
            if name == "lm_head" and rows > 48:
                continue  # prefill computes logits for the last token of each sequence only
            w, x = torch.randn(n, k), torch.randn(rows, k)
            packed = native.pack_weight(w)
            flops = 2 * rows * n * k
            times = {"native": [], "F.linear": []}
            for _ in range(5):
                times["native"].append(median_time(lambda: native.linear(x, packed, n), clock, 3))
                times["F.linear"].append(median_time(lambda: F.linear(x, w), clock, 3))
            out["rows"][f"{rows}_{name}"] = {v: flops / statistics.median(t) / 1e9 for v, t in times.items()}
    return out


@contextlib.contextmanager
def _unpacked_linears():
    from kvserve.runtime.models.quantization import unquantized

    original = unquantized.UnquantizedLinearMethod.process_weights_after_loading
    unquantized.UnquantizedLinearMethod.process_weights_after_loading = lambda self, layer: None
    try:
        yield
    finally:
        unquantized.UnquantizedLinearMethod.process_weights_after_loading = original


def step(hf_dir: Path, clock, steps: int, rounds: int) -> dict:
    from kvserve.kernels import ops
    from kvserve.runtime import LLM, SamplingParams

    engines = {}
    ops.set_kernel_mode("torch")
    engines["A torch"] = LLM(str(hf_dir), dtype="float32", device="cpu", max_model_len=1024)
    ops.set_kernel_mode("auto")
    with _unpacked_linears():
        engines["B native ops, F.linear"] = LLM(str(hf_dir), dtype="float32", device="cpu", max_model_len=1024)
    engines["C native ops + matmuls"] = LLM(str(hf_dir), dtype="float32", device="cpu", max_model_len=1024)
    engines["C native ops + matmuls"].engine.model._native_stack = None  # one Python call per op
    engines["D one native call per step"] = LLM(str(hf_dir), dtype="float32", device="cpu", max_model_len=1024)
    modes = {"A torch": "torch", "B native ops, F.linear": "auto", "C native ops + matmuls": "auto",
             "D one native call per step": "auto"}
    prompt = list(range(100, 228))
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    times: dict[str, list[float]] = {v: [] for v in engines}
    for r in range(rounds):
        for v, llm in engines.items():
            ops.set_kernel_mode(modes[v])
            eng = llm.engine
            rid = f"{v}-{r}"
            eng.add_request(rid, {"prompt_token_ids": prompt}, params)
            eng.step()
            eng.step()
            per = []
            for _ in range(steps):
                t0 = clock()
                eng.step()
                per.append(clock() - t0)
            eng.abort_request(rid)
            eng.step()
            times[v].append(statistics.median(per) * 1e3)
    ops.set_kernel_mode(None)
    for llm in engines.values():
        llm.close()
    return {v: {"ms_per_step": statistics.median(t), "rounds": t} for v, t in times.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kvserve.kernels.cpu import native
    from kvserve.testing.realmodel import ensure_smollm2

    hf_dir = ensure_smollm2().hf_dir
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu_count": os.cpu_count(),
              "native": native.status(), "load_average_start": os.getloadavg(), "by_threads": {}}
    sections = args.sections.split(",")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        clock = clock_for(threads)
        what = "process CPU time" if threads == 1 else "wall time"
        print(f"\n=== {threads} thread(s) ({what}), load average {os.getloadavg()[0]:.2f}", flush=True)
        res = {}
        if "bandwidth" in sections:
            res["bandwidth"] = bw = bandwidth(clock)
            print(f"copy {bw['copy_GBps']:.1f} GB/s (read + write), read {bw['read_GBps']:.1f} GB/s")
        if "matmul" in sections:
            res["matmul"] = mm = matmul(clock)
            print(f"{'batch 1':<10}" + "".join(f"{v:>22}" for v in next(iter(mm.values()))))
            for name, row in mm.items():
                print(f"{name:<10}" + "".join(f"{c['ms']:>10.3f} ms {c['GBps']:>5.1f} GB/s" for c in row.values()))
        if "attention" in sections:
            res["attention"] = at = attention(clock)
            read = (res.get("bandwidth") or {}).get("read_GBps")
            for case, row in at.items():
                share = f" ({100 * row['GBps'] / read:.0f}% of the read bandwidth)" if read else ""
                print(f"decode attention {case:<12} {row['ms_per_layer']:7.3f} ms/layer  {row['GBps']:5.1f} GB/s{share}")
        if "gemm" in sections:
            res["gemm"] = gm = gemm(clock, threads)
            peak = gm["peak_GFLOPs"]
            print(f"float32 FMA peak {peak:.0f} GFLOP/s" if peak else "float32 FMA peak: unknown clock")
            for case, row in gm["rows"].items():
                print(f"gemm {case:<14} " + "  ".join(f"{v} {g:6.1f} GFLOP/s" + (f" ({100 * g / peak:.0f}%)" if peak else "")
                                                     for v, g in row.items()))
        if "step" in sections:
            res["step"] = st = step(hf_dir, clock, args.steps, args.rounds)
            base = st["A torch"]["ms_per_step"]
            for v, row in st.items():
                print(f"decode step {v:<24} {row['ms_per_step']:7.1f} ms  ({base / row['ms_per_step']:.2f}x)  "
                      f"rounds {[round(x, 1) for x in row['rounds']]}")
        result["by_threads"][str(threads)] = res
    result["load_average_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
