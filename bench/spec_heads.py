"""Speculative heads on the real SmolLM2: tokens/s at batch 1 and batch 8, against no speculation
and n-gram lookup, with the mean acceptance length.

    python bench/spec_heads.py                    # trains the Medusa heads on first use (minutes)
    python bench/spec_heads.py --methods none,ngram,medusa --batches 1,8 --rounds 2
    python bench/spec_heads.py --methods none,ngram,eagle   # EAGLE head trained on first use
    python bench/spec_heads.py --methods none,eagle,eagle_tree --batches 1,8
    python bench/spec_heads.py --methods none,medusa,medusa_tree --tree "[(0,), (1,), (0, 0)]"

Chat questions the heads were not trained on, greedy, `--max-tokens` each. Batch 1 runs them one
at a time; batch 8 runs them eight at once. Methods run in interleaved rounds and keep their best
round; every method must reproduce the plain greedy text exactly (checked). The acceptance length
is tokens per verification step: 1 + accepted drafts / verifications. `medusa_tree` is Medusa
with `--tree` as its speculative_token_tree (its draft acceptance rate counts every node as a draft);
`eagle_tree` is the EAGLE head drafting that tree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

HELD_OUT_TOPICS = ("glaciers", "the printing press", "owls", "tea", "bridges", "jazz", "the Sahara",
                   "octopuses", "windmills", "the Olympic games", "lighthouses", "tomatoes", "comets",
                   "the violin", "submarines", "wolves")
# Depth 3: the top-1 chain, the second and third guesses of head 0, and one second guess below.
DEFAULT_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
QUESTIONS = ("Explain {t} to a child in a few sentences.", "Write three short facts about {t}.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF directory (default: the real SmolLM2)")
    p.add_argument("--medusa", type=Path, default=None, help="Medusa heads directory (default: trained and cached)")
    p.add_argument("--eagle", type=Path, default=None, help="EAGLE head directory (default: trained and cached)")
    p.add_argument("--methods", default="none,ngram,medusa")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tree", default=str(DEFAULT_TREE), help="speculative_token_tree of method medusa_tree")
    p.add_argument("--out", type=Path, default=RESULTS / "spec_heads.json")
    return p.parse_args(argv)


def spec_config(method: str, k: int, medusa: Path | None, eagle: Path | None = None, tree: str | None = None
                ) -> dict | None:
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    if method == "medusa":
        return {"method": "medusa", "model": str(medusa), "num_speculative_tokens": k}
    if method == "medusa_tree":
        return {"method": "medusa", "model": str(medusa), "speculative_token_tree": tree or str(DEFAULT_TREE)}
    if method == "eagle":
        return {"method": "eagle", "model": str(eagle), "num_speculative_tokens": k}
    if method == "eagle_tree":
        return {"method": "eagle", "model": str(eagle), "speculative_token_tree": tree or str(DEFAULT_TREE)}
    raise SystemExit(f"unknown method {method!r}")


def run(llm, questions: list[str], batch: int, max_tokens: int):
    from kvserve.runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    before = llm.engine.get_stats()
    texts, tokens = [], 0
    start = time.perf_counter()
    for i in range(0, len(questions), batch):
        outs = llm.chat([[{"role": "user", "content": q}] for q in questions[i:i + batch]], params, use_tqdm=False)
        texts += [o.outputs[0].text for o in outs]
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = time.perf_counter() - start
    after = llm.engine.get_stats()
    drafts = after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
    accepted = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    proposed = after.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "texts": texts,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "draft_acceptance_rate": accepted / proposed if proposed else None}


def main(argv=None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()
    from kvserve.runtime import LLM

    model = args.model
    if model is None:
        from kvserve.testing.realmodel import ensure_smollm2

        model = ensure_smollm2().hf_dir
    methods = args.methods.split(",")
    medusa = args.medusa
    if {"medusa", "medusa_tree"} & set(methods) and medusa is None:
        from kvserve.testing.spec_heads import ensure_medusa_heads

        medusa = ensure_medusa_heads(model)
    eagle = args.eagle
    if {"eagle", "eagle_tree"} & set(methods) and eagle is None:
        from kvserve.testing.eagle_heads import ensure_eagle_head

        eagle = ensure_eagle_head(model)
    questions = [q.format(t=t) for t in HELD_OUT_TOPICS for q in QUESTIONS][:args.requests]
    batches = [int(b) for b in args.batches.split(",")]
    engines = {m: LLM(str(model), dtype="float32", max_model_len=1024, max_num_seqs=max(batches),
                      speculative_config=spec_config(m, args.num_speculative_tokens, medusa, eagle, args.tree))
               for m in methods}
    best: dict[tuple[str, int], dict] = {}
    for r in range(args.rounds):
        for batch in batches:
            for m in methods:
                result = run(engines[m], questions, batch, args.max_tokens)
                key = (m, batch)
                if key not in best or result["tokens_per_s"] > best[key]["tokens_per_s"]:
                    best[key] = result
                print(f"round {r + 1} batch {batch} {m}: {result['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    for llm in engines.values():
        llm.close()
    rows = []
    for batch in batches:
        plain = best.get(("none", batch))
        for m in methods:
            res = best[(m, batch)]
            # None (shown "-"): `none` was not among the methods, so nothing was compared.
            same = None if plain is None else res["texts"] == plain["texts"]
            rows.append({"batch": batch, "method": m, "tokens_per_s": res["tokens_per_s"],
                         "speedup": res["tokens_per_s"] / plain["tokens_per_s"] if plain else None,
                         "acceptance_length": res["acceptance_length"],
                         "draft_acceptance_rate": res["draft_acceptance_rate"], "same_text_as_plain": same})
    print(f"\n{'batch':>5} | {'method':<11} | {'tok/s':>7} | {'vs none':>7} | {'accept len':>10} | "
          f"{'draft acc':>9} | same text")
    for row in rows:
        al = f"{row['acceptance_length']:.2f}" if row["acceptance_length"] else "-"
        ar = f"{row['draft_acceptance_rate']:.2f}" if row["draft_acceptance_rate"] is not None else "-"
        sp = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
        print(f"{row['batch']:>5} | {row['method']:<11} | {row['tokens_per_s']:>7.1f} | {sp:>7} | {al:>10} | "
              f"{ar:>9} | {'-' if row['same_text_as_plain'] is None else row['same_text_as_plain']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    training = json.loads((medusa / "training.json").read_text()) if medusa and (medusa / "training.json").is_file() else None
    args.out.write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "model": str(model),
        "medusa": str(medusa) if medusa else None, "medusa_training": training,
        "eagle": str(eagle) if eagle else None,
        "eagle_training": json.loads((eagle / "training.json").read_text())
        if eagle and (eagle / "training.json").is_file() else None, "requests": len(questions),
        "max_tokens": args.max_tokens, "k": args.num_speculative_tokens, "rounds": args.rounds,
        "tree": args.tree if {"medusa_tree", "eagle_tree"} & set(methods) else None,
        "load_average": [load_before, os.getloadavg()],
        "rows": rows,
    }, indent=2) + "\n")
    if any(row["same_text_as_plain"] is False for row in rows):
        raise SystemExit("a method changed the greedy text")


if __name__ == "__main__":
    main()
