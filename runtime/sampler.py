"""Turns a batch of next-token logits into tokens, one SamplingParams per row.

Order per row: penalties (repetition, presence, frequency), min_tokens masking, then greedy
argmax, or temperature -> top_k -> top_p -> min_p -> a draw. Draws use the exponential race
(argmax of p / Exp(1) noise, equivalent to sampling from p) with noise from the row's own
generator when the request has a seed, so a seeded request gives the same tokens whatever else
is in the batch. Logprobs are of the model's raw distribution (before penalties/temperature).
Rows with a grammar (structured outputs) first get their grammar's token mask, in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.runtime.outputs import Logprob
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.structured_outputs.manager import GrammarState, apply_grammar_bitmask


@dataclass
class SamplingRow:
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (penalties look at these)
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    # Token ids banned while fewer than min_tokens have been generated (EOS + stop_token_ids).
    min_tokens_banned: list[int] = field(default_factory=list)
    # Structured outputs: the sample's grammar matcher (its bitmask masks this row's logits).
    grammar: GrammarState | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: None, or (sampled token's Logprob entry, {token_id: Logprob} incl. the sampled one).
    logprobs: list[dict[int, Logprob] | None]


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), at a third of its CPU cost over a vocabulary-wide row (max's indices are
    also the first maximal value's, NaN included, so the result is the same)."""
    return x.max(dim=-1).indices


def plain_greedy(p: SamplingParams) -> bool:
    return p.greedy and not p.needs_penalties and p.min_tokens == 0 and p.logprobs is None


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.shape[0] == len(rows)
        if any(r.grammar is not None for r in rows):
            apply_grammar_bitmask(logits, [r.grammar for r in rows])
        if all(plain_greedy(r.params) for r in rows):
            return SamplerOutput(argmax_last(logits).tolist(), [None] * len(rows))

        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = logits.clone()
        self._apply_penalties(logits, rows)

        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            tokens[idx] = argmax_last(logits[idx])
        if random:
            idx = torch.tensor(random, device=logits.device)
            tokens[idx] = self._sample(logits[idx], [rows[i] for i in random])
        token_list = tokens.tolist()

        logprobs: list[dict[int, Logprob] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if r.params.logprobs is None:
                    continue
                row = raw_logprobs[i]
                chosen = token_list[i]
                chosen_lp = row[chosen]
                entry = {chosen: Logprob(float(chosen_lp), int((row > chosen_lp).sum()) + 1)}
                if r.params.logprobs > 0:
                    values, ids = row.topk(min(r.params.logprobs, row.shape[0]))
                    for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
                        entry.setdefault(t, Logprob(v, rank))
                logprobs[i] = entry
        return SamplerOutput(token_list, logprobs)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        device = logits.device
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=device)
                seen = seen[seen < vocab]
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                              vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.num_output_tokens:
                out = torch.tensor(r.token_ids[r.num_prompt_tokens:], dtype=torch.long, device=device)
                counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if r.num_output_tokens < p.min_tokens and r.min_tokens_banned:
                banned = [t for t in r.min_tokens_banned if t < vocab]
                logits[i, banned] = float("-inf")

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        n, vocab = logits.shape
        temps = torch.tensor([r.params.temperature for r in rows], device=device, dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            positions = torch.arange(vocab, device=device).unsqueeze(0)
            if any(k < vocab for k in top_k):
                k = torch.tensor(top_k, device=device).unsqueeze(1)
                sorted_logits = sorted_logits.masked_fill(positions >= k, float("-inf"))
            if any(p < 1.0 for p in top_p):
                probs = sorted_logits.softmax(dim=-1)
                before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
                p = torch.tensor(top_p, device=device, dtype=probs.dtype).unsqueeze(1)
                mask = before > p
                mask[:, 0] = False
                sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(m > 0 for m in min_p):
            m = torch.tensor(min_p, device=device, dtype=probs.dtype).unsqueeze(1)
            probs = probs.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, 0.0)

        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        if unseeded:
            if len(unseeded) == n:
                noise.exponential_(generator=self.generator)
            else:
                idx = torch.tensor(unseeded, device=device)
                noise[idx] = torch.empty(len(unseeded), vocab, device=device,
                                         dtype=probs.dtype).exponential_(generator=self.generator)
        return argmax_last(probs / noise)
