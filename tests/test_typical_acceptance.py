"""Typical acceptance (Medusa's rule, vLLM's typical_acceptance_sampler names): which drafts it
accepts, checked against the rule computed independently in float64 over many random
distributions, and the token drawn after the accepted drafts, checked against the target's
distribution. Not distribution-preserving by design (docs/prefix-caching-and-speculative-decoding.md)."""

from __future__ import annotations

import math

import torch

from kvserve.runtime.spec_decode.typical import acceptable, typical_chain


def _bar(p: torch.Tensor, threshold: float, alpha: float) -> float:
    p = p.double()
    entropy = -sum(float(x) * math.log(float(x)) for x in p if x > 0)
    return min(threshold, alpha * math.exp(-entropy))


def test_only_tokens_above_the_bar_are_accepted():
    gen = torch.Generator().manual_seed(0)
    checked = accepted = 0
    for trial in range(300):
        vocab = 8 + trial % 40
        # Peaked and flat distributions alike (Dirichlet concentration from 0.05 to 2).
        conc = 0.05 + (trial % 7) * 0.3
        probs = torch.distributions.Dirichlet(torch.full((vocab,), conc)).sample((4,))
        drafts = torch.randint(0, vocab, (4,), generator=gen).tolist()
        threshold, alpha = (0.09, 0.3) if trial % 2 else (0.2, 0.5)
        ok = acceptable(probs, drafts, threshold, alpha)
        for row, d, got in zip(probs, drafts, ok):
            want = float(row[d]) > _bar(row, threshold, alpha)
            assert got == want, (row, d)
            checked += 1
            accepted += got
        # A chain stops at its first failing draft; what it keeps all passed.
        out = typical_chain(torch.cat([probs, probs[:1]]), drafts, threshold, alpha, gen)
        kept = out[:-1]
        assert kept == drafts[:len(kept)] and all(ok[:len(kept)])
        assert len(kept) == len(drafts) or not ok[len(kept)]
    assert 0 < accepted < checked  # both outcomes were exercised


def test_the_token_after_the_accepted_drafts_follows_the_target():
    """Every draft fails (probability 0 under the target), so each call draws its one token from
    probs[0]: the counts match that distribution (chi-square, p > 0.001 at 4 degrees of freedom)."""
    gen = torch.Generator().manual_seed(1)
    target = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])
    probs = torch.stack([target, target])
    n = 4000
    counts = torch.zeros(6)
    for _ in range(n):
        out = typical_chain(probs, [5], 0.09, 0.3, gen)
        assert len(out) == 1
        counts[out[0]] += 1
    assert counts[5] == 0
    expected = target[:5] * n
    chi2 = float(((counts[:5] - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, counts


def test_a_certain_draft_is_always_accepted_and_an_impossible_one_never():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    # Zero entropy: the bar is min(threshold, alpha) and p = 1 passes it.
    assert acceptable(probs, [1, 2, 0], 0.09, 0.3) == [True, False, True]
    assert typical_chain(probs, [1, 2], 0.09, 0.3, torch.Generator().manual_seed(0))[0] == 1
