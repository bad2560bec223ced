"""Medusa's typical acceptance for sampled (non-greedy) requests: a draft token is accepted when
the target gives it a probability above min(posterior_threshold, posterior_alpha * exp(-H)), H
the entropy of the target's distribution at that place (vLLM's typical acceptance sampler names).

This is NOT distribution-preserving: unlike rejection sampling it keeps any token the target finds
plausible enough, so the output is a different (lower-entropy) distribution than sampling the
target alone. It accepts more drafts at high temperatures, which is why Medusa uses it. After the
accepted drafts, one more token is drawn from the target's own distribution at that place.

Pure functions over explicit probabilities (``probs.sampling_probs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def acceptable(probs: torch.Tensor, tokens: Sequence[int], threshold: float, alpha: float) -> list[bool]:
    """probs [n, V] (each row a distribution), tokens [n] -> whether tokens[i] passes the test under
    probs[i]."""
    if not len(tokens):
        return []
    probs = probs.float()
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    p = probs[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.long)]
    return (p > bar).tolist()


def typical_chain(probs: torch.Tensor, drafts: Sequence[int], threshold: float, alpha: float,
                  generator: torch.Generator | None = None) -> list[int]:
    """probs [k+1, V]: drafts accepted while they pass the test, then one token drawn from the
    target's distribution after the last accepted one (1..k+1 tokens)."""
    ok = acceptable(probs[:len(drafts)], drafts, threshold, alpha)
    out: list[int] = []
    for d, good in zip(drafts, ok):
        if not good:
            break
        out.append(int(d))
    out.append(int(torch.multinomial(probs[len(out)].float(), 1, generator=generator).item()))
    return out
