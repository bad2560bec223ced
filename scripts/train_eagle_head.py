"""Trains an EAGLE head for a model from its own greedy answers, on CPU (testing/eagle_heads.py).

    python scripts/train_eagle_head.py MODEL_DIR OUT_DIR [--vocab 2048] [--epochs 2] [--depth 2] [--budget-s S] [--data FILE]

With no arguments: the real SmolLM2 (build/smollm2), cached under build/spec-heads/. The data
(answers and hidden states) are shared with scripts/train_medusa_heads.py's cache.
"""

from __future__ import annotations

import argparse
import json

from kvserve.testing.eagle_heads import ensure_eagle_head, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="HF model directory (default: the real SmolLM2)")
    ap.add_argument("out", nargs="?", help="where the head goes (default: build/spec-heads/...)")
    ap.add_argument("--vocab", type=int, default=2048, help="truncated vocabulary of the head's projection")
    ap.add_argument("--questions", type=int, default=960)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--depth", type=int, default=2, help="draft steps unrolled in training")
    ap.add_argument("--budget-s", type=float, default=None, help="stop training after this many seconds")
    ap.add_argument("--data", default=None, help="a cached dataset file of this model (build/spec-heads/data-*.pt)")
    args = ap.parse_args()
    if args.model is None:
        from kvserve.testing.realmodel import ensure_smollm2

        print(ensure_eagle_head(ensure_smollm2().hf_dir, vocab=args.vocab, depth=args.depth, budget_s=args.budget_s,
                                data=args.data))
        return
    if args.out is None:
        ap.error("OUT_DIR is required with MODEL_DIR")
    print(json.dumps(train(args.model, args.out, vocab=args.vocab, questions=args.questions, epochs=args.epochs,
                           depth=args.depth, budget_s=args.budget_s, data=args.data), indent=2))


if __name__ == "__main__":
    main()
