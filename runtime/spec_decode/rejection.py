"""Verification of drafted tokens so that the output distribution is exactly the target's.

Draft token d_j (drawn from q_j) is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the
first rejection the token is drawn from the normalized residual max(0, p_j - q_j), and when every
draft is accepted one bonus token comes from p_{k+1}. A deterministic proposer (n-gram lookup)
is the case of a one-hot q. Greedy requests accept while the draft equals the target's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def rejection_sample(target_probs: torch.Tensor, draft_tokens: Sequence[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """target_probs [k+1, V], draft_probs [k, V] or None (one-hot proposals) -> the accepted
    drafts followed by one more token (1..k+1 tokens)."""
    k = len(draft_tokens)
    target_probs = target_probs.float()
    uniforms = torch.rand(k, generator=generator, device=target_probs.device).tolist() if k else []
    p_draft = target_probs[torch.arange(k), torch.tensor(list(draft_tokens), dtype=torch.long)].tolist() if k else []
    if draft_probs is not None and k:
        q_draft = draft_probs.float()[torch.arange(k), torch.tensor(list(draft_tokens), dtype=torch.long)].tolist()
    else:
        q_draft = [1.0] * k
    out: list[int] = []
    for j, d in enumerate(draft_tokens):
        # u < p/q without dividing: q > 0 since d was drawn from q.
        if uniforms[j] * q_draft[j] < p_draft[j]:
            out.append(d)
            continue
        if draft_probs is not None:
            residual = (target_probs[j] - draft_probs[j].float()).clamp_(min=0)
        else:
            residual = target_probs[j].clone()
            residual[d] = 0
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
            residual = target_probs[j]
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(target_probs[k], generator))
    return out


def greedy_verify(target_argmax: Sequence[int], draft_tokens: Sequence[int]) -> list[int]:
    """target_argmax [k+1]: drafts accepted while they equal it, then the target's own token."""
    out: list[int] = []
    for j, d in enumerate(draft_tokens):
        if d != target_argmax[j]:
            break
        out.append(d)
    out.append(int(target_argmax[len(out)]))
    return out
