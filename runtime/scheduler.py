"""Iteration-level (continuous) batching: which sequences run how many tokens in the next step.

Pure and deterministic: no torch, no clocks. Each step has a token budget
(``max_num_batched_tokens``) and a cap on running sequences (``max_num_seqs``).

1. Running sequences go first, oldest admission first: decodes take one token each; a
   sequence still prefilling (at most one, the newest) takes what the budget leaves.
2. Then waiting sequences are admitted first come first served, each with as much of its
   prompt as the budget leaves (chunked prefill), while blocks and the cap allow.
3. When a running sequence needs a block and none is free, the most recently admitted running
   sequence is preempted by recompute: its blocks are freed and it goes back to the front of the
   queue, keeping the tokens it generated (they are prefilled again with the prompt).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.runtime.block_manager import BlockManager
from kvserve.runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    # Copy-on-write (src_block, dst_block) pairs to apply before this step's forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # True when this chunk reaches the end of the sequence, so its last row yields a token;
    # fixed at scheduling time (before num_computed_tokens advances).
    samples: bool = field(init=False)
    # Where the chunk starts (the sequence's num_computed_tokens when scheduled).
    start: int = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- admission -------------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises ValueError (naming the field) for a request that could never be served."""
        cfg, bm = self.config, self.block_manager
        if num_prompt_tokens < 1:
            raise ValueError("prompt: must contain at least one token")
        if num_prompt_tokens >= cfg.max_model_len:
            raise ValueError(f"prompt: {num_prompt_tokens} tokens leave no room to generate within "
                             f"max_model_len {cfg.max_model_len}")
        if num_prompt_tokens + max_tokens > cfg.max_model_len:
            raise ValueError(f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens "
                             f"({max_tokens}) exceeds max_model_len {cfg.max_model_len}")
        if bm.blocks_for_tokens(num_prompt_tokens + max_tokens - 1) > bm.num_blocks:
            raise ValueError(f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens "
                             f"({max_tokens}) exceeds the whole KV cache "
                             f"({bm.num_blocks * bm.block_size} tokens)")
        if (not cfg.enable_chunked_prefill
                and num_prompt_tokens + max_tokens - 1 > cfg.max_num_batched_tokens):
            raise ValueError(f"prompt: {num_prompt_tokens} tokens + max_tokens {max_tokens} exceed "
                             f"max_num_batched_tokens {cfg.max_num_batched_tokens} and chunked "
                             "prefill is disabled")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_prompt_tokens, seq.max_tokens)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq.seq_id, seq.num_computed_tokens, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                copies = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
                scheduled.append(ScheduledSequence(seq, num_new, copies))
                budget -= num_new
                i += 1
                continue
            break  # the sequence preempted itself: nothing newer is left to run

        # A sequence preempted in this step waits for the next one, so that its freed blocks
        # actually relieve the pressure that caused the preemption.
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                seq = self.waiting[0]
                num_new = seq.num_uncomputed_tokens
                if num_new > budget:
                    if not cfg.enable_chunked_prefill:
                        break
                    num_new = budget
                if not bm.can_allocate(seq.seq_id, seq.num_computed_tokens, num_new):
                    break
                self.waiting.popleft()
                copies = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                scheduled.append(ScheduledSequence(seq, num_new, copies))
                budget -= num_new

        return SchedulerOutput(scheduled, preempted, cfg.max_num_batched_tokens - budget)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Records that the scheduled tokens now have K/V in the cache."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens

    # -- removal ---------------------------------------------------------------------------------
    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Ends a sequence (stop, length or abort) wherever it is, and frees its blocks at once."""
        assert status.finished
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = status
        self.block_manager.free(seq.seq_id)

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)
