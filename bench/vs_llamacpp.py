"""kvserve vs transformers vs llama.cpp on the real SmolLM2-135M-Instruct, at equal precision, side by side.

One command, three sections (each engine in turn, one heavy process at a time, same threads):

  decode   batch-1 decode ms/token: a 128-token prompt, then --decode-tokens greedy tokens
           (kvserve: engine steps; transformers: generate timed per token by a streamer;
           llama.cpp: llama-server's own per-token timing)
  offline  a mixed workload, all requests at once: 48 requests, prompts 32-384 tokens, outputs
           32-192 tokens, ignore_eos, greedy (kvserve LLM.generate; transformers generate on
           static left-padded batches of 16; llama-server with 16 slots and all 48 requests sent
           at once)
  serve    bench/serve.py against each server at concurrency 1, 8 and 32 (input 256, output 128,
           streaming): TTFT, TPOT, output tok/s, and a PNG plot of the three side by side

    export KVSERVE_LLAMACPP_DIR=/work/main/build/llamacpp     # llama.cpp's build (bench/llamacpp.py)
    python bench/vs_llamacpp.py                                # everything (~20 min on 2 busy cores)
    python bench/vs_llamacpp.py --quick                        # fewer tokens and requests (~5 min)
    python bench/vs_llamacpp.py --sections decode --engines kvserve,llamacpp

float32 everywhere: the HF directory (float32 safetensors, testing/realmodel.py) for kvserve and
transformers, and llama.cpp's own F32 GGUF conversion of that directory. Writes
bench/results/vs_llamacpp.json and bench/results/vs_llamacpp-serve.png; prints one table with
each figure's ratio to llama.cpp's and the targets of issue 13.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

ENGINES = ("kvserve", "transformers", "llamacpp")
SECTIONS = ("decode", "offline", "serve")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every engine")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-repeats", type=int, default=3, help="median of this many batch-1 runs")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=384)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=192)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--llamacpp-slots", type=int, default=16)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--serve-input", type=int, default=256)
    p.add_argument("--serve-output", type=int, default=128)
    p.add_argument("--serve-hf", action="store_true",
                   help="also serve with transformers one request at a time (bench/hf_baseline_server.py; slow)")
    p.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags for the serve section")
    p.add_argument("--quick", action="store_true", help="32 decode tokens, 12 offline requests, 2x fewer serve prompts")
    p.add_argument("--out", type=Path, default=RESULTS / "vs_llamacpp.json")
    args = p.parse_args(argv)
    if args.quick:
        args.decode_tokens, args.decode_repeats = 32, 1
        args.num_requests = min(args.num_requests, 12)
    return args


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def prompt_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


# ------------------------------------------------------------------------------------------ decode


def decode_kvserve(hf_dir: Path, prompt: list[int], n: int, repeats: int) -> float:
    from kvserve.runtime import LLM

    llm = LLM(str(hf_dir), dtype="float32", device="cpu", max_model_len=2048)
    ms = batch1_decode_ms(llm, prompt, n, repeats)
    llm.close()
    return ms


def batch1_decode_ms(llm, prompt: list[int], n: int, repeats: int) -> float:
    """Median ms per decode step of one greedy request (prefill and first token not counted)."""
    from kvserve.runtime import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt[:16]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    per_token = []
    for r in range(repeats):
        eng.add_request(f"d{r}", {"prompt_token_ids": prompt}, params)
        eng.step()  # prefill + first token
        t0 = time.perf_counter()
        steps = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        per_token.append((time.perf_counter() - t0) / steps)
    return statistics.median(per_token) * 1000


def decode_transformers(hf_dir: Path, prompt: list[int], n: int, repeats: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    per_token = []
    with torch.inference_mode():
        model.generate(x[:, :16], max_new_tokens=4, do_sample=False)  # warm-up
        for _ in range(repeats):
            s = Stamps()
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, streamer=s, pad_token_id=0)
            # put() #0 is the prompt, #1 the first token (after prefill): time the rest.
            per_token.append((s.times[-1] - s.times[1]) / (len(s.times) - 2))
    return statistics.median(per_token) * 1000


def decode_llamacpp(gguf: Path, prompt: list[int], n: int, repeats: int, threads: int) -> float:
    from llamacpp import LlamaServer

    with LlamaServer(gguf, parallel=1, ctx_per_slot=2048, threads=threads) as server:
        server.completion(prompt[:16], 4)  # warm-up
        per_token = [server.completion(prompt, n)["timings"]["predicted_per_token_ms"] for _ in range(repeats)]
    return statistics.median(per_token)


# ----------------------------------------------------------------------------------------- offline


def workload(args, seed: int = 0):
    rng = random.Random(seed)
    prompts, outputs = [], []
    for i in range(args.num_requests):
        prompts.append(prompt_ids(rng.randint(args.min_prompt, args.max_prompt), seed * 1000 + i))
        outputs.append(rng.randint(args.min_output, args.max_output))
    return prompts, outputs


def offline_kvserve(hf_dir: Path, prompts, outputs) -> float:
    from kvserve.runtime import LLM, SamplingParams

    llm = LLM(str(hf_dir), dtype="float32", device="cpu", max_model_len=2048)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=2), use_tqdm=False)
    t0 = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert sum(len(r.outputs[0].token_ids) for r in results) == sum(outputs)
    llm.close()
    return wall


def offline_transformers(hf_dir: Path, prompts, outputs, batch_size: int) -> float:
    import torch
    from offline_throughput import run_static_batches

    timer, _ = run_static_batches(hf_dir, prompts, outputs, batch_size, "cpu", torch.float32, pad_id=0)
    return timer.wall


def offline_llamacpp(gguf: Path, prompts, outputs, slots: int, threads: int, max_len: int) -> float:
    from llamacpp import LlamaServer

    with LlamaServer(gguf, parallel=slots, ctx_per_slot=max_len + 16, threads=threads) as server:
        server.completion(prompts[0][:16], 2)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            bodies = list(pool.map(lambda po: server.completion(po[0], po[1]), zip(prompts, outputs)))
        wall = time.perf_counter() - t0
    produced = sum(b["tokens_predicted"] for b in bodies)
    assert produced == sum(outputs), (produced, sum(outputs))
    return wall


# ------------------------------------------------------------------------------------------- serve


def serve_run(kind: str, hf_dir: Path, gguf: Path, concurrency: int, args) -> dict:
    num = max(4, 4 * concurrency) if concurrency > 1 else 4
    if args.quick:
        num = max(2, num // 2)
    stem = f"vs_llamacpp-serve-{kind}-c{concurrency}"
    launch = {"kvserve": "kvserve", "transformers": "hf-baseline", "llamacpp": "llama-server"}[kind]
    cmd = [sys.executable, str(ROOT / "bench" / "serve.py"), "--launch", launch, "--model-dir", str(hf_dir),
           "--num-prompts", str(num), "--max-concurrency", str(concurrency), "--random-input-len",
           str(args.serve_input), "--random-output-len", str(args.serve_output), "--server-threads",
           str(args.threads), "--result-filename", stem, "--no-plot", "--label", kind]
    if kind == "llamacpp":
        cmd += ["--gguf", str(gguf)]
    if kind == "kvserve":
        extra = f"--dtype float32 --device cpu --max-model-len 2048 {args.kvserve_args}".strip()
        cmd += ["--server-args", extra]
    # serve.py exits 1 when requests failed: they are counted in the table, not a reason to stop.
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode not in (0, 1):
        raise SystemExit(f"bench/serve.py failed for {kind} at concurrency {concurrency}")
    return json.loads((RESULTS / f"{stem}.json").read_text())


def plot_serve(serve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for kind, runs in serve.items():
        cs = sorted(int(c) for c in runs)
        axes[0].plot(cs, [runs[str(c)]["output_throughput"] for c in cs], marker="o", label=kind)
        axes[1].plot(cs, [runs[str(c)]["tpot_ms"]["mean"] for c in cs], marker="o", label=kind)
        axes[2].plot(cs, [runs[str(c)]["ttft_ms"]["mean"] for c in cs], marker="o", label=kind)
    for ax, title in zip(axes, ("output tok/s (higher is better)", "TPOT mean, ms", "TTFT mean, ms")):
        ax.set(title=title, xlabel="concurrency", xscale="log")
        ax.legend()
    axes[2].set_yscale("log")
    fig.suptitle("SmolLM2-135M-Instruct float32 / F32 GGUF, streaming /v1/completions")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from llamacpp import convert_hf_to_gguf

    from kvserve.testing.realmodel import ensure_smollm2

    engines = [e for e in args.engines.split(",") if e]
    sections = [s for s in args.sections.split(",") if s]
    hf_dir = ensure_smollm2().hf_dir
    gguf = convert_hf_to_gguf(hf_dir, "f32") if "llamacpp" in engines else None
    result = dict(benchmark="vs_llamacpp", date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                  threads=args.threads, model=str(hf_dir), gguf=str(gguf),
                  args={k: str(v) for k, v in vars(args).items()}, load_average_start=load_average())
    from kvserve.kernels.cpu import native

    result["kvserve_cpu_kernels"] = native.status()
    print(f"SmolLM2-135M-Instruct float32, {args.threads} threads, load average {load_average()}, "
          f"kvserve native CPU kernels: {native.status()}", flush=True)

    if "decode" in sections:
        prompt = prompt_ids(128, 7)
        d = {}
        for e in engines:
            if e == "kvserve":
                d[e] = decode_kvserve(hf_dir, prompt, args.decode_tokens, args.decode_repeats)
            elif e == "transformers":
                d[e] = decode_transformers(hf_dir, prompt, args.decode_tokens, args.decode_repeats)
            else:
                d[e] = decode_llamacpp(gguf, prompt, args.decode_tokens, args.decode_repeats, args.threads)
            print(f"decode {e}: {d[e]:.1f} ms/token (load {load_average()})", flush=True)
        result["decode_ms_per_token"] = d

    if "offline" in sections:
        prompts, outputs = workload(args)
        o = {}
        for e in engines:
            if e == "kvserve":
                wall = offline_kvserve(hf_dir, prompts, outputs)
            elif e == "transformers":
                wall = offline_transformers(hf_dir, prompts, outputs, args.hf_batch_size)
            else:
                wall = offline_llamacpp(gguf, prompts, outputs, args.llamacpp_slots, args.threads,
                                        args.max_prompt + args.max_output)
            o[e] = dict(seconds=wall, output_tokens=sum(outputs), output_tokens_per_s=sum(outputs) / wall)
            print(f"offline {e}: {o[e]['output_tokens_per_s']:.1f} output tok/s ({wall:.1f} s, load "
                  f"{load_average()})", flush=True)
        result["offline"] = dict(num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
                                 output_tokens=sum(outputs), engines=o)

    if "serve" in sections:
        serve: dict[str, dict[str, dict]] = {}
        for e in engines:
            if e == "transformers" and not args.serve_hf:
                continue
            for c in [int(x) for x in args.concurrency.split(",")]:
                if e == "transformers" and c > 8:
                    continue  # one request at a time: concurrency only queues
                s = serve_run(e, hf_dir, gguf, c, args)
                serve.setdefault(e, {})[str(c)] = {k: s.get(k) for k in ("completed", "failed", "retried", "errors",
                                                                         "duration_s", "output_throughput",
                                                                         "ttft_ms", "tpot_ms")}
                print(f"serve {e} c={c}: {s['output_throughput']:.1f} output tok/s, TTFT {_ms(s['ttft_ms'])} ms,"
                      f" TPOT {_ms(s['tpot_ms'], 1)} ms, {s['failed']} of {s['completed'] + s['failed']} failed"
                      f" (load {load_average()})", flush=True)
        result["serve"] = serve
        png = args.out.with_name(args.out.stem + "-serve.png")
        plot_serve(serve, png)
        print(f"wrote {png}")

    result["load_average_end"] = load_average()
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


def _ms(stats: dict, digits: int = 0) -> str:
    return "-" if stats["mean"] is None else f"{stats['mean']:.{digits}f}"  # every request failed


def _ratio(x, base, higher_is_better: bool) -> str:
    if x is None or not base:
        return "-"
    return f"{(x / base if higher_is_better else x / base):.2f}x"


def print_table(r: dict) -> None:
    print(f"\nSmolLM2-135M-Instruct float32, {r['threads']} threads, {r['date']}, load average "
          f"{r['load_average_start']} -> {r['load_average_end']}")
    if "decode_ms_per_token" in r:
        d = r["decode_ms_per_token"]
        base = d.get("llamacpp")
        print(f"\n{'batch-1 decode':<14} {'ms/token':>9} {'vs llama.cpp':>13}")
        for e, v in d.items():
            print(f"{e:<14} {v:>9.1f} {_ratio(v, base, False):>13}")
        if base and "kvserve" in d:
            ok = d["kvserve"] <= 1.1 * base
            print(f"target kvserve <= 1.1x llama.cpp: {'met' if ok else 'NOT met'} ({d['kvserve'] / base:.2f}x)")
    if "offline" in r:
        o = r["offline"]["engines"]
        base = o.get("llamacpp", {}).get("output_tokens_per_s")
        hf = o.get("transformers", {}).get("output_tokens_per_s")
        print(f"\n{'offline':<14} {'tok/s':>9} {'vs llama.cpp':>13} {'vs transformers':>16}")
        for e, v in o.items():
            t = v["output_tokens_per_s"]
            print(f"{e:<14} {t:>9.1f} {_ratio(t, base, True):>13} {_ratio(t, hf, True):>16}")
        if "kvserve" in o:
            k = o["kvserve"]["output_tokens_per_s"]
            if base:
                print(f"target kvserve >= 1.5x llama.cpp: {'met' if k >= 1.5 * base else 'NOT met'} ({k / base:.2f}x)")
            if hf:
                print(f"target kvserve >= 3x transformers: {'met' if k >= 3 * hf else 'NOT met'} ({k / hf:.2f}x)")
    if r.get("serve"):
        print(f"\n{'serve':<14} {'conc':>4} {'failed':>7} {'out tok/s':>10} {'TTFT ms':>9} {'TPOT ms':>9} "
              f"{'tok/s vs llama.cpp':>19}")
        base = r["serve"].get("llamacpp", {})
        for e, runs in r["serve"].items():
            for c, s in runs.items():
                b = base.get(c, {}).get("output_throughput")
                failed = f"{s['failed']}/{s['completed'] + s['failed']}"
                print(f"{e:<14} {c:>4} {failed:>7} {s['output_throughput']:>10.1f} {_ms(s['ttft_ms']):>9} "
                      f"{_ms(s['tpot_ms'], 1):>9} {_ratio(s['output_throughput'], b, True):>19}")
        lost = {e: sum(s["failed"] for s in runs.values()) for e, runs in r["serve"].items()}
        if any(lost.values()):
            print("requests lost (the throughput ratios are not comparable): "
                  + ", ".join(f"{e} {n}" for e, n in lost.items()))
        k8 = r["serve"].get("kvserve", {}).get("8")
        b8 = base.get("8")
        if k8 and b8:
            ok = k8["output_throughput"] >= b8["output_throughput"]
            print(f"target kvserve >= llama.cpp at concurrency 8: {'met' if ok else 'NOT met'} "
                  f"({k8['output_throughput'] / b8['output_throughput']:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
