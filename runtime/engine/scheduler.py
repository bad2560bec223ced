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

With a sliding window on every layer, a running sequence first gives back the blocks wholly
behind its next query's window (``BlockManager.release_behind_window``), so long contexts cost
window-sized memory. A model mixing local and global layers gets a ``KVCacheCoordinator``
(runtime/engine/kv_cache_groups.py) instead: the same calls, applied to one block table per layer group.

With prefix caching, an admitted sequence first takes the cached blocks of its longest cached
prefix and computes only the rest; a fully cached sequence still recomputes its last token (its
logits are needed). A decode with draft tokens (``seq.spec_token_ids``) runs 1 + k positions,
fewer if the budget is short (the drafts are trimmed).

After the forward pass, ``update_from_output`` takes the sampled tokens: it appends them, asks
the stop checker (runtime/engine/stop_checker.py) whether each sample ends, rolls a speculative
run back to what was verified, and forks the other samples of an n > 1 request off sample 0's
blocks once its prompt is computed, so the engine's step loop does none of that itself.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.runtime.engine.block_manager import TIER, BlockManager
from kvserve.runtime.engine.kv_cache_groups import KVCacheCoordinator
from kvserve.runtime.engine.prefix_cache import extend_block_hashes
from kvserve.runtime.engine.sequence import Sequence, SequenceStatus
from kvserve.runtime.engine.stop_checker import check_stop

if TYPE_CHECKING:
    from kvserve.runtime.engine.request import Request
    from kvserve.runtime.outputs import Logprob
    from kvserve.runtime.sampler import SamplerOutput

