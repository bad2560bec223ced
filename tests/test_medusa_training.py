"""The Medusa trainer's recipe (testing/spec_heads.py): labels, the truncated vocabulary, the
held-out metrics it selects epochs by, and a whole run on a tiny Llama's own answers. How well the
recipe generalizes is measured on the real SmolLM2 (bench/medusa_tree.py, docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest
import torch


def test_labels_are_the_tokens_two_and_more_places_ahead():
    from kvserve.testing.spec_heads import _labels

    labels, seq_of = _labels([[10, 11, 12, 13], [20, 21]], num_heads=2)
    assert labels.tolist() == [[12, 13], [13, -1], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert seq_of.tolist() == [0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("counts, vocab, want", [
    ([0, 0, 5, 0, 1, 0, 0, 9], 4, [0, 2, 4, 7]),       # every used token, then the lowest free id
    ([0, 0, 5, 0, 1, 0, 0, 9], 2, [2, 7]),             # more used than rows: the most used
    ([3, 0, 0, 0], 3, [0, 1, 2]),
], ids=["fill", "most-used", "fill-from-zero"])
def test_truncated_vocabulary(counts, vocab, want):
    from kvserve.testing.spec_heads import truncated_vocab

    assert truncated_vocab(torch.tensor(counts), vocab).tolist() == want


def test_chain_metrics_count_a_label_outside_the_vocabulary_as_a_miss():
    from kvserve.testing.spec_heads import chain_metrics

    # 3 rows, 2 heads, vocab 4. Row 2's head-1 label is outside the vocabulary (4): a miss.
    logits = torch.full((3, 2, 4), -1.0)
    for r, h, tok in [(0, 0, 1), (0, 1, 2), (1, 0, 3), (1, 1, 0), (2, 0, 1), (2, 1, 1)]:
        logits[r, h, tok] = 1.0
    logits[1, 1, 3] = 0.5  # row 1 head 1: label 3 is its second guess
    target = torch.tensor([[1, 2], [3, 3], [1, 4]])
    m = chain_metrics(logits, target)
    assert m["top1"] == pytest.approx([1.0, 1 / 3])
    assert m["top3"] == pytest.approx([1.0, 2 / 3])
    assert m["chain_tokens_per_step"] == pytest.approx(1 + 1.0 + 1 / 3)
    # A row without a label for some head leaves the chain's rate and that head's count.
    m = chain_metrics(logits, torch.tensor([[1, 2], [3, -1], [1, 4]]))
    assert m["top1"] == pytest.approx([1.0, 0.5]) and m["chain_tokens_per_step"] == pytest.approx(2.5)


def test_training_on_a_tiny_models_answers_keeps_the_best_held_out_epoch(tiny_llama, tmp_path, monkeypatch):
    from kvserve.runtime.spec_decode.medusa import load_medusa_heads
    from kvserve.testing import spec_heads

    monkeypatch.setattr(spec_heads, "REPO_ROOT", tmp_path)  # the data cache goes under tmp_path/build
    report = spec_heads.train(tiny_llama, tmp_path / "heads", vocab=64, questions=20, max_tokens=12, epochs=3,
                              extra_topics=0, held_topics=0.2, log=lambda *_: None)
    assert report["recipe"] == spec_heads.RECIPE and report["truncated_vocab"] == 64
    assert len(report["held_out_topics"]) == 4 and report["held_out_rows"] > 0
    assert 1 <= report["best_epoch"] <= len(report["history"]) <= 3
    best = report["history"][report["best_epoch"] - 1]
    assert best["chain_tokens_per_step"] == max(h["chain_tokens_per_step"] for h in report["history"])
    assert report["held_out_top1_accuracy_per_head"] == best["top1"]
    assert list((tmp_path / "build" / "spec-heads").glob("data-*.pt"))
    saved = json.loads((tmp_path / "heads" / "training.json").read_text())
    assert saved["best_epoch"] == report["best_epoch"] and saved["finished"]
    heads = load_medusa_heads(tmp_path / "heads", hidden_size=64, vocab_size=512, dtype=torch.float32,
                              device=torch.device("cpu"))
    assert heads.num_heads == 3 and heads.token_map.numel() == 64 and heads.share_projection_if_equal()
