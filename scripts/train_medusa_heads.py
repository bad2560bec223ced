"""Trains Medusa heads for a model from its own greedy answers, on CPU (testing/spec_heads.py).

    python scripts/train_medusa_heads.py MODEL_DIR OUT_DIR [--heads 3] [--layers 1] [--vocab 8192]
    python scripts/train_medusa_heads.py MODEL_DIR OUT_DIR --extra-topics 253 --epochs 8   # more data

With no arguments: the real SmolLM2 (build/smollm2), cached under build/spec-heads/ (the default
recipe: data about 20-40 minutes on 2 cores, cached and resumable; training 7-25 minutes).
The recipe's knobs are `train`'s (testing/spec_heads.py); training.json records each epoch's
accuracy on the held-out topics.
"""

from __future__ import annotations

import argparse
import json

from kvserve.testing.spec_heads import ensure_medusa_heads, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="HF model directory (default: the real SmolLM2)")
    ap.add_argument("out", nargs="?", help="where the heads go (default: build/spec-heads/...)")
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    ap.add_argument("--vocab", type=int, default=8192, help="truncated vocabulary of the heads")
    ap.add_argument("--questions", type=int, default=960)
    ap.add_argument("--extra-topics", type=int, default=128,
                    help="topics of the extra questions, 4 each (up to 253; 0: the first recipe's 960 questions only)")
    ap.add_argument("--epochs", type=int, default=8, help="at most; the best epoch on held-out topics is kept")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--distill", type=float, default=0.0,
                    help="share of the loss on the target's own distribution of the label")
    args = ap.parse_args()
    if args.model is None:
        from kvserve.testing.realmodel import ensure_smollm2

        print(ensure_medusa_heads(ensure_smollm2().hf_dir, num_heads=args.heads, num_layers=args.layers,
                                  vocab=args.vocab))
        return
    if args.out is None:
        ap.error("OUT_DIR is required with MODEL_DIR")
    print(json.dumps(train(args.model, args.out, num_heads=args.heads, num_layers=args.layers, vocab=args.vocab,
                           questions=args.questions, epochs=args.epochs, extra_topics=args.extra_topics,
                           lr=args.lr, weight_decay=args.weight_decay, dropout=args.dropout,
                           distill=args.distill), indent=2))


if __name__ == "__main__":
    main()
