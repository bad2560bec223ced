"""Where a speculative step's time goes, component by component: the host work around the forward
pass (proposing, scheduling, packing, padding, verifying, bookkeeping) against the forward itself.

    python bench/spec_step_host.py                     # CPU: the CUDA graphs' twin (same Python as a GPU)
    python bench/spec_step_host.py --device cuda       # real graphs; each forward is synchronized

On a GPU a small model's step is a few hundred microseconds of graph replay, so whatever the host
does around it decides the speed. On the CPU the engine runs with the CUDA graphs' CPU twin
(padded static buffers, ``capture=False``) and verification kept multi-token, as on a GPU, so
every line but ``forward`` is the Python a GPU step runs too. With ``--device cuda`` the forward
(and each draft decode) is followed by a synchronize, so that the GPU's time lands in
``forward`` rather than in whichever later line first reads a result back.

Methods run one request at a time (batch 1, the launch-bound case), greedy, on input-grounded
prompts (a passage, then its first half again) with bench/offline_throughput.py's ~50M random
Llama (or ``--model``). The table gives ms per engine step (inclusive; indented lines are part of
the line above) and writes JSON. ``wait_and_rest`` is what ``worker_forward`` spends outside its
other lines: the prefill steps' eager forwards (a few per run) and, on a GPU, the synchronized
wait for the device. ``host_ms_per_step`` is the step less the forwards, logits and draft
decodes: the Python around them. On CUDA it also replays each captured family's batch-1 graph
alone, synchronized (decode, verification, the draft's decode): the device's own time per step kind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

# (label, depth): the report's rows, in order; depth is indentation (inclusive times).
ROWS = [("step", 0), ("propose_drafts", 1), ("schedule", 1), ("execute_model", 1), ("draft_propose", 2),
        ("draft_forward", 3), ("draft_logits", 3), ("prepare", 2), ("worker_forward", 2), ("pad", 3),
        ("to_device", 3), ("replay_or_forward", 3), ("logits", 3), ("wait_and_rest", 3), ("draft_mirror", 2),
        ("verify_and_rest", 2), ("finish_step", 1), ("engine_rest", 1)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="target HF directory (default: ~50M random Llama)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--methods", default="none,ngram,draft-identical")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=3)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS / "spec_step_host.json")
    return p.parse_args(argv)


class Timers:
    """Wraps methods so that each call's wall time adds to a label (inclusive of nested ones)."""

    def __init__(self, sync=None):
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.sync = sync

    def wrap(self, obj, name: str, label: str, sync: bool = False) -> None:
        real = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = real(*args, **kwargs)
            if sync and self.sync is not None:
                self.sync()
            self.total[label] += time.perf_counter() - t0
            self.calls[label] += 1
            return out

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


