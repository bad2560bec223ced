"""Can a Medusa candidate tree pay on a CPU? Acceptance of trees vs the chain on held-out answers
of the real SmolLM2, and the cost of a verification step of N decode rows on the native stack.

    python bench/medusa_tree.py                         # heads trained and cached on first use
    python bench/medusa_tree.py --medusa DIR --max-tokens 96

1. Held-out chat questions (bench/spec_heads.py's, never trained on) are answered greedily; the
   target's final hidden state at every answer position comes from transformers.
2. At every position the heads propose from that hidden state, and each tree's greedy acceptance
   is worked out against what the target really generated next (`medusa_tree.accept`): tokens per
   verification step. Positions are averaged uniformly (real decoding visits every accepted
   run's first position only, which weighs hard spots somewhat more).
3. The target runs verification steps of 1 + T decode rows (one per tree node, T + 1 logits rows,
   as `ModelRunner.verify_as_decode_rows` runs a chain) against a context of `--context` tokens;
   the cost is relative to a plain one-row decode (median of `--reps`), plus the heads' top-k.
4. Estimated speed-up = tokens per step / relative step cost. The chain's estimate can be
   checked against bench/spec_heads.py's measured end-to-end ratio.

The engine runs a tree's nodes as decode rows too, each with its ancestor mask (the native
stack skips its siblings' slots), so the rows timed here are what a tree step runs
(bench/spec_heads.py --methods none,medusa,medusa_tree measures the engine end to end).
`--no-timing` prints tokens per step only. Both modes print each head's acceptance: its top-1
and top-3 accuracy at every position, and its top-1 rate given that every head before it was
right (what a chain accepts at that depth).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))


def product_tree(widths) -> list[tuple[int, ...]]:
    """Every path whose rank at depth d is below widths[d]."""
    out = []
    for depth in range(1, len(widths) + 1):
        out += list(itertools.product(*[range(w) for w in widths[:depth]]))
    return out


def budget_tree(depth: int, rank_sum: int, width: int = 4) -> list[tuple[int, ...]]:
    """Every path of at most `depth` ranks below `width` whose ranks add up to at most `rank_sum`
    (mostly top-1 guesses, a few second and third ones)."""
    return [p for p in product_tree([width] * depth) if sum(p) <= rank_sum]


def trees(k: int) -> dict[str, list[tuple[int, ...]]]:
    from spec_heads import DEFAULT_TREE

    from kvserve.runtime.spec_decode.medusa_tree import chain_choices

    out = {f"chain k={k}": list(chain_choices(k)), "spec_heads default": DEFAULT_TREE}
    for widths in ((2,) * k, (3, 2, 1)[:k], (4, 2, 2)[:k], (5, 3, 2, 1)[:k]):
        out["product " + "x".join(map(str, widths))] = product_tree(widths)
    for budget in (1, 2, 3):
        out[f"rank-sum<={budget} d={k}"] = budget_tree(k, budget)
    return {name: c for name, c in out.items() if len(c) < 64}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF directory (default: the real SmolLM2)")
    p.add_argument("--medusa", type=Path, default=None, help="Medusa heads directory (default: trained and cached)")
    p.add_argument("-k", "--depth", type=int, default=3, help="heads the trees use")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--context", type=int, default=200, help="context length of the timed verification steps")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--heldout", type=Path, default=None,
                   help="a held-out data file this script cached before (its name's key may be an older one's)")
    p.add_argument("--no-timing", action="store_true",
                   help="tokens per step only (no step costs: what a loaded machine can still measure)")
    p.add_argument("--out", type=Path, default=RESULTS / "medusa_tree.json")
    return p.parse_args(argv)


def acceptance(heads, hidden: torch.Tensor, tokens: list[list[int]], choices: dict, depth: int) -> dict:
    from kvserve.runtime.spec_decode.medusa_tree import accept, candidate_tokens, tree_layout

    layouts = {name: tree_layout(c) for name, c in choices.items()}
    top_k = max(lay.top_k(h) for lay in layouts.values() for h in range(depth))
    with torch.inference_mode():
        logits = heads(hidden, depth)  # [rows, depth, vocab]
        top = logits.topk(top_k, dim=-1).indices
        if heads.token_map is not None:
            top = heads.token_map[top]
    top = top.tolist()
    totals = {name: 0 for name in layouts}
    count = 0
    r = 0
    hits1, hits3, chain = [0] * depth, [0] * depth, [0] * (depth + 1)
    for seq in tokens:
        # Row r is the hidden state at seq[q] (it gave seq[q + 1]); a step needs seq[q + 2 + depth].
        for q in range(len(seq)):
            if q + 2 + depth < len(seq):
                count += 1
                run = True
                chain[0] += 1
                for h in range(depth):
                    want = seq[q + 2 + h]
                    hits1[h] += top[r][h][0] == want
                    hits3[h] += want in top[r][h][:3]
                    run = run and top[r][h][0] == want
                    chain[h + 1] += run
                for name, lay in layouts.items():
                    cand = candidate_tokens(lay, seq[q + 1], top[r])
                    target = [seq[q + 2 + d] for d in lay.depths]
                    totals[name] += len(accept(lay, cand, target)[1])
            r += 1
    per_head = [{"head": h, "top1": hits1[h] / count, "top3": hits3[h] / count,
                 "top1_given_previous": chain[h + 1] / max(1, chain[h])} for h in range(depth)]
    return {name: {"nodes": layouts[name].num_nodes, "tokens_per_step": totals[name] / count}
            for name in layouts} | {"_positions": count, "_per_head": per_head}


def step_costs(model_dir: Path, heads, node_counts: list[int], context: int, reps: int) -> dict[int, float]:
    """Seconds of a verification step of n decode rows (n logits rows), per n; n = 1 is a decode."""
    import numpy as np

    from kvserve.runtime import LLM
    from kvserve.runtime.attention.backend import AttentionMetadata
    from kvserve.runtime.executor.forward_input import ForwardInput

    with LLM(str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=8) as llm:
        worker = llm.engine.executor.driver_worker
        bs = worker.config.block_size
        blocks = -(-(context + 64) // bs)
        table = list(range(blocks))
        out = {}
        for n in sorted(set(node_counts)):
            tables = np.tile(np.asarray(table, dtype=np.int32), (n, 1))
            pos = [context + j for j in range(n)]
            step = ForwardInput(
                input_ids=torch.full((n,), 100, dtype=torch.long), positions=torch.tensor(pos),
                meta=AttentionMetadata(
                    query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                    seq_lens=torch.tensor([p + 1 for p in pos], dtype=torch.int32),
                    block_tables=torch.from_numpy(tables), slot_mapping=torch.tensor(pos),
                    max_query_len=1, max_seq_len=max(pos) + 1, is_decode_only=True),
                logits_rows=list(range(n)))
            for _ in range(3):
                worker.execute_model(step)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                logits = worker.execute_model(step)
                logits.argmax(-1).tolist()
                times.append(time.perf_counter() - t0)
            out[n] = statistics.median(times)
        hidden = torch.randn(1, heads.hidden_size)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            with torch.inference_mode():
                heads(hidden, heads.num_heads).topk(5, dim=-1)
            times.append(time.perf_counter() - t0)
        out["heads"] = statistics.median(times)
        return out


def main(argv=None) -> None:
    args = parse_args(argv)
    from spec_heads import HELD_OUT_TOPICS, QUESTIONS

    from kvserve.runtime.spec_decode.medusa import load_medusa_heads
    from kvserve.testing.spec_heads import dataset, ensure_medusa_heads

    model = args.model
    if model is None:
        from kvserve.testing.realmodel import ensure_smollm2

        model = ensure_smollm2().hf_dir
    medusa = args.medusa or ensure_medusa_heads(model)
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = load_medusa_heads(medusa, hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
                              dtype=torch.float32, device=torch.device("cpu"))
    questions = [q.format(t=t) for t in HELD_OUT_TOPICS for q in QUESTIONS]
    t0 = time.perf_counter()
    hidden, tokens = dataset(model, questions, args.max_tokens, kind="heldout", cache=args.heldout)
    print(f"{len(questions)} held-out answers, {hidden.shape[0]} positions ({time.perf_counter() - t0:.0f} s)")

    choices = trees(args.depth)
    acc = acceptance(heads, hidden, tokens, choices, args.depth)
    positions = acc.pop("_positions")
    per_head = acc.pop("_per_head")
    print(f"\n{'head':>4} {'top-1':>6} {'top-3':>6} {'top-1 | heads before right':>26}")
    for row in per_head:
        print(f"{row['head']:>4} {row['top1']:>6.3f} {row['top3']:>6.3f} {row['top1_given_previous']:>26.3f}")
    rows = []
    if args.no_timing:
        print(f"\n{'tree':<22} {'nodes':>5} {'tokens/step':>11}")
        for name, a in acc.items():
            print(f"{name:<22} {a['nodes']:>5} {a['tokens_per_step']:>11.3f}")
            rows.append({"tree": name, "choices": [list(c) for c in choices[name]], "nodes": a["nodes"],
                         "tokens_per_step": a["tokens_per_step"]})
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"bench": "medusa_tree", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "medusa": str(medusa), "positions": positions, "per_head": per_head,
                                        "trees": rows}, indent=2) + "\n")
        return
    # A chain of k runs 1 + k rows; a tree of T choices runs 1 + T.
    costs = step_costs(Path(model), heads, [1] + [a["nodes"] for a in acc.values()], args.context, args.reps)
    decode = costs[1]
    print(f"\nheads {medusa}\nverification against a {args.context}-token context; decode {decode * 1e3:.2f} ms, "
          f"heads {costs['heads'] * 1e3:.2f} ms\n")
    print(f"{'tree':<22} {'nodes':>5} {'tokens/step':>11} {'step cost':>9} {'est. speed-up':>13}")
    for name, a in acc.items():
        cost = (costs[a["nodes"]] + costs["heads"]) / decode
        row = {"tree": name, "choices": [list(c) for c in choices[name]], "nodes": a["nodes"],
               "tokens_per_step": a["tokens_per_step"], "step_cost_vs_decode": cost,
               "estimated_speedup": a["tokens_per_step"] / cost}
        rows.append(row)
        print(f"{name:<22} {a['nodes']:>5} {a['tokens_per_step']:>11.3f} {cost:>8.2f}x {row['estimated_speedup']:>12.2f}x")
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = " ".join(f for f in line.split()[2:] if f.startswith(("avx", "fma", "amx")))
                break
    result = {"bench": "medusa_tree", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"cpu_flags": flags, "cores": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "model": str(model), "medusa": str(medusa), "held_out_questions": len(questions),
              "positions": positions, "per_head": per_head, "context": args.context, "decode_s": decode,
              "heads_s": costs["heads"],
              "rows_cost_s": {str(k): v for k, v in costs.items() if k != "heads"}, "trees": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
