"""Sampling on the last pipeline stage: what it needs from rank 0, and what comes back.

At pipeline_parallel_size > 1 the logits exist on the last stage only. Shipping them to rank 0
costs 4 x vocabulary bytes a row (192 KiB at a 49k vocabulary); instead rank 0 sends, with the
step, each sampling row's description (``StageRows``): its SamplingParams, its seeded generator's
state, the token ids its penalties or min_tokens read (only when it has those), and the
structured-output bitmask rank 0 filled from the grammar matchers (which stay on rank 0). The
last stage runs the same Sampler on its logits and sends back the tokens, the logprobs asked for
and each seeded generator's advanced state (``StageSample``), which rank 0 puts back into the
requests' generators. The draw is the one rank 0 would make from the same logits with the same
generator state, so seeded sampling at P > 1 equals P = 1.

Unseeded random rows draw from the last stage's own generator (seeded from the engine's seed),
not rank 0's: two micro-batches in flight must not draw the same noise from copies of one state.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch

from kvserve.runtime.sampler import Sampler, SamplerOutput, SamplingRow
from kvserve.runtime.sampling_params import SamplingParams


@dataclass(eq=False)
class StageRow:
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far, only when penalties or min_tokens read them
    num_prompt_tokens: int
    generator_state: torch.Tensor | None  # the request's seeded generator, before this draw
    min_tokens_banned: list[int]


@dataclass(eq=False)
class StageRows:
    """One step's sampling rows, for the last stage (ForwardInput.stage_rows)."""

    rows: list[StageRow]
    repeats: list[int] | None  # n > 1: logits row i gives repeats[i] rows
    # Structured outputs: (bitmask, masked rows, grammar vocabulary size), or None.
    bitmask: tuple[torch.Tensor, list[int], int] | None


@dataclass(eq=False)
class StageSample:
    """What the last stage sends back: the SamplerOutput and each row's new generator state."""

    output: SamplerOutput
    generator_states: list[torch.Tensor | None]


def stage_rows(rows: list[SamplingRow], repeats: list[int] | None) -> StageRows:
    from kvserve.runtime.structured_outputs.manager import fill_grammar_bitmask

    out = []
    for r in rows:
        p = r.params
        reads_tokens = p.needs_penalties or p.min_tokens > 0
        out.append(StageRow(p, list(r.token_ids) if reads_tokens else [],
                            r.num_prompt_tokens if reads_tokens else 0,
                            None if r.generator is None else r.generator.get_state(), list(r.min_tokens_banned)))
    filled = fill_grammar_bitmask([r.grammar for r in rows]) if any(r.grammar is not None for r in rows) else None
    if filled is not None:
        mask, masked, vocab = filled
        filled = (mask.clone(), masked, vocab)  # the manager reuses its buffer at the next step
    return StageRows(out, repeats, filled)


def sample_on_stage(logits: torch.Tensor, step: StageRows, sampler: Sampler) -> StageSample:
    """Rank 0's sampling of `step` on the last stage's logits (float32, one row per logits row)."""
    from kvserve.runtime.structured_outputs.manager import apply_token_bitmask

    if step.repeats is not None and any(n != 1 for n in step.repeats):
        logits = logits.repeat_interleave(torch.tensor(step.repeats, device=logits.device), dim=0)
    if step.bitmask is not None:
        apply_token_bitmask(logits, *step.bitmask)
    generators = []
    for r in step.rows:
        g = None
        if r.generator_state is not None:
            g = torch.Generator(device=logits.device)
            g.set_state(r.generator_state)
        generators.append(g)
    rows = [SamplingRow(r.params, r.token_ids, r.num_prompt_tokens, g, r.min_tokens_banned)
            for r, g in zip(step.rows, generators)]
    out = sampler(logits, rows)
    return StageSample(out, [None if g is None else g.get_state() for g in generators])


def take_stage_sample(sample: StageSample, rows: list[SamplingRow]) -> SamplerOutput:
    """On rank 0: advances each request's generator as the draw on the last stage did."""
    for r, state in zip(rows, sample.generator_states):
        if r.generator is not None and state is not None:
            r.generator.set_state(state)
    return sample.output


def encode(sample: StageSample) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def decode(data: torch.Tensor) -> StageSample:
    return pickle.loads(data.cpu().numpy().tobytes())
