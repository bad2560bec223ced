"""Speculative decoding: acceptance rate and decode speed, n-gram lookup and draft models.

    python bench/spec_decode.py                       # ~50M random Llama target, greedy, batch 1
    python bench/spec_decode.py --num-requests 16 --concurrency 16   # batched verification
    python bench/spec_decode.py --model DIR --draft DIR --device cuda
    python bench/spec_decode.py --device cuda --eager-too  # + every method with enforce_eager

Runs the same requests (one at a time by default: speculative decoding is a latency tool) without
speculation and with each method, greedy, in interleaved rounds (best round per method), and
checks that every method reproduces the plain output token for token. Methods:

  ngram            prompt lookup (k tokens) on input-grounded prompts (a passage repeated);
  draft-truncated  a draft made of the target's first --draft-layers layers (plus its embedding,
                   final norm and head): a self-speculative draft that shares the tokenizer;
  draft-identical  the target itself as its own draft: every draft is accepted, so this is the
                   mechanism's best case, and its cost over plain decoding is pure overhead.

With random weights the numbers say what the mechanism costs and how acceptance turns into
speed, not what a trained model pair would accept. On CUDA the engines replay CUDA graphs for
decode steps and verification steps (uniform ones, and short n-gram queries padded to 1 + k rows:
docs/runtime.md), and print how many of each; ``--eager-too`` adds each method
(and no speculation) again with ``enforce_eager`` as ``<method>-eager`` rows, to see what the
graphs buy end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

from offline_throughput import build_bench_model  # sibling script: bench/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="target HF model directory (default: ~50M Llama)")
    p.add_argument("--draft", type=Path, default=None, help="a draft model directory (default: truncated target)")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--passage-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--methods", default="ngram,draft-truncated,draft-identical")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests run together in waves of this many (decode time: from a wave's first token to its end)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each method keeps its best")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager-too", action="store_true", help="also run every method with enforce_eager (CUDA graphs off)")
    p.add_argument("--out", type=Path, default=RESULTS / "spec_decode.json")
    return p.parse_args(argv)


def build_truncated_draft(target: Path, path: Path, layers: int) -> Path:
    import shutil

    import transformers

    if (path / "config.json").is_file():
        return path
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target))
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(target):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(target / name, path / name)
    return path


def make_engine(model_dir, args, spec, *, enforce_eager: bool = False):
    from kvserve.runtime import LLMEngine, SamplingParams

    engine = LLMEngine.from_args(model=str(model_dir), device=args.device, kv_cache_memory_bytes=1 << 27,
                                 max_model_len=1024, speculative_config=spec, enable_prefix_caching=False,
                                 enforce_eager=enforce_eager)
    engine.add_request("warmup", [7] * 16, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def run(engine, prompts, args):
    from kvserve.runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    base = engine.get_stats()
    outputs, decode_s, tokens = [], 0.0, 0
    for w in range(0, len(prompts), args.concurrency):
        wave = {}
        for i, prompt in enumerate(prompts[w:w + args.concurrency], start=w):
            engine.add_request(f"r{i}", prompt, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()  # decode speed: from the first token on
                if out.finished:
                    wave[out.request_id] = out.outputs[0].token_ids
        decode_s += time.perf_counter() - first
        for i in range(w, w + len(wave)):
            outputs.append(wave[f"r{i}"])
            tokens += len(wave[f"r{i}"]) - 1
    s = engine.get_stats()
    drafts = s.spec_decode_num_drafts_total - base.spec_decode_num_drafts_total
    draft_tokens = s.spec_decode_num_draft_tokens_total - base.spec_decode_num_draft_tokens_total
    accepted = s.spec_decode_num_accepted_tokens_total - base.spec_decode_num_accepted_tokens_total
    return dict(outputs=outputs, decode_tok_s=tokens / decode_s, drafts=drafts, draft_tokens=draft_tokens,
                accepted=accepted)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or build_bench_model(RESULTS / "models" / "llama-50m-gqa4")
    from kvserve.runtime.model_config import ModelConfig

    mcfg = ModelConfig.from_pretrained(model_dir)
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.num_requests):  # input-grounded: a passage, then the passage again, cut short
        passage = [rng.randrange(4, mcfg.vocab_size) for _ in range(args.passage_len)]
        prompts.append(passage + passage[: args.passage_len // 2])
    k = args.num_speculative_tokens
    methods = {
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
    }
    wanted = args.methods.split(",")
    if "draft-truncated" in wanted:
        draft = args.draft or build_truncated_draft(model_dir, RESULTS / "models" / f"llama-50m-gqa4-first{args.draft_layers}",
                                                    args.draft_layers)
        methods["draft-truncated"] = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    methods["draft-identical"] = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}
    print(f"target {model_dir} ({mcfg.num_layers} layers), {args.device}, {torch.get_num_threads()} threads; "
          f"{args.num_requests} requests, {args.concurrency} at a time, prompt {len(prompts[0])} tokens (a passage + its first "
          f"half), {args.output_len} output tokens, greedy, k={k}", flush=True)

    # Rounds interleave the methods and each keeps its best round, so that load drifting on a
    # shared machine does not favour whichever method happened to run in a quiet moment.
    engines = {"none": make_engine(model_dir, args, None)}
    for name in wanted:
        engines[name] = make_engine(model_dir, args, methods[name])
    if args.eager_too:
        for name in ["none", *wanted]:
            engines[f"{name}-eager"] = make_engine(model_dir, args, methods.get(name), enforce_eager=True)
    try:
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                r = run(engine, prompts, args)
                if name not in best or r["decode_tok_s"] > best[name]["decode_tok_s"]:
                    best[name] = r
        plain = best["none"]
        rows = [(name, best[name], best[name]["outputs"] == plain["outputs"]) for name in engines]

        replays, padded, draft_replays = {}, {}, {}
        if args.device == "cuda":
            replays = {name: e.executor.driver_worker.verify_graph_replays for name, e in engines.items()}
            padded = {name: e.executor.driver_worker.verify_padded_steps for name, e in engines.items()}
            print(f"verification steps replayed from CUDA graphs: {replays}")
            print(f"of which padded (short queries given dummy rows): {padded}")
            draft_replays = {name: getattr(getattr(e.executor.spec_decoder, "draft_graphs", None), "replays", None)
                             for name, e in engines.items()}
            print(f"draft-model decodes replayed from the draft's CUDA graphs: {draft_replays}")
    finally:  # an engine left open keeps the process alive at exit (its threads)
        for engine in engines.values():
            engine.close()
    print(f"\n{'method':<18}{'decode tok/s':>14}{'speedup':>9}{'drafts':>8}{'accept rate':>13}"
          f"{'tokens/step':>13}{'same output':>13}")
    record_rows = []
    for name, r, same in rows:
        rate = r["accepted"] / r["draft_tokens"] if r["draft_tokens"] else float("nan")
        per_step = 1 + r["accepted"] / r["drafts"] if r["drafts"] else 1.0
        speed = r["decode_tok_s"] / plain["decode_tok_s"]
        print(f"{name:<18}{r['decode_tok_s']:>14.1f}{speed:>8.2f}x{r['drafts']:>8}{rate:>13.1%}{per_step:>13.2f}"
              f"{str(same):>13}")
        record_rows.append(dict(method=name, decode_tok_s=r["decode_tok_s"], speedup=speed, drafts=r["drafts"],
                                draft_tokens=r["draft_tokens"], accepted_tokens=r["accepted"],
                                acceptance_rate=rate, tokens_per_verify_step=per_step, same_output=same,
                                verify_graph_replays=replays.get(name), verify_padded_steps=padded.get(name),
                                draft_graph_replays=draft_replays.get(name)))
    record = dict(benchmark="spec_decode", model=str(model_dir), device=args.device, threads=torch.get_num_threads(),
                  k=k, rounds=args.rounds, num_requests=args.num_requests, concurrency=args.concurrency,
                  prompt_len=len(prompts[0]), output_len=args.output_len,
                  rows=record_rows, machine=platform.platform(), cpu_count=os.cpu_count(),
                  date=time.strftime("%Y-%m-%d"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(same for _, _, same in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
