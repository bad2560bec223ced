"""The distribution the sampler draws from, as explicit probabilities (for rejection sampling).

Same order as kvserve.runtime.sampler: temperature -> top_k -> top_p -> softmax -> min_p, then
renormalized (the sampler's exponential race is scale invariant, so this is what it samples).
Requests with penalties, min_tokens or logprobs never take the speculative path.
"""

from __future__ import annotations

import torch

from kvserve.runtime.sampling_params import SamplingParams


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [R, V] of one request -> probabilities [R, V] (float32)."""
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    if top_k < vocab or params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if top_k < vocab:
            sorted_logits[:, top_k:] = float("-inf")
        if params.top_p < 1.0:
            probs = sorted_logits.softmax(dim=-1)
            mask = (probs.cumsum(dim=-1) - probs) > params.top_p
            mask[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
