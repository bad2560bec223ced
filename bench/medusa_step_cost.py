"""What a Medusa verification step costs on this machine, against a plain decode step: the top-1
chain (1 + k decode rows per sequence, the native CPU stack) and a candidate tree (1 + T rows per
sequence: decode rows with per-row tree masks on the native stack, as the engine runs it; and,
as `tree_per_op`, the per-op path with the tree mask that models the stack cannot take use), at
batch 1 and 8.

    python bench/medusa_step_cost.py                       # SmolLM2, k = 3, spec_heads' default tree
    python bench/medusa_step_cost.py --accept bench/results/spec_heads.json
    python bench/medusa_step_cost.py --device cuda         # eager vs CUDA graphs (a random model)

With ``--device cuda`` each step kind runs eagerly and replayed from CUDA graphs (the decode graph
the engine captured at start, and verification graphs of the chain's 1 + k and the tree's rows,
runtime/executor/verify_graphs.py), interleaved, and the table adds the eager/graphs ratio. There
the chain is what a GPU runs, one query of 1 + k rows per sequence (no decode rows), there is
no tree_per_op, and `chain_short` is a chain step of shorter queries (2 and 1 rows, what n-gram
lookup often offers): eagerly as it is, with graphs padded to 1 + k rows per sequence. Without
``--model`` it builds bench/gpu_fastpath.py's random Qwen2-0.5B-shaped model (bfloat16; no hub
access needed), or ``--model tiny`` for bench/offline_throughput.py's ~50M random Llama.

The step kinds run interleaved, `--reps` times each, and the table reports each kind's
minimum and median: on a shared, loaded machine the minimum is the closest to an uncontended run.
With `--accept` (bench/spec_heads.py's JSON), each method's measured acceptance length (tokens per
verification step) divided by its relative step cost gives an estimated speed-up over plain
decoding that does not depend on how loaded the machine was during the end-to-end run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="HF directory (default: the real SmolLM2 on cpu, a random 0.5B model on cuda; 'tiny': ~50M)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--tree", default=None, help="speculative_token_tree (default: bench/spec_heads.py's)")
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--accept", type=Path, default=None, help="bench/spec_heads.py's JSON (acceptance lengths)")
    p.add_argument("--out", type=Path, default=RESULTS / "medusa_step_cost.json")
    return p.parse_args(argv)


def step(batch: int, rows: int, context: int, bs: int, tree=None, chain_query: bool = False):
    """A ForwardInput of `batch` sequences with `rows` new rows each after `context` cached tokens:
    decode rows (tree None), one tree of `rows` nodes (its depths and masks), or with chain_query
    one causal query of `rows` tokens (a chain's verification as a GPU runs it)."""
    if chain_query:
        from kvserve.runtime.spec_decode.medusa_tree import chain_choices, tree_layout

        out = step(batch, rows, context, bs, tree_layout(chain_choices(rows - 1)))
        out.meta.tree_masks = None
        return out
    from kvserve.runtime.attention.backend import AttentionMetadata
    from kvserve.runtime.executor.forward_input import ForwardInput

    per = -(-(context + rows) // bs)
    tables = [list(range(b * per, (b + 1) * per)) for b in range(batch)]
    ids, pos, slots, qsl, lens, bt, masks = [], [], [], [0], [], [], []
    for table in tables:
        for j in range(rows):
            p = context + (j if tree is None else tree.depths[j])
            s = context + j
            ids.append(100 + j)
            pos.append(p)
            slots.append(table[s // bs] * bs + s % bs)
            if tree is None:
                qsl.append(qsl[-1] + 1)
                lens.append(s + 1)
                bt.append(table)
            else:
                masks.append(tree.masks[j])
        if tree is not None:
            qsl.append(qsl[-1] + rows)
            lens.append(context + rows)
            bt.append(table)
    meta = AttentionMetadata(query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             block_tables=torch.from_numpy(np.asarray(bt, dtype=np.int32)),
                             slot_mapping=torch.tensor(slots), max_query_len=1 if tree is None else rows,
                             max_seq_len=max(lens), is_decode_only=tree is None,
                             tree_masks=None if tree is None else torch.tensor(masks, dtype=torch.int64))
    return ForwardInput(torch.tensor(ids), torch.tensor(pos), meta, list(range(len(ids))))


def short_chain_step(batch: int, k: int, context: int, bs: int):
    """A chain verification step whose queries are shorter than 1 + k (what n-gram lookup often
    proposes): sequences alternate 2 rows (one draft) and 1 row (none). On a GPU with graphs the
    worker pads each query to 1 + k rows (runtime/executor/verify_padding.py); eagerly it runs
    as it is."""
    from kvserve.runtime.attention.backend import AttentionMetadata
    from kvserve.runtime.executor.forward_input import ForwardInput

    rows = [2 if i % 2 == 0 else 1 for i in range(batch)]
    per = -(-(context + 1 + k) // bs)
    ids, pos, slots, qsl, lens, bt = [], [], [], [0], [], []
    for b, n in enumerate(rows):
        table = list(range(b * per, (b + 1) * per))
        for j in range(n):
            p = context + j
            ids.append(100 + j)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + n)
        lens.append(context + n)
        bt.append(table)
    meta = AttentionMetadata(query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             block_tables=torch.from_numpy(np.asarray(bt, dtype=np.int32)),
                             slot_mapping=torch.tensor(slots), max_query_len=max(rows), max_seq_len=max(lens))
    return ForwardInput(torch.tensor(ids), torch.tensor(pos), meta, list(range(len(ids))))


def main(argv=None) -> None:
    args = parse_args(argv)
    from spec_heads import DEFAULT_TREE

    from kvserve.runtime import LLM
    from kvserve.runtime.spec_decode.config import _tree
    from kvserve.runtime.spec_decode.medusa_tree import tree_layout

    cuda = args.device == "cuda"
    model = args.model
    if str(model) == "tiny":
        from offline_throughput import build_bench_model

        model = build_bench_model(RESULTS / "models" / "llama-50m-gqa4")
    elif model is None and cuda:  # the GPU machine has no SmolLM2 (and no hub)
        from gpu_fastpath import build_model

        model = build_model(RESULTS / "models" / "qwen2-0.5b-random")
    elif model is None:
        from kvserve.testing.realmodel import ensure_smollm2

        model = ensure_smollm2().hf_dir
    tree = tree_layout(_tree(args.tree or str(DEFAULT_TREE), "medusa"))
    batches = [int(b) for b in args.batches.split(",")]
    load_before = os.getloadavg()
    kinds = {"decode": (1, None), "chain": (1 + args.k, None), "tree": (tree.num_nodes, tree),
             "tree_per_op": (tree.num_nodes, tree)}
    if cuda:
        del kinds["tree_per_op"]  # the native CPU stack's alternative
        kinds["chain_short"] = (2, None)  # padded to 1 + k rows for the graph
    modes = ["eager", "graphs"] if cuda else ["eager"]
    times: dict[tuple[str, int, str], list[float]] = {}
    opts = dict(dtype="bfloat16", device="cuda") if cuda else dict(dtype="float32")
    with LLM(str(model), max_model_len=1024, max_num_seqs=max(batches), num_kv_blocks=max(batches) * 16,
             **opts) as llm:
        worker = llm.engine.executor.driver_worker
        bs = worker.config.block_size
        steps = {(name, b): (short_chain_step(b, args.k, args.context, bs) if name == "chain_short" else
                             step(b, rows, args.context, bs, t, chain_query=cuda and name == "chain"))
                 for name, (rows, t) in kinds.items() for b in batches}
        graphs = {"eager": (None, {})}
        if cuda:
            decode = worker.graphs
            if decode is None:
                raise SystemExit("the engine captured no decode graphs (see its log)")
            verify = {}
            for q, t in ((1 + args.k, False), (tree.num_nodes, True)):
                g = worker.build_graphs(decode.sizes, max_model_len=llm.engine.max_model_len, capture=True,
                                        query_len=q, tree=t, pool=decode.pool)
                if g is None:
                    raise SystemExit(f"capturing the {q}-row verification graphs failed (see the log)")
                verify[q] = g
            graphs["graphs"] = (decode, verify)
        for mode in modes:  # warm-up (the native stack is built at the first decode step)
            worker.graphs, worker.verify_graphs = graphs[mode]
            for s in steps.values():
                worker.execute_model(s)
        stack = getattr(worker.model, "_native_stack", None)  # CausalLM's, built by the warm-up
        takes_trees = getattr(stack, "takes_trees", None)
        if takes_trees is None:
            stack = None
        for _ in range(args.reps):
            for key, s in steps.items():
                for mode in modes:
                    worker.graphs, worker.verify_graphs = graphs[mode]
                    if stack is not None:
                        stack.takes_trees = takes_trees and key[0] != "tree_per_op"
                    t0 = time.perf_counter()
                    worker.execute_model(s).argmax(-1).tolist()
                    times.setdefault((*key, mode), []).append(time.perf_counter() - t0)
        if cuda:
            replays = {"decode": graphs["graphs"][0].replays,
                       **{f"verify_q{q}": g.replays for q, g in graphs["graphs"][1].items()}}
            print(f"graph replays: {replays}; padded steps (chain_short): {worker.verify_padded_steps}")
        if stack is not None:
            stack.takes_trees = takes_trees
        worker.graphs, worker.verify_graphs = graphs[modes[-1]]
    accept = {}
    if args.accept is not None:
        for row in json.loads(args.accept.read_text())["rows"]:
            accept[(row["method"], row["batch"])] = row["acceptance_length"]
    rows = []
    best = modes[-1]  # the engine's own choice: graphs on a GPU
    print(f"{model} on {args.device}{' (' + torch.cuda.get_device_name() + ')' if cuda else ''}, "
          f"context {args.context}, k = {args.k}, tree of {tree.num_nodes} nodes")
    print(f"{'batch':>5} | {'step':<11} | {'rows':>4} | {'min ms':>7} | {'median ms':>9} | {'vs decode (min)':>15} | "
          f"{'tokens/step':>11} | {'est. vs none':>12}" + (f" | {'eager min ms':>12} | {'eager/graphs':>12}" if cuda else ""))
    for b in batches:
        base = min(times[("decode", b, best)])
        for name, (n, _) in kinds.items():
            t = times[(name, b, best)]
            rel = min(t) / base
            tps = 1.0 if name == "decode" else accept.get(("medusa" if name == "chain" else "medusa_tree", b))
            est = tps / rel if tps else None
            row = {"batch": b, "step": name, "rows_per_seq": n, "min_s": min(t), "median_s": statistics.median(t),
                   "cost_vs_decode": rel, "tokens_per_step": tps, "estimated_speedup": est}
            line = (f"{b:>5} | {name:<11} | {n:>4} | {min(t) * 1e3:>7.2f} | {statistics.median(t) * 1e3:>9.2f} | "
                    f"{rel:>14.2f}x | {f'{tps:.2f}' if tps else '-':>11} | {f'{est:.2f}x' if est else '-':>12}")
            if cuda:
                e = times[(name, b, "eager")]
                row.update(eager_min_s=min(e), eager_median_s=statistics.median(e),
                           eager_vs_graphs=min(e) / min(t))
                line += f" | {min(e) * 1e3:>12.2f} | {min(e) / min(t):>11.2f}x"
            rows.append(row)
            print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "medusa_step_cost", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                    "model": str(model), "device": args.device,
                                    "gpu": torch.cuda.get_device_name() if cuda else None,
                                    "context": args.context, "k": args.k,
                                    "tree": [list(c) for c in tree.choices], "reps": args.reps,
                                    "load_average": [load_before, os.getloadavg()], "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
