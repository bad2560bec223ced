"""MTP drafting: chain vs tree on a tiny DeepSeek-V3 with a "copying" MTP layer (drafts get accepted
when the model repeats itself), end to end through LLMEngine.

What it can show: acceptance length (tokens per verification step), the drafter's share of the
step, and tokens/s against no speculation, for `num_speculative_tokens` chains and for a
`speculative_token_tree`. What it cannot: speed on a real MTP checkpoint (DeepSeek-V3/R1 are 671B);
the tiny model's forward is overhead-bound, so ratios say more about per-step overheads than
about a large model. Every method's greedy tokens must equal plain greedy's (checked).

    python bench/mtp_tree.py --batches 1,8 --requests 8 --max-tokens 48 --rounds 3

(hidden 64: the tests' tiny DeepSeek-V3, whose greedy text loops, so the copying layer is accepted)
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DEFAULT_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short phrase (the copying layer's drafts get accepted on those)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, 512) for _ in range(rng.randrange(4, 10))]
        out.append((base * 6)[:rng.randrange(24, 48)])
    return out


def spec_config(method: str, k: int, tree):
    if method == "none":
        return None
    if method == "mtp_chain":
        return {"method": "mtp", "num_speculative_tokens": k}
    return {"method": "mtp", "speculative_token_tree": tree}


def run(engine, batch_prompts, params):
    from kvserve.runtime import SamplingParams  # noqa: F401  (params is one)

    spent = [0.0]
    prop = getattr(engine.spec_decoder, "eagle", None) if engine.spec_decoder is not None else None
    if prop is not None:
        real = prop.step

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t

        prop.step = timed
    before = engine.get_stats()
    t0 = time.perf_counter()
    for i, p in enumerate(batch_prompts):
        engine.add_request(f"q{i}-{t0}", p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id.split("-")[0]] = o.outputs[0].token_ids
    wall = time.perf_counter() - t0
    if prop is not None:
        prop.step = real
    after = engine.get_stats()
    drafts = after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
    accepted = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    tokens = sum(len(v) for v in outs.values())
    return outs, {"tok_s": tokens / wall, "wall_s": wall, "draft_share": spent[0] / wall,
                  "acceptance_length": 1 + accepted / drafts if drafts else None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="none,mtp_chain,mtp_tree")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    p.add_argument("--tree", default=json.dumps(DEFAULT_TREE))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS / "mtp_tree.json")
    args = p.parse_args(argv)

    import torch

    from kvserve.runtime import LLMEngine, SamplingParams
    from kvserve.testing.mtp_layers import add_mtp_layer
    from kvserve.testing.tinymodels import build_tiny_model

    torch.set_num_threads(1)
    tree = json.loads(args.tree)
    methods = args.methods.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    qs = prompts(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_model(Path(tmp) / "dsv3", "deepseek_v3", hidden_size=args.hidden_size,
                                intermediate_size=2 * args.hidden_size)
        model = add_mtp_layer(base, Path(tmp) / "dsv3-mtp", copy=True)
        engines = {m: LLMEngine.from_args(model=str(model), speculative_config=spec_config(
            m, args.num_speculative_tokens, tree), block_size=16, num_kv_blocks=512, max_model_len=256,
            max_num_seqs=max(batches), enable_prefix_caching=False) for m in methods}
        best: dict[tuple[int, str], dict] = {}
        texts: dict[tuple[int, str], dict] = {}
        for _ in range(args.rounds):
            for b in batches:
                for m in methods:  # interleaved within the round
                    got = {}
                    runs = []
                    for s in range(0, len(qs), b):
                        outs, res = run(engines[m], qs[s:s + b], params)
                        got.update({f"{s}-{k}": v for k, v in outs.items()})
                        runs.append(res)
                    wall = sum(r["wall_s"] for r in runs)
                    tok = sum(r["tok_s"] * r["wall_s"] for r in runs)
                    acc = [r["acceptance_length"] for r in runs if r["acceptance_length"]]
                    res = {"tok_s": tok / wall, "draft_share": sum(r["draft_share"] * r["wall_s"] for r in runs) / wall,
                           "acceptance_length": sum(acc) / len(acc) if acc else None}
                    texts[(b, m)] = got
                    if (b, m) not in best or res["tok_s"] > best[(b, m)]["tok_s"]:
                        best[(b, m)] = res
        for e in engines.values():
            e.close()
    rows = []
    print(f"\n{'batch':>5} | {'method':<9} | {'tok/s':>7} | {'vs none':>7} | {'accept len':>10} | {'draft share':>11}")
    for b in batches:
        for m in methods:
            r = best[(b, m)]
            same = texts[(b, m)] == texts[(b, methods[0])]
            ref = best.get((b, "none"), r)["tok_s"]
            al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
            print(f"{b:>5} | {m:<9} | {r['tok_s']:7.1f} | {r['tok_s'] / ref:6.2f}x | {al:>10} | "
                  f"{r['draft_share']:10.0%} {'' if same else ' TEXT DIFFERS'}")
            rows.append({"batch": b, "method": m, **r, "same_text_as_first_method": same})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "tree": tree, "k": args.num_speculative_tokens,
                                    "requests": len(qs), "max_tokens": args.max_tokens,
                                    "hidden_size": args.hidden_size, "rounds": args.rounds}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
