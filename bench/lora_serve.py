"""LoRA adapters through the server: adapter load time on the admin route, host memory per
adapter, and serving throughput of a mixed workload (8 adapters + the base model) against the
same requests all on the base model.

    python bench/lora_serve.py                           # real SmolLM2, 8 rank-16 adapters, CPU
    python bench/lora_serve.py --requests 48 --max-tokens 32 --concurrency 16 --device cuda

One `kvserve serve` (in process) with --enable-lora --max-loras 8. Each adapter (every
q/k/v/o/gate/up/down of SmolLM2, built with peft and cached under build/smollm2-loras) is loaded
with POST /v1/load_lora_adapter and timed end to end (HTTP, read, checks, registration); the
process's resident memory is read before and after the eight loads. Then the same requests
(prompts, max_tokens, ignore_eos) run twice over `--concurrency` connections: `base` names the
base model in every request, `mixed` cycles over the eight adapters and the base model. The
table gives generated tokens per second of each run and their ratio; JSON goes to
bench/results/lora_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ADMIN = "bench-admin-key-0123456789"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model directory (default: the real SmolLM2)")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=36)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-lora-baseline", action="store_true",
                   help="also run the base-only workload on a server started without --enable-lora (what "
                        "enabling LoRA costs requests that use no adapter)")
    p.add_argument("--out", type=Path, default=RESULTS / "lora_serve.json")
    return p.parse_args(argv)


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


PROMPTS = ["Write a SQL query that lists every customer who ordered twice in one day.",
           "Explain to a new employee how to reset a forgotten password.",
           "Summarize the plot of a detective story in three sentences.",
           "What is the capital of France, and why is it famous?",
           "Give three tips for writing clear commit messages.",
           "Translate 'good morning, how are you?' into French and Spanish."]


async def run_workload(url: str, models: list[str], args) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(args.concurrency)
    tokens = 0

    async def one(session, i):
        nonlocal tokens
        body = {"model": models[i % len(models)], "prompt": PROMPTS[i % len(PROMPTS)] + f" (request {i})",
                "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        async with sem, session.post(url + "/v1/completions", json=body) as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data}")
            tokens += data["usage"]["completion_tokens"]

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, i) for i in range(args.requests)))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds}


def post(url: str, path: str, body: dict) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def wait_ready(url: str, timeout: float = 600) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("server not ready")
        time.sleep(0.2)


def main(argv=None) -> int:
    args = parse_args(argv)
    from kvserve.runtime.server.main import ServerThread
    from kvserve.testing.adapters import ensure_smollm2_adapters
    from kvserve.testing.realmodel import ensure_smollm2

    model = args.model or ensure_smollm2().hf_dir
    adapter_dirs = ensure_smollm2_adapters(model, args.adapters, r=args.rank)
    adapter_bytes = [sum(f.stat().st_size for f in Path(d).glob("adapter_model.*")) for d in adapter_dirs]
    server = ServerThread([str(model), "--port", "0", "--served-model-name", "base", "--device", args.device,
                           "--dtype", args.dtype, "--enable-lora", "--max-loras", str(args.adapters),
                           "--max-lora-rank", str(args.rank), "--max-cpu-loras", str(args.adapters),
                           "--max-num-seqs", str(max(args.concurrency, 16)), "--admin-api-key", ADMIN,
                           "--log-level", "warning"]).start()
    try:
        wait_ready(server.url)
        names = [f"lora-{i}" for i in range(args.adapters)]
        asyncio.run(run_workload(server.url, ["base"], argparse.Namespace(**{**vars(args), "requests": 4})))  # warm
        rss_before = rss_bytes()
        load_s = []
        for name, d in zip(names, adapter_dirs):
            t0 = time.perf_counter()
            status, text = post(server.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(d)})
            load_s.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"load {name}: HTTP {status}: {text}")
        rss_after = rss_bytes()
        base = asyncio.run(run_workload(server.url, ["base"], args))
        mixed = asyncio.run(run_workload(server.url, names + ["base"], args))
    finally:
        server.stop()
    plain = None
    if args.no_lora_baseline:
        plain_server = ServerThread([str(model), "--port", "0", "--served-model-name", "base", "--device",
                                     args.device, "--dtype", args.dtype, "--max-num-seqs",
                                     str(max(args.concurrency, 16)), "--log-level", "warning"]).start()
        try:
            wait_ready(plain_server.url)
            asyncio.run(run_workload(plain_server.url, ["base"], argparse.Namespace(**{**vars(args), "requests": 4})))
            plain = asyncio.run(run_workload(plain_server.url, ["base"], args))
        finally:
            plain_server.stop()
    result = {
        "bench": "lora_serve", "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {"cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg": os.getloadavg()},
        "model": str(model), "device": args.device, "dtype": args.dtype, "adapters": args.adapters,
        "rank": args.rank, "requests": args.requests, "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "load_seconds": load_s, "load_seconds_mean": statistics.mean(load_s), "load_seconds_max": max(load_s),
        "adapter_file_bytes": adapter_bytes,
        "rss_growth_per_adapter_bytes": (rss_after - rss_before) / args.adapters,
        "base": base, "mixed": mixed, "mixed_over_base": mixed["tokens_per_second"] / base["tokens_per_second"],
        "base_without_lora": plain,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"adapter load (POST /v1/load_lora_adapter, rank {args.rank}): mean {result['load_seconds_mean']:.3f} s, "
          f"max {result['load_seconds_max']:.3f} s; file {statistics.mean(adapter_bytes) / 2**20:.1f} MiB, "
          f"host RSS +{result['rss_growth_per_adapter_bytes'] / 2**20:.1f} MiB per adapter")
    print(f"{'workload':<28}{'tokens':>8}{'seconds':>10}{'tok/s':>10}")
    rows = [(f"base only ({args.requests} req)", base), (f"{args.adapters} adapters + base", mixed)]
    if plain is not None:
        rows.append(("base, server without LoRA", plain))
    for label, r in rows:
        print(f"{label:<28}{r['tokens']:>8}{r['seconds']:>10.2f}{r['tokens_per_second']:>10.1f}")
    print(f"mixed / base throughput: {result['mixed_over_base']:.2f}x   ({result['machine']['cpu_flags']}, "
          f"load {result['machine']['load_avg'][0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
