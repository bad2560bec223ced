"""Where a returning turn's time to first token goes, with and without the KV offload tier.

    python bench/kv_offload_profile.py                  # bench/kv_offload.py's workload, in process, 2 rounds
    python bench/kv_offload_profile.py --rounds 4 --num-kv-blocks 64 --max-num-seqs 2

bench/kv_offload.py measures TTFT through the server; this runs the same conversations (same
seeds, texts, answer length, pool and running cap) on an in-process LLMEngine per configuration,
the pool alone and the pool plus a file tier, in alternating rounds, and records every step:
which requests ran how many tokens, how long the step took, and how long scheduling took
(tier loads happen there). Each returning turn's TTFT (arrival to first token, no HTTP) is then
split over the steps it waited through:

  * own step: the step that computed the rest of its prompt (its prefill, tier loads included);
  * others' prefill steps: steps, before its own, that computed other requests' prompts;
  * decode-only steps: steps that only decoded other requests' tokens;
  * between steps: the engine's own bookkeeping between steps.

Also printed per configuration: prompt tokens computed, seconds per computed prompt token, the
mean decode-only step, and what the TTFT ratio could at most be if decode steps cost nothing
(every request of the run is in the queue ahead of a returning turn, so its wait scales with the
run's total prefill, not with its own). Writes bench/results/kv_offload_profile.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=40)
    p.add_argument("--user-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--kv-offload-bytes", type=int, default=1 << 30)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2, help="rounds, the configurations' order alternating")
    p.add_argument("--out", type=Path, default=RESULTS / "kv_offload_profile.json")
    return p.parse_args(argv)


class Recorder:
    """Wraps one engine's scheduler.schedule to note each step: start, scheduling seconds, and
    (request id, first position, tokens) of every scheduled sequence; the end is set by the loop."""

    def __init__(self, engine):
        self.steps: list[dict] = []
        scheduler = engine.core.scheduler
        schedule = scheduler.schedule

        def recorded(*args, **kwargs):
            t0 = time.perf_counter()
            out = schedule(*args, **kwargs)
            if not out.is_empty:
                self.steps.append({"t0": t0, "schedule_s": time.perf_counter() - t0, "end": None,
                                   "items": [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled]})
            return out

        scheduler.schedule = recorded


def run_round(engine, args, seed: int) -> tuple[list[dict], dict]:
    """The conversations of bench/kv_offload.py's round `seed` (testing/router_harness.py's
    Workload texts), each turn added the moment the previous one finishes."""
    from kvserve.runtime.sampling_params import SamplingParams
    from kvserve.testing.router_harness import Workload

    tok = engine.tokenizer
    text = Workload(seed=seed)._text
    rng = random.Random(seed)
    system = f"[{seed}] " + text(rng, args.system_words)
    plans = [[text(rng, args.user_words) for _ in range(args.turns)] for _ in range(args.conversations)]
    messages = {c: [{"role": "system", "content": system}] for c in range(args.conversations)}
    turn = dict.fromkeys(range(args.conversations), 0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    requests: dict[str, dict] = {}

    def submit(c: int) -> None:
        t = turn[c]
        messages[c].append({"role": "user", "content": f"conversation {seed}.{c} turn {t}: {plans[c][t]}"})
        prompt = tok.apply_chat_template(messages[c], add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        rid = f"{seed}.{c}.{t}"
        requests[rid] = {"turn": t, "arrival": time.perf_counter(), "prompt_tokens": len(ids)}
        engine.add_request(rid, {"prompt_token_ids": ids}, params)

    recorder = engine._kvperf_recorder
    first_step = len(recorder.steps)
    for c in range(args.conversations):
        submit(c)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        if len(recorder.steps) > first_step and recorder.steps[-1]["end"] is None:
            recorder.steps[-1]["end"] = now
        for out in outputs:
            r = requests[out.request_id]
            if "first" not in r and out.outputs[0].token_ids:
                r["first"] = now
            if out.finished:
                c = int(out.request_id.split(".")[1])
                messages[c].append({"role": "assistant", "content": out.outputs[0].text or "ok"})
                turn[c] += 1
                if turn[c] < args.turns:
                    submit(c)
    return recorder.steps[first_step:], requests


def breakdown(steps: list[dict], requests: dict[str, dict]) -> dict:
    """Each returning turn's TTFT over the steps it overlaps (module docstring), averaged."""
    parts = {"own_step_s": [], "others_prefill_steps_s": [], "decode_only_steps_s": [], "between_steps_s": [],
             "ttft_s": [], "steps_waited": []}
    for rid, r in requests.items():
        if r["turn"] == 0:
            continue
        a, f = r["arrival"], r["first"]
        own = others = decode = 0.0
        waited = 0
        for s in steps:
            lo, hi = max(a, s["t0"]), min(f, s["end"])
            if hi <= lo:
                continue
            span = hi - lo
            if any(i == rid for i, _, _ in s["items"]):
                own += span
            elif any(n > 1 for _, _, n in s["items"]):
                others += span
                waited += 1
            else:
                decode += span
                waited += 1
        ttft = f - a
        for key, value in (("own_step_s", own), ("others_prefill_steps_s", others), ("decode_only_steps_s", decode),
                           ("between_steps_s", ttft - own - others - decode), ("ttft_s", ttft),
                           ("steps_waited", waited)):
            parts[key].append(value)
    out = {f"mean_{k}": statistics.fmean(v) for k, v in parts.items()}
    ttfts = sorted(parts["ttft_s"])
    out["p50_ttft_s"] = ttfts[len(ttfts) // 2] if len(ttfts) % 2 else statistics.median(ttfts)
    return out


def step_summary(steps: list[dict]) -> dict:
    decode = [s["end"] - s["t0"] for s in steps if all(n == 1 for _, _, n in s["items"])]
    prefill = [s for s in steps if any(n > 1 for _, _, n in s["items"])]
    tokens = sum(n for s in prefill for _, _, n in s["items"] if n > 1)
    prefill_s = sum(s["end"] - s["t0"] for s in prefill)
    return {"steps": len(steps), "decode_only_steps": len(decode), "decode_only_s": sum(decode),
            "decode_only_step_ms": 1000 * statistics.fmean(decode) if decode else 0.0,
            "prefill_steps": len(prefill), "prefill_steps_s": prefill_s, "computed_prompt_tokens": tokens,
            "prefill_ms_per_token": 1000 * prefill_s / tokens if tokens else 0.0,
            "schedule_s": sum(s["schedule_s"] for s in steps),
            "total_step_s": sum(s["end"] - s["t0"] for s in steps)}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kvserve.runtime.config import EngineConfig
    from kvserve.runtime.engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    if args.model is None:
        from kvserve.testing.realmodel import ensure_smollm2

        args.model = Path(ensure_smollm2().hf_dir)
    tier_root = Path(tempfile.mkdtemp(prefix="kvserve-profile-tier-"))
    base = dict(model=str(args.model), num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                max_model_len=4096, dtype="float32")
    configs = {"pool-only": base, "file-tier": {**base, "kv_offload_bytes": args.kv_offload_bytes,
                                                "kv_offload_dir": str(tier_root / "tier")}}
    load_before = os.getloadavg()
    engines = {}
    try:
        for name, kw in configs.items():
            engines[name] = LLMEngine(EngineConfig(**kw))
            engines[name]._kvperf_recorder = Recorder(engines[name])
        collected = {name: ([], {}) for name in configs}
        for r in range(args.rounds):
            order = list(configs) if r % 2 == 0 else list(configs)[::-1]
            for name in order:
                steps, requests = run_round(engines[name], args, args.seed + r)
                collected[name][0].extend(steps)
                collected[name][1].update(requests)
                b = breakdown(steps, requests)
                print(f"  round {r + 1} {name:<9}: returning TTFT p50 {b['p50_ttft_s']:.2f} s, mean "
                      f"{b['mean_ttft_s']:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(tier_root, ignore_errors=True)
    rows = {}
    for name, (steps, requests) in collected.items():
        rows[name] = {**step_summary(steps), **breakdown(steps, requests)}
    pool, tier = rows["pool-only"], rows["file-tier"]
    # With decode steps free, a returning turn's wait scales with the run's total prefill.
    bound = pool["prefill_steps_s"] / tier["prefill_steps_s"] if tier["prefill_steps_s"] else float("nan")
    print()
    print("| | pool only | file tier | ratio |")
    print("|---|---|---|---|")
    for key, label in (("p50_ttft_s", "returning TTFT p50 (s)"), ("mean_ttft_s", "returning TTFT mean (s)"),
                       ("mean_own_step_s", "  own step (prefill, tier loads)"),
                       ("mean_others_prefill_steps_s", "  others' prefill steps"),
                       ("mean_decode_only_steps_s", "  decode-only steps"), ("mean_between_steps_s", "  between steps"),
                       ("mean_steps_waited", "steps waited through (mean)"),
                       ("computed_prompt_tokens", "prompt tokens computed"),
                       ("prefill_steps_s", "seconds in steps with a prefill"),
                       ("prefill_ms_per_token", "ms per computed prompt token"),
                       ("decode_only_steps", "decode-only steps"), ("decode_only_step_ms", "ms per decode-only step"),
                       ("schedule_s", "scheduling seconds (tier loads)"), ("total_step_s", "seconds in steps")):
        a, b = pool[key], tier[key]
        print(f"| {label} | {a:.2f} | {b:.2f} | {a / b if b else float('nan'):.2f}x |")
    print(f"\nreturning TTFT p50 {pool['p50_ttft_s'] / tier['p50_ttft_s']:.2f}x lower with the file tier; "
          f"with decode steps free it could be at most ~{bound:.2f}x (the ratio of the runs' prefill seconds)")
    result = {"command": "python bench/kv_offload_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": load_before,
              "load_after": os.getloadavg(), "rows": rows, "decode_free_bound": bound}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
