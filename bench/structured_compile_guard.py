"""The issue-18 grammar attack, old design against new, on SmolLM2's real 49k vocabulary.

    python bench/structured_compile_guard.py                  # 2 x 8,000-branch anyOf, timeout 10 s
    python bench/structured_compile_guard.py --branches 6000 --timeout 3

An attacker sends two schemas that are each an ``anyOf`` of N one-property objects; meanwhile
another client sends a small schema. Measured for each design, in this one process:

- ``threads`` (kvserve before issue 18): compiles in a pool of 2 threads of the server process,
  no timeout (the attack's compiles run to the end), the small one waits for a free thread;
- ``workers`` (now): StructuredOutputManager with 2 killable worker processes, the compile
  timeout, one running compile per client while others wait.

Columns: when the small schema was ready, when each attack compile ended (result or refusal),
this process's CPU seconds and resident memory (RSS) growth over the attack, and for the
workers design the worker processes' peak RSS and whether the killed ones are gone.

Prints a table and writes JSON (bench/results/structured_compile_guard.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model directory (its tokenizer; default SmolLM2)")
    p.add_argument("--branches", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=10.0, help="compile timeout of the workers design (s)")
    p.add_argument("--out", type=Path, default=RESULTS / "structured_compile_guard.json")
    return p.parse_args(argv)


def rss_mib(pid="self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (FileNotFoundError, StopIteration):
        return 0.0


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def heavy(tag: str, n: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"{tag}{i}": {"type": "string"}}, "required": [f"{tag}{i}"]}
                      for i in range(n)]}


SMALL = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
         "required": ["city", "population"]}


def run_threads(tokenizer, n: int) -> dict:
    """The design before issue 18: GrammarCompiler.compile_* in 2 threads of this process."""
    import xgrammar as xgr

    from kvserve.runtime.structured_outputs.compile import compile_params
    from kvserve.runtime.structured_outputs.params import StructuredOutputsParams as P

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_params(compiler, P(json={"type": "object"}))
    rss0, cpu0 = rss_mib(), cpu_s()
    pool = ThreadPoolExecutor(2)
    start = time.monotonic()
    attacks = [pool.submit(compile_params, compiler, P(json=heavy(f"t{i}", n))) for i in range(2)]
    time.sleep(0.2)
    small = pool.submit(compile_params, compiler, P(json=SMALL))
    small.result()
    small_s = time.monotonic() - start
    ended = []
    for f in attacks:
        f.result()
        ended.append(time.monotonic() - start)
    del attacks
    pool.shutdown()
    return {"small_ready_s": small_s, "attack_ended_s": ended, "server_cpu_s": cpu_s() - cpu0,
            "server_rss_growth_mib": rss_mib() - rss0, "worker_peak_rss_mib": None, "killed_workers_gone": None}


def run_workers(tokenizer, n: int, timeout: float) -> dict:
    from kvserve.runtime.structured_outputs.admission import CompileSettings
    from kvserve.runtime.structured_outputs.limits import GrammarLimits
    from kvserve.runtime.structured_outputs.manager import StructuredOutputManager
    from kvserve.runtime.structured_outputs.params import StructuredOutputsParams as P

    manager = StructuredOutputManager(tokenizer, 49152, [tokenizer.eos_token_id])
    manager.configure(GrammarLimits(max_alternatives=10**6, max_schema_bytes=10**8), CompileSettings(timeout_s=timeout))
    manager.compile(P(json={"type": "object"})).result(120)
    pids_before = set(manager.worker_pids())
    peak = {"mib": 0.0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak["mib"] = max([peak["mib"]] + [rss_mib(p) for p in pids_before])
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rss0, cpu0 = rss_mib(), cpu_s()
    schemas = [P(json=heavy(f"w{i}", n)) for i in range(2)]
    start = time.monotonic()
    tickets = [manager.acquire(s, client="attacker") for s in schemas]
    time.sleep(0.2)
    small = manager.acquire(P(json=SMALL), client="user")
    small.future.result(60)
    small_s = time.monotonic() - start
    ended, outcomes = [], []
    for t in tickets:
        try:
            t.future.result(10 * timeout + 60)
            outcomes.append("compiled")
        except ValueError as exc:
            outcomes.append("refused: timeout" if "timeout" in str(exc) else f"refused: {exc}")
        ended.append(time.monotonic() - start)
        t.release()
    small.release()
    stop.set()
    sampler.join()
    killed = pids_before - set(manager.worker_pids())
    time.sleep(0.2)
    gone = all(rss_mib(p) == 0.0 for p in killed)
    result = {"small_ready_s": small_s, "attack_ended_s": ended, "attack_outcomes": outcomes,
              "server_cpu_s": cpu_s() - cpu0, "server_rss_growth_mib": rss_mib() - rss0,
              "worker_peak_rss_mib": peak["mib"], "killed_workers": len(killed), "killed_workers_gone": gone}
    manager.close()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    model = args.model
    if model is None:
        from kvserve.testing.realmodel import ensure_smollm2

        model = ensure_smollm2().hf_dir
    tokenizer = AutoTokenizer.from_pretrained(model)
    load = os.getloadavg()
    rows = {"workers": run_workers(tokenizer, args.branches, args.timeout),
            "threads": run_threads(tokenizer, args.branches)}
    flags = [f for f in ("avx512f", "avx2", "fma") if f in open("/proc/cpuinfo").read()]
    out = {"branches": args.branches, "timeout_s": args.timeout, "rows": rows, "load_average": load,
           "cpu_flags": flags, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"{args.branches}-branch anyOf x 2 + one small schema; timeout {args.timeout:g} s (workers); "
          f"load {load[0]:.2f}; cpu flags {','.join(flags)}")
    print(f"{'design':8} {'small ready s':>13} {'attack ended s':>16} {'server CPU s':>12} {'server RSS +MiB':>15} "
          f"{'worker peak MiB':>15} {'killed gone':>11}")
    for name, r in rows.items():
        ended = "/".join(f"{e:.1f}" for e in r["attack_ended_s"])
        peak = "-" if r["worker_peak_rss_mib"] is None else f"{r['worker_peak_rss_mib']:.0f}"
        gone = "-" if r["killed_workers_gone"] is None else str(r["killed_workers_gone"])
        print(f"{name:8} {r['small_ready_s']:13.2f} {ended:>16} {r['server_cpu_s']:12.1f} "
              f"{r['server_rss_growth_mib']:15.0f} {peak:>15} {gone:>11}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