def make_engine(model_dir, args, spec):
    from kvserve.runtime import LLMEngine

    # Batch 1 only needs the smallest buckets: a few captures keep a GPU run's start-up short.
    engine = LLMEngine.from_args(model=str(model_dir), device=args.device, kv_cache_memory_bytes=1 << 27,
                                 max_model_len=1024, max_num_seqs=8, speculative_config=spec,
                                 enable_prefix_caching=False, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    if args.device == "cpu":  # the graphs' CPU twin, verification kept multi-token: a GPU's Python
        engine.executor.runner.verify_as_decode_rows = False
        worker = engine.executor.driver_worker
        worker.graphs = worker.build_graphs([1, 2, 4, 8], max_model_len=engine.max_model_len, capture=False)
        worker.verify_graphs = worker.build_verify_graphs([1, 2, 4, 8], max_model_len=engine.max_model_len,
                                                          capture=False)
        spec_decoder = engine.executor.spec_decoder
        if spec_decoder is not None and spec_decoder.draft_model is not None:
            spec_decoder.build_draft_graphs([1, 2, 4, 8], max_model_len=engine.max_model_len, capture=False)
    return engine


def instrument(engine, timers: Timers) -> None:
    core = engine.engine_core if hasattr(engine, "engine_core") else engine.core
    executor = engine.executor
    worker = executor.driver_worker
    timers.wrap(engine, "step", "step")
    timers.wrap(executor, "propose_drafts", "propose_drafts")
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(executor, "execute_model", "execute_model")
    timers.wrap(core, "_finish_step", "finish_step")
    timers.wrap(executor.runner, "prepare", "prepare")
    timers.wrap(worker, "execute_model", "worker_forward", sync=True)
    timers.wrap(worker, "_pad_for_graphs", "pad")
    from kvserve.runtime.executor.forward_input import ForwardInput

    if not hasattr(ForwardInput, "_untimed_to"):  # the class's, once per process (every engine's steps)
        ForwardInput._untimed_to = ForwardInput.to
    real_to = ForwardInput._untimed_to

    def to(self, device):
        t0 = time.perf_counter()
        out = real_to(self, device)
        timers.total["to_device"] += time.perf_counter() - t0
        return out

    ForwardInput.to = to
    timers.wrap(worker.model, "compute_logits", "logits")
    for graphs in [worker.graphs, *worker.verify_graphs.values()]:
        if graphs is not None:
            timers.wrap(graphs, "run", "replay_or_forward")
    spec = executor.spec_decoder
    if spec is not None and spec.draft_model is not None:
        # The draft's decodes inside its proposals, and the steps it mirrors outside them.
        inside = [False]
        timers.wrap(spec.draft_model, "compute_logits", "draft_logits")
        real_forward, real_propose = spec._draft_forward, spec._propose

        def draft_forward(*args, **kwargs):
            t0 = time.perf_counter()
            out = real_forward(*args, **kwargs)
            if timers.sync is not None:
                timers.sync()
            label = "draft_forward" if inside[0] else "draft_mirror"
            timers.total[label] += time.perf_counter() - t0
            timers.calls[label] += 1
            return out

        def propose(*args, **kwargs):
            inside[0] = True
            t0 = time.perf_counter()
            try:
                return real_propose(*args, **kwargs)
            finally:
                inside[0] = False
                timers.total["draft_propose"] += time.perf_counter() - t0

        spec._draft_forward, spec._propose = draft_forward, propose


def run(engine, prompts, args) -> tuple[list, int]:
    from kvserve.runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    outputs, steps = [], 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs.append(list(out.outputs[0].token_ids))
            steps += 1
    return outputs, steps


def launch_costs() -> dict[str, float]:
    """Host microseconds of one tiny eager CUDA op, one small pageable host-to-device copy and one
    read-back (.tolist()) on this machine: what each eager op around a replayed graph costs."""
    import torch

    x = torch.zeros(16, device="cuda")
    h = torch.zeros(16, dtype=torch.long)
    out = {}
    for name, op, n in (("eager_op_us", lambda: x.add_(1), 2000), ("h2d_copy_us", lambda: h.to("cuda", non_blocking=True), 500),
                        ("read_back_us", lambda: x[:4].tolist(), 500)):
        op()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


def bare_replays(engine, reps: int = 50) -> dict[str, float]:
    """Synchronized ms of one replay of each captured family's batch-1 graph, on whatever its
    static buffers last held (the run is over: a verification replay rewrites slots nothing
    reads again): the device's own time for a decode step against a verification step."""
    import torch

    worker = engine.executor.driver_worker
    families = {"decode": worker.graphs, **{f"verify_q{q}": g for q, g in worker.verify_graphs.items()}}
    spec = engine.executor.spec_decoder
    if spec is not None and spec.draft_graphs is not None:
        families["draft_decode"] = spec.draft_graphs
    out = {}
    for name, graphs in families.items():
        graph = None if graphs is None else graphs.graphs.get(1)
        if graph is None:
            continue
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / reps * 1e3
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cpu":  # one thread: the host's Python is one thread, and a shared machine's
        torch.set_num_threads(1)  # idle OpenMP workers would spin into every small op's time
    from offline_throughput import build_bench_model

    from kvserve.runtime.model_config import ModelConfig

    model_dir = args.model or build_bench_model(RESULTS / "models" / "llama-50m-gqa4")
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    rng = random.Random(0)
    prompts = []
    for _ in range(args.num_requests):
        passage = [rng.randrange(3, min(vocab, 2000)) for _ in range(48)]
        prompts.append(passage + passage[:24])
    k = args.num_speculative_tokens
    methods = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3},
               "draft-identical": {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}}
    sync = torch.cuda.synchronize if args.device == "cuda" else None
    results, reference = {}, None
    for name in args.methods.split(","):
        engine = make_engine(model_dir, args, methods[name])
        try:
            run(engine, prompts[:1], args)  # warm-up
            timers = Timers(sync)
            instrument(engine, timers)
            outputs, steps = run(engine, prompts, args)
            tokens = sum(len(o) for o in outputs)
            per_step = {label: timers.total[label] * 1e3 / steps for label, _ in ROWS if label in timers.total}
            inner = sum(per_step.get(x, 0.0) for x in ("draft_propose", "prepare", "worker_forward", "draft_mirror"))
            per_step["verify_and_rest"] = per_step["execute_model"] - inner
            if "worker_forward" in per_step:  # on a GPU: the synchronized wait for the device, mostly
                per_step["wait_and_rest"] = per_step["worker_forward"] - sum(
                    per_step.get(x, 0.0) for x in ("pad", "to_device", "replay_or_forward", "logits"))
            top = sum(per_step.get(x, 0.0) for x in ("propose_drafts", "schedule", "execute_model", "finish_step"))
            per_step["engine_rest"] = per_step["step"] - top
            # The device's work (on a GPU: launches and the synchronized wait): the target's forward
            # and logits, the draft's decodes, logits and mirrored steps; the rest is host Python.
            forward = per_step.get("worker_forward", 0.0) - per_step.get("pad", 0.0)
            forward += sum(per_step.get(x, 0.0) for x in ("draft_forward", "draft_logits", "draft_mirror"))
            results[name] = dict(steps=steps, tokens=tokens, tokens_per_step=tokens / steps, ms_per_step=per_step,
                                 host_ms_per_step=per_step["step"] - forward,
                                 draft_decodes_per_step=timers.calls.get("draft_forward", 0) / steps,
                                 verify_replays=engine.executor.driver_worker.verify_graph_replays,
                                 padded_steps=engine.executor.driver_worker.verify_padded_steps,
                                 same_output=reference is None or outputs == reference,
                                 bare_replay_ms=bare_replays(engine) if sync else {})
            reference = reference or outputs
        finally:
            engine.close()

    names = list(results)
    costs = launch_costs() if sync else {}
    if costs:
        print("this machine, per call: " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    print(f"{model_dir} on {args.device}{' (' + torch.cuda.get_device_name() + ')' if sync else ''}, batch 1, "
          f"k={k}, {args.output_len} tokens x {args.num_requests} requests; ms per engine step")
    print(f"{'component':<22}" + "".join(f"{n:>17}" for n in names))
    for label, depth in ROWS:
        if not any(label in results[n]["ms_per_step"] for n in names):
            continue
        cells = "".join(f"{results[n]['ms_per_step'].get(label, float('nan')):>17.3f}" for n in names)
        print(f"{'  ' * depth + label:<22}{cells}")
    for key, fmt in (("host_ms_per_step", "{:>17.3f}"), ("tokens_per_step", "{:>17.2f}"),
                     ("draft_decodes_per_step", "{:>17.2f}"), ("verify_replays", "{:>17}"),
                     ("padded_steps", "{:>17}"), ("same_output", "{!s:>17}")):
        print(f"{key:<22}" + "".join(fmt.format(results[n][key]) for n in names))
    for n in names:
        if results[n]["bare_replay_ms"]:
            print(f"{n}: one synchronized batch-1 replay, ms: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in results[n]["bare_replay_ms"].items()))
    per_token = {n: (results[n]["ms_per_step"]["step"] / results[n]["tokens_per_step"]) for n in names}
    print(f"{'ms per token':<22}" + "".join(f"{per_token[n]:>17.3f}" for n in names))
    record = dict(benchmark="spec_step_host", model=str(model_dir), device=args.device,
                  gpu=torch.cuda.get_device_name() if sync else None, k=k, output_len=args.output_len,
                  num_requests=args.num_requests, results=results, launch_costs=costs, machine=platform.platform(),
                  cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(r["same_output"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
