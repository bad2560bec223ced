"""Online serving benchmark in the shape of `vllm bench serve`.

Sends a random dataset (token-id prompts of a set input length, ignore_eos so every request
generates exactly its output length) to an OpenAI-compatible /v1/completions endpoint with
streaming, at a Poisson --request-rate or a fixed --max-concurrency, and reports request and token
throughput plus TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99). Writes JSON and a
PNG under bench/results/.

    python bench/serve.py --base-url http://127.0.0.1:8000 --model tiny \
        --random-input-len 128 --random-output-len 64 --num-prompts 64 --max-concurrency 16

    # start a server and benchmark it in one go (kvserve, or the transformers baseline):
    python bench/serve.py --launch kvserve --num-prompts 64 --max-concurrency 16
    python bench/serve.py --launch hf-baseline --num-prompts 16 --max-concurrency 16
    # llama.cpp's llama-server on a GGUF (KVSERVE_LLAMACPP_DIR points at its build):
    python bench/serve.py --launch llama-server --gguf build/gguf/SmolLM2-135M-Instruct.f32.gguf \
        --model-dir build/smollm2/SmolLM2-135M-Instruct --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_MODEL_DIR = RESULTS / "models" / "llama-50m"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="server to benchmark (default: the one --launch starts)")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--launch", choices=["kvserve", "hf-baseline", "llama-server"], default=None,
                   help="start this server on a free port for the run, then stop it")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the GGUF file llama-server serves (--launch llama-server); --model-dir still gives "
                        "the vocabulary size")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                   help="model for --launch (default: the ~50M random Llama of bench/offline_throughput.py)")
    p.add_argument("--server-args", default="", help="extra flags for the launched server")
    p.add_argument("--server-threads", type=int, default=None,
                   help="OMP_NUM_THREADS (torch CPU threads) for the launched server")
    p.add_argument("--dataset-name", choices=["random"], default="random")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn below this (default: from the server)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-attempts", type=int, default=5,
                   help="tries per request before it counts as failed; only a request that got no token yet is "
                        "tried again (refused connection, dropped before the answer, HTTP 429/5xx)")
    p.add_argument("--label", default=None)
    p.add_argument("--result-dir", type=Path, default=RESULTS)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    attempts: int = 0


# Answers that say "not now" rather than "never": a full server, one still loading, a proxy's 502.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY_BACKOFF_S = 0.2


def make_dataset(n: int, in_len: int, out_len: int, ratio: float, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)

    def draw(x: int) -> int:
        return max(1, rng.randint(int(x * (1 - ratio)), int(x * (1 + ratio)))) if ratio else x

    low = min(10, vocab - 1)  # skip the lowest ids, where tokenizers keep their special tokens
    return [([rng.randrange(low, vocab) for _ in range(draw(in_len))], draw(out_len)) for _ in range(n)]


async def send_once(session: aiohttp.ClientSession, url: str, body: dict, res: RequestResult) -> bool:
    """One try; fills res. True if it may be tried again: it failed before its first token."""
    t0 = time.perf_counter()
    last = t0
    res.output_len, res.ttft, res.itl, res.error = 0, 0.0, [], ""
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return resp.status in RETRY_STATUSES
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    res.output_len = event["usage"]["completion_tokens"]
                if any(c.get("text") for c in event.get("choices", [])):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - t0
        res.success = res.output_len > 0
        if not res.success:
            res.error = "no usage in stream"
        return False
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        # A stream cut after its first token is a failure to report, not to hide by trying again.
        return res.ttft == 0.0 and not isinstance(exc, ValueError)


async def send(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], out_len: int,
               temperature: float, max_attempts: int = 1) -> RequestResult:
    """A request, tried up to max_attempts times while it gets no token; TTFT and latency are
    those of the try that answered (the time lost to refused tries shows in the duration)."""
    res = RequestResult(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": temperature, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    res.start = time.perf_counter()
    for attempt in range(max_attempts):
        res.attempts = attempt + 1
        if not await send_once(session, url, body, res):
            break
        if attempt + 1 < max_attempts:
            await asyncio.sleep(RETRY_BACKOFF_S * 2 ** attempt)
    return res


async def run(args, base_url: str) -> dict:
    url = base_url.rstrip("/") + args.endpoint
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    # A connection per request: llama-server closes idle keep-alive connections, and a request
    # written to one it just closed failed ("Server disconnected"); loopback connects cost nothing.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = args.model
        vocab = args.vocab_size
        async with session.get(base_url.rstrip("/") + "/v1/models") as r:
            info = (await r.json())["data"][0]  # llama-server answers {"models": [...], "data": [...]} too
        model = model or info["id"]
        vocab = vocab or 500
        dataset = make_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, vocab, args.seed)
        # Warm-up: one short request so model load / first-call costs stay out of the numbers.
        await send(session, url, model, dataset[0][0][:8], 2, args.temperature, args.max_attempts)

        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = np.random.default_rng(args.seed)

        async def limited(prompt, out_len):
            if sem is None:
                return await send(session, url, model, prompt, out_len, args.temperature, args.max_attempts)
            async with sem:
                return await send(session, url, model, prompt, out_len, args.temperature, args.max_attempts)

        tasks = []
        t_start = time.perf_counter()
        for prompt, out_len in dataset:
            tasks.append(asyncio.create_task(limited(prompt, out_len)))
            if args.request_rate != float("inf"):
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(rng.gamma(args.burstiness, theta))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
    return summarize(args, model, results, duration, t_start)


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(args, model: str, results: list[RequestResult], duration: float, t_start: float) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "label": args.label,
        "model": model,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "completed": len(ok),
        "failed": len(results) - len(ok),
        # Requests that answered only after a refused try: a server that drops requests shows
        # here even when the retries kept them out of "failed".
        "retried": sum(1 for r in results if r.attempts > 1),
        "errors": sorted({r.error for r in results if r.error and not r.success})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
        "requests": [{"start_s": r.start - t_start, "ttft_s": r.ttft, "latency_s": r.latency,
                      "output_len": r.output_len, "prompt_len": r.prompt_len, "attempts": r.attempts,
                      "error": r.error} for r in results],
    }


def print_table(s: dict) -> None:
    line = "=" * 50
    print(f"{line}\n{' Serving Benchmark Result ':=^50}\n{line}")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Requests tried again", s["retried"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:>10}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        print(f"{' ' + title + ' ':-^50}")
        for stat in ("mean", "p50", "p90", "p99"):
            v = s[key][stat]
            print(f"{stat.upper() + ' (ms)':<40}{'n/a' if v is None else f'{v:.2f}':>10}")
    print(line)
    if s["errors"]:
        print("errors:", s["errors"])


def plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in s["requests"] if r["output_len"]]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].hist([r["ttft_s"] * 1000 for r in reqs], bins=30)
    ax[0, 0].set(title="TTFT", xlabel="ms", ylabel="requests")
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["output_len"] - 1) * 1000 for r in reqs if r["output_len"] > 1]
    ax[0, 1].hist(tpot, bins=30)
    ax[0, 1].set(title="TPOT", xlabel="ms", ylabel="requests")
    ax[1, 0].scatter([r["start_s"] for r in reqs], [r["latency_s"] for r in reqs], s=8)
    ax[1, 0].set(title="End-to-end latency by start time", xlabel="start (s)", ylabel="latency (s)")
    ends = sorted((r["start_s"] + r["latency_s"], r["output_len"]) for r in reqs)
    ax[1, 1].plot([e for e, _ in ends], np.cumsum([n for _, n in ends]))
    ax[1, 1].set(title="Generated tokens (cumulative, at request end)", xlabel="time (s)", ylabel="tokens")
    fig.suptitle(f"{s['label'] or s['model']}: {s['output_throughput']:.1f} output tok/s, "
                 f"{s['request_throughput']:.2f} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def ensure_model(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    from offline_throughput import build_bench_model  # sibling script: bench/ is on sys.path

    return build_bench_model(path)


class _LlamaServerProcess:
    """bench/llamacpp.py's LlamaServer, stopped like the other launched servers' processes."""

    def __init__(self, server):
        self.server = server

    def send_signal(self, sig) -> None:
        self.server.__exit__(None, None, None)

    def wait(self, timeout=None) -> None:
        pass

    def kill(self) -> None:
        pass


def launch_llama_server(gguf: Path | None, args) -> tuple[_LlamaServerProcess, str]:
    from llamacpp import LlamaServer  # sibling script: bench/ is on sys.path

    if gguf is None:
        raise SystemExit("--launch llama-server needs --gguf FILE")
    # One slot per concurrent request, each with room for the longest prompt + output.
    slots = max(1, min(args.max_concurrency or args.num_prompts, args.num_prompts))
    longest = int((args.random_input_len + args.random_output_len) * (1 + args.random_range_ratio)) + 16
    # One HTTP thread per client (its default is one per core: with more clients than that, the
    # extra connections were dropped before their request body was read).
    server = LlamaServer(gguf, parallel=slots, ctx_per_slot=longest, threads=args.server_threads or 2,
                         extra_args=["--threads-http", str(slots + 4), *args.server_args.split()])
    server.__enter__()
    return _LlamaServerProcess(server), server.url


def launch(kind: str, model_dir: Path, extra: str, threads: int | None) -> tuple[subprocess.Popen, str]:
    if kind == "kvserve":
        cmd = [sys.executable, "-m", "kvserve.runtime.cli", "serve", str(model_dir), "--port", "0"]
    else:
        cmd = [sys.executable, str(ROOT / "bench" / "hf_baseline_server.py"), str(model_dir), "--port", "0"]
    cmd += extra.split()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    url = None
    for line in proc.stderr:
        sys.stderr.write(line)
        if (m := re.search(r"listening on (http://[\d.]+:\d+)", line)):
            url = m.group(1)
            break
    if url is None:
        raise SystemExit(f"{kind} server did not start")
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep the pipe drained
    deadline = time.time() + 600
    import urllib.request

    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{kind} server never became ready")


def main(argv=None) -> int:
    args = parse_args(argv)
    proc = None
    base_url = args.base_url
    if args.launch:
        model_dir = ensure_model(args.model_dir)
        if args.vocab_size is None:
            args.vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        if args.launch == "llama-server":
            proc, base_url = launch_llama_server(args.gguf, args)
        else:
            proc, base_url = launch(args.launch, model_dir, args.server_args, args.server_threads)
        args.label = args.label or args.launch
    if base_url is None:
        raise SystemExit("--base-url or --launch is required")
    try:
        summary = asyncio.run(run(args, base_url))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_table(summary)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    stem = args.result_filename or f"serve-{summary['label'] or 'server'}-in{args.random_input_len}-" \
                                    f"out{args.random_output_len}-" \
                                    f"n{args.num_prompts}-c{args.max_concurrency or 'inf'}-r{args.request_rate}"
    stem = stem.removesuffix(".json")
    out = args.result_dir / f"{stem}.json"
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    if not args.no_plot:
        plot(summary, args.result_dir / f"{stem}.png")
        print(f"wrote {args.result_dir / (stem + '.png')}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