# Waiting requests whose offload-tier blocks are read ahead at each schedule (the next admitted).
PREFETCH_AHEAD = 4


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # LoRA: at most this many distinct adapters among the running sequences (so in any step);
    # 0: no adapters.
    max_loras: int = 0


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
    # Draft positions past the sequence's last token (speculative verification).
    num_spec: int = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        end = self.start + self.num_new_tokens
        self.samples = end >= self.seq.num_tokens
        self.num_spec = max(0, end - self.seq.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampleUpdate:
    """What one step did to one sample: the tokens it took (a speculative run may take several,
    and stops at the one that ends it) with their logprob entries, and whether it finished."""

    req: Request
    num_tokens: int
    logprobs: dict[int, Logprob] | None = None  # the (single) token's entry, when asked for
    finished: bool = False


@dataclass
class StepUpdate:
    samples: list[SampleUpdate]
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    # Speculative decoding: verified runs, their draft positions, and the drafts accepted.
    num_spec_runs: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager | KVCacheCoordinator) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prefix cache counters, in tokens (vllm:prefix_cache_queries / _hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # The offload tier and swap space (kvserve.runtime.kv_offload.manager.OffloadManager), or
        # None: then admission and preemption do exactly what they do without one.
        self.offload = None

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
        # With a sliding window a sequence holds only the window plus one step's tokens at a time.
        step = cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else num_prompt_tokens + max_tokens - 1
        if not bm.fits(num_prompt_tokens + max_tokens - 1, step):
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

    def add_running(self, seq: Sequence) -> None:
        """Adds a sequence that already has its blocks (a forked sample of an n > 1 request).
        It may take the running set past max_num_seqs for a while: its prompt is already paid."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self, in_flight: Collection[int] = (), max_seqs: int | None = None) -> SchedulerOutput:
        """The next step. Pipelined (several micro-batches in flight), `in_flight` holds the ids
        of sequences whose previous step has not come back: they are neither scheduled nor
        preempted (their tokens and blocks are still in use); `max_seqs` caps the sequences of
        this micro-batch so the running ones spread over the batches in flight."""
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        cap = max_seqs if max_seqs is not None else len(self.running) + cfg.max_num_seqs

        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < cap:
            seq = self.running[i]
            if seq.seq_id in in_flight:
                i += 1
                continue
            # Blocks behind every layer's window go back before this step asks for new ones.
            bm.release_behind_window(seq.seq_id, seq.num_computed_tokens)
            if seq.spec_token_ids:
                if seq.num_uncomputed_tokens != 1:
                    seq.spec_token_ids.clear()
                del seq.spec_token_ids[max(0, budget - 1):]
            num_new = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget)
            while not bm.can_allocate(seq.seq_id, seq.num_computed_tokens, num_new):
                if seq.spec_token_ids:  # drafts are optional: drop them before preempting anyone
                    seq.spec_token_ids.clear()
                    num_new = min(seq.num_uncomputed_tokens, budget)
                    continue
                victim = self._pop_victim(i, in_flight)
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
            # LoRA: a sequence whose adapter would exceed max_loras waits, and so does every
            # later adapter sequence (first come first served across adapters: the running ones
            # drain and it is next, so none starves); base-model sequences may pass it.
            active = {s.lora_int_id for s in self.running if s.lora_int_id} if cfg.max_loras else None
            blocked = False
            idx = 0
            while (idx < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs
                   and len(scheduled) < cap):
                seq = self.waiting[idx]
                if active is not None and seq.lora_int_id and (
                        blocked or (seq.lora_int_id not in active and len(active) >= cfg.max_loras)):
                    blocked = True
                    idx += 1
                    continue
                if seq.swapped is not None:
                    resumed = self._swap_in(seq, idx, budget)
                    if resumed is None:
                        break
                    if resumed:
                        if active is not None and seq.lora_int_id:
                            active.add(seq.lora_int_id)
                        scheduled.append(resumed)
                        budget -= resumed.num_new_tokens
                    continue
                prefix = self._cached_prefix(seq)
                # Never the whole sequence: its last token must run to give logits.
                num_cached = min(len(prefix) * bm.block_size, seq.num_tokens - 1) if prefix else 0
                num_new = seq.num_tokens - num_cached
                if num_new > budget:
                    if not cfg.enable_chunked_prefill:
                        break
                    num_new = budget
                if prefix:
                    if not bm.can_allocate_with_prefix(prefix, num_cached, num_new):
                        break
                elif not bm.can_allocate(seq.seq_id, seq.num_computed_tokens, num_new):
                    break
                if prefix:
                    if self.offload is not None and not self._take_prefix_loading(seq, prefix, num_cached):
                        continue  # a tier block could not be read: look the prefix up again without it
                    if self.offload is None:
                        bm.take_prefix(seq.seq_id, prefix)
                    seq.num_computed_tokens = num_cached
                del self.waiting[idx]
                if active is not None and seq.lora_int_id:
                    active.add(seq.lora_int_id)
                if not prefix and self.offload is not None and bm.enable_caching:
                    self.offload.count_query(seq.num_tokens, 0)  # looked up in the tier too, found nothing
                if bm.enable_caching:
                    self.prefix_cache_queries += seq.num_tokens
                    self.prefix_cache_hits += num_cached
                    if seq.num_cached_tokens is None:
                        seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
                copies = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                scheduled.append(ScheduledSequence(seq, num_new, copies))
                budget -= num_new

        if self.offload is not None:
            # The next few waiting requests' tier blocks are read ahead while they wait.
            self.offload.prefetch(itertools.islice(self.waiting, PREFETCH_AHEAD), bm)
            self.offload.flush()  # blocks saved in this schedule leave before the forward pass writes
        return SchedulerOutput(scheduled, preempted, cfg.max_num_batched_tokens - budget)

    def _pop_victim(self, i: int, in_flight: Collection[int]) -> Sequence:
        """The most recently admitted running sequence at index >= i that is not in flight (the
        one at i, the sequence asking, qualifies last: nothing before it is a candidate, since
        those are scheduled in this step or in flight)."""
        for j in range(len(self.running) - 1, i, -1):
            if self.running[j].seq_id not in in_flight:
                return self.running.pop(j)
        return self.running.pop(i)

    def _take_prefix_loading(self, seq: Sequence, prefix, num_cached: int) -> bool:
        """Takes a prefix hit whose blocks may partly come from the offload tier, loading those
        into fresh blocks now. False (and the sequence holds nothing) if a load failed."""
        from kvserve.runtime.kv_offload.manager import tier_key

        bm, offload = self.block_manager, self.offload
        grouped = isinstance(bm, KVCacheCoordinator)
        entries = prefix.per_group if grouped else [prefix]
        # Kept in the tier while fresh blocks are found for them (that may save evicted blocks).
        offload.pin([tier_key(g, seq.block_hashes[i]) for g, p in enumerate(entries)
                     for i, b in enumerate(p) if b == TIER])
        taken = bm.take_prefix(seq.seq_id, prefix)
        offload.pin([])
        loads = taken if grouped else [(0, i, b) for i, b in taken]
        if loads:
            if not offload.load(loads, seq.block_hashes):
                bm.free(seq.seq_id)  # the loaded blocks were never keyed: they go back as plain free blocks
                return False
            bm.key_loaded(seq.block_hashes, taken, seq.token_ids, seq.lora_int_id)
        reference = sum(1 for g, _, _ in loads if g == 0)
        offload.count_query(seq.num_tokens, min(reference * bm.block_size, num_cached))
        return True

    def _swap_in(self, seq: Sequence, idx: int, budget: int) -> ScheduledSequence | None | bool:
        """Resumes a swapped-out sequence: fresh blocks for what it had plus this step's chunk,
        its saved blocks loaded into them. None: no room yet (it keeps its place); False: the
        swap could not be read, so it recomputes (it stays first in line)."""
        cfg, bm = self.config, self.block_manager
        state = seq.swapped
        tokens = state.num_computed_tokens
        num_new = seq.num_tokens - tokens
        if num_new > budget:
            if not cfg.enable_chunked_prefill:
                return None
            num_new = budget
        grouped = isinstance(bm, KVCacheCoordinator)
        if not bm.resume(seq.seq_id, state.num_freed if grouped else state.num_freed[0], tokens + num_new):
            return None
        seq.swapped = None
        tables = bm.group_tables(seq.seq_id) if grouped else (bm.get_block_table(seq.seq_id),)
        if not self.offload.swap_in(state, tables):
            bm.free(seq.seq_id)
            return False
        del self.waiting[idx]
        seq.num_computed_tokens = tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return ScheduledSequence(seq, num_new, [])

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        bm = self.block_manager
        if not bm.enable_caching or seq.num_computed_tokens or bm.get_block_table(seq.seq_id):
            return []
        extend_block_hashes(seq.block_hashes, seq.token_ids, seq.num_tokens, bm.block_size, seq.cache_extra)
        return bm.lookup(seq.block_hashes)

    def _preempt(self, seq: Sequence) -> None:
        if self.offload is not None:
            # Swapped out (its blocks saved before they are freed) when cheaper than recompute.
            bm = self.block_manager
            tables = bm.group_tables(seq.seq_id) if isinstance(bm, KVCacheCoordinator) else \
                (bm.get_block_table(seq.seq_id),)
            seq.swapped = self.offload.swap_out(seq.seq_id, tables, seq.num_computed_tokens)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Records that the scheduled tokens now have K/V in the cache, and keys the blocks they
        filled. Draft positions count as computed here until the engine rolls them back."""
        bm = self.block_manager
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if bm.enable_caching:
                # Only tokens already in token_ids: draft positions are not verified yet.
                done = min(seq.num_computed_tokens, seq.num_tokens)
                if done // bm.block_size > len(seq.block_hashes):
                    extend_block_hashes(seq.block_hashes, seq.token_ids, done, bm.block_size,
                                        seq.cache_extra)
                bm.register(seq.seq_id, seq.block_hashes[: done // bm.block_size], seq.token_ids, seq.lora_int_id)

    def update_from_output(self, out: SchedulerOutput, result: SamplerOutput,
                           requests: Mapping[int, Request]) -> StepUpdate:
        """Takes a step's sampled tokens (`result.token_ids[k]`: an int, or a list for a verified
        speculative run) in schedule order; `requests` maps seq ids to their samples."""
        self.on_step_done(out)
        update = StepUpdate([])
        k = 0
        for item in out.scheduled:
            if not item.samples:
                continue
            req = requests[item.seq.seq_id]
            samples = [req]
            if req.unforked:
                samples += self.fork(req)
            for s in samples:
                token, lp = result.token_ids[k], result.logprobs[k]
                k += 1
                if s.index == 0 and s.seq.num_output_tokens == 0:
                    update.num_prompt_tokens += s.seq.num_prompt_tokens
                if isinstance(token, list):  # verified drafts, then the target's own token
                    update.num_spec_runs += 1
                    update.num_draft_tokens += item.num_spec
                    update.num_accepted_tokens += len(token) - 1
                    update.num_generated_tokens += len(token)
                    update.samples.append(self._take_spec_run(s, token))
                    continue
                update.num_generated_tokens += 1
                s.seq.append_token(token)
                update.samples.append(SampleUpdate(s, 1, lp, self._stop_if_done(s, token)))
        return update

    def _take_spec_run(self, req: Request, tokens: list[int]) -> SampleUpdate:
        """Appends a verified run, stopping early if the sample finishes on the way, and rolls the
        sequence back to its verified length: drafts past the first rejection had K/V written."""
        seq = req.seq
        for n, t in enumerate(tokens, 1):
            seq.append_token(t)
            if self._stop_if_done(req, t):
                return SampleUpdate(req, n, None, True)  # finished: its blocks are already freed
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.truncate(seq.seq_id, seq.num_tokens)
        return SampleUpdate(req, len(tokens))

    def _stop_if_done(self, req: Request, token: int) -> bool:
        status = check_stop(req, token)
        if status is None:
            return False
        self.finish(req.seq, status)
        req.finish_reason = status.finish_reason
        return True

    def fork(self, req: Request) -> list[Request]:
        """Samples 1..n-1 of an n > 1 request take sample 0's blocks (its prompt is computed now)
        and start running."""
        children, req.unforked = req.unforked, []
        parent = req.seq
        for child in children:
            self.block_manager.fork(parent.seq_id, child.seq.seq_id)
            seq = child.seq
            seq.num_computed_tokens = parent.num_computed_tokens
            seq.block_hashes = list(parent.block_hashes)
            seq.num_cached_tokens = parent.num_cached_tokens
            self.add_running(seq)
            child.metrics.first_scheduled_time = req.metrics.first_scheduled_time
        return children

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
        if seq.swapped is not None:
            self.offload.discard(seq.swapped)
            seq.swapped = None

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)
