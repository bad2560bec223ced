"""Rank 0's half of a step: packs the scheduled batch into a ForwardInput and samples the logits.

Every scheduled sequence contributes its new tokens (a prompt chunk or one decode token) to one
packed token axis, with no padding. Logits are computed only for the last row of each sequence
whose chunk reaches its end; a partial prefill chunk only fills the cache.

The forward pass itself is not here: ``forward`` (given by the executor) runs it on every
tensor-parallel rank's Worker and returns rank 0's full logits, so what this class does is the
same at any tensor-parallel degree.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.executor.forward_input import ForwardInput
from kvserve.runtime.executor.stage_sampling import stage_rows, take_stage_sample
from kvserve.runtime.sampler import Sampler, SamplerOutput, SamplingRow, plain_greedy

Forward = Callable[[ForwardInput], "torch.Tensor | None"]


@dataclasses.dataclass(eq=False)
class PendingStep:
    """A step handed to the forward pass whose logits may not have come back yet."""

    step: ForwardInput
    rows: list[SamplingRow]
    repeats: list[int] | None
    t0: float  # packing began
    t1: float  # launched
    handle: object  # what the launch returned: the logits, or the executor's handle for them


class ModelRunner:
    def __init__(self, forward: Forward, block_size: int, sampler: Sampler,
                 kv_groups: Sequence | None = None, lora=None, verify_as_decode_rows: bool = False) -> None:
        # Runs one ForwardInput on every rank; returns the logits of its logits_rows (None if none).
        self.forward = forward
        # With KV cache groups, each sequence's block table is a tuple of one table per group.
        self.kv_groups = tuple(kv_groups) if kv_groups is not None else None
        self.block_size = block_size
        self.sampler = sampler
        # LoRA (runtime/lora/manager.py): each step's adapter slots and token layout; None: off.
        self.lora = lora
        # Speculative verification steps as decode rows (see _prepare): on a CPU the decode path
        # costs far less than prefill's for a few tokens per sequence. On a GPU the prefill
        # kernel reads each sequence's context once for all its drafts, so this stays off there.
        self.verify_as_decode_rows = verify_as_decode_rows
        # Seconds spent in (prepare, forward, sample) by the latest execute(); on a GPU, forward is
        # the time to launch the kernels and sample includes waiting for them (the one sync).
        self.last_timings: tuple[float, float, float] | None = None
        # Pipeline parallelism: a step whose rows are all plain greedy is sampled on the last
        # stage (ForwardInput.greedy_ids), so only token ids travel back to rank 0.
        self.greedy_on_last_stage = False
        # Cache slot moves rank 0 already made (a Medusa tree's accepted path, moved into place)
        # that the other ranks make before their next step: the next ForwardInput carries them.
        self.kv_slot_moves: list[tuple[int, int]] = []

    def prepare(self, scheduled, block_tables: list, trees: dict[int, tuple[list[int], list[int]]] | None = None
                ) -> ForwardInput:
        """The packed step on the CPU, with every scheduled sequence's copy-on-write copies. With
        KV cache groups, `block_tables[i]` holds one table per group, and the metadata one per window.
        `trees` (Medusa tree verification): scheduled index -> (depths, ancestor masks) of its
        rows, which then sit at positions start + depth (AttentionMetadata.tree_masks)."""
        copies = [pair for item in scheduled for pair in item.block_copies]
        if self.kv_groups is None:
            input_ids, positions, meta, logits_rows = self._prepare(scheduled, block_tables, trees)
        else:
            per_group = [self._prepare(scheduled, [tables[g] for tables in block_tables], trees)
                         for g in range(len(self.kv_groups))]
            input_ids, positions, meta, logits_rows = per_group[0]
            # A new outer object: group 0's own metadata is one of the windows it maps.
            meta = dataclasses.replace(meta, kv_groups={group.window: prepared[2]
                                                        for group, prepared in zip(self.kv_groups, per_group)})
        step = ForwardInput(input_ids, positions, meta, logits_rows, copies)
        if self.kv_slot_moves:
            step.kv_slot_moves, self.kv_slot_moves = self.kv_slot_moves, []
        if self.lora is not None:
            step.lora = self.lora.step_input([item.seq.lora_int_id for item in scheduled],
                                             [item.num_new_tokens for item in scheduled])
        return step

    def _prepare(self, scheduled, block_tables: list[list[int]],
                 trees=None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        decode_only = all(item.num_new_tokens == 1 for item in scheduled)
        # A verification step (each sequence's pending token and its drafts, nothing else) runs
        # as decode rows, one per token with its own context length: every layer writes all rows'
        # K/V before any row attends, so row j sees the drafts before it, as causal attention
        # would, and the step takes the decode path (the native CPU stack) instead of prefill's.
        draft_rows = (not decode_only and self.verify_as_decode_rows and not trees
                      and all(item.num_new_tokens == 1 + item.num_spec for item in scheduled))
        num_seqs = sum(item.num_new_tokens for item in scheduled) if draft_rows else len(scheduled)
        query_start_loc = [0] * (num_seqs + 1)
        seq_lens = [0] * num_seqs
        max_blocks = max(len(t) for t in block_tables)
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        logits_rows: list[int] = []

        if decode_only or draft_rows:
            input_ids = [0] * num_seqs
            positions = [0] * num_seqs
            slots = [0] * num_seqs
            i = 0
            for item, table in zip(scheduled, block_tables):
                for pos in range(item.start, item.start + item.num_new_tokens):
                    input_ids[i] = item.seq.token_ids[pos]
                    positions[i] = pos
                    slots[i] = table[pos // bs] * bs + pos % bs
                    query_start_loc[i + 1] = i + 1
                    seq_lens[i] = pos + 1
                    tables[i, : len(table)] = table
                    i += 1
                if item.samples:
                    logits_rows.append(i - 1)
            decode_only = True
            input_t = torch.tensor(input_ids, dtype=torch.long)
            pos_t = torch.tensor(positions, dtype=torch.long)
            slot_t = torch.tensor(slots, dtype=torch.long)
            max_query_len = 1
        else:
            ids_parts, pos_parts, slot_parts = [], [], []
            total = 0
            for i, (item, table) in enumerate(zip(scheduled, block_tables)):
                start, n = item.start, item.num_new_tokens
                ids_parts.append(item.seq.token_ids[start:start + n])
                pos = np.arange(start, start + n, dtype=np.int64)
                table_np = np.asarray(table, dtype=np.int64)
                pos_parts.append(pos)
                slot_parts.append(table_np[pos // bs] * bs + pos % bs)
                total += n
                query_start_loc[i + 1] = total
                seq_lens[i] = start + n
                tables[i, : len(table)] = table
                if item.samples:
                    logits_rows.append(total - 1)
            input_t = torch.tensor([t for part in ids_parts for t in part], dtype=torch.long)
            pos_t = torch.from_numpy(np.concatenate(pos_parts))
            slot_t = torch.from_numpy(np.concatenate(slot_parts))
            max_query_len = max(item.num_new_tokens for item in scheduled)
            if trees:
                tree_masks = np.zeros(total, dtype=np.int64)
                for i, (depths, masks) in trees.items():
                    lo = query_start_loc[i]
                    pos_parts[i][:] = scheduled[i].start + np.asarray(depths, dtype=np.int64)
                    tree_masks[lo:lo + len(masks)] = masks
                pos_t = torch.from_numpy(np.concatenate(pos_parts))

        # Blocks given back behind a sliding window (FREED, -1) are never read; 0 keeps every id valid.
        np.maximum(tables, 0, out=tables)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.from_numpy(tables),
            slot_mapping=slot_t,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            is_decode_only=decode_only,
            tree_masks=torch.from_numpy(tree_masks) if trees and not decode_only else None,
        )
        return input_t, pos_t, meta, logits_rows

    @torch.inference_mode()
    def execute(self, scheduled, block_tables: list, rows: list[SamplingRow],
                repeats: list[int] | None = None) -> SamplerOutput:
        """Runs the step; `rows` describe, in order, the scheduled sequences that sample.
        With `repeats`, sampling sequence i gives repeats[i] rows (n > 1: one logits row, n draws)."""
        return self.finish(self.start(scheduled, block_tables, rows, repeats, self.forward))

    def start(self, scheduled, block_tables: list, rows: list[SamplingRow], repeats: list[int] | None,
              launch: Forward) -> PendingStep:
        """Packs the step and hands it to `launch`, which may return before its logits exist (a
        handle for `finish`'s `land`): pipeline parallelism keeps several steps in flight."""
        t0 = time.perf_counter()
        step = self.prepare(scheduled, block_tables)
        if not rows:
            step.logits_rows = []
        assert not rows or len(step.logits_rows) == (len(rows) if repeats is None else len(repeats))
        step.greedy_ids = bool(self.greedy_on_last_stage and rows and (repeats is None or set(repeats) == {1})
                               and all(plain_greedy(r.params) and r.grammar is None for r in rows))
        if self.greedy_on_last_stage and rows and not step.greedy_ids:
            step.stage_rows = stage_rows(rows, repeats)
        t1 = time.perf_counter()
        with torch.inference_mode():
            handle = launch(step)
        return PendingStep(step, rows, repeats, t0, t1, handle)

    @torch.inference_mode()
    def finish(self, pending: PendingStep, land: Callable[[object], torch.Tensor | None] | None = None) -> SamplerOutput:
        """Waits for a started step's logits (`land(handle)`; without it the handle is them) and
        samples them."""
        step, rows, repeats, t0, t1 = pending.step, pending.rows, pending.repeats, pending.t0, pending.t1
        logits = pending.handle if land is None else land(pending.handle)
        if logits is None:
            self.last_timings = (t1 - t0, time.perf_counter() - t1, 0.0)
            return SamplerOutput([], [])
        if step.greedy_ids:
            self.last_timings = (t1 - t0, time.perf_counter() - t1, 0.0)
            return SamplerOutput(logits.tolist(), [None] * len(rows))
        if step.stage_rows is not None:  # sampled on the last stage
            self.last_timings = (t1 - t0, time.perf_counter() - t1, 0.0)
            return take_stage_sample(logits, rows)
        if repeats is not None and any(r != 1 for r in repeats):
            logits = logits.repeat_interleave(torch.tensor(repeats, device=logits.device), dim=0)
        t2 = time.perf_counter()
        out = self.sampler(logits, rows)
        self.last_timings = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        return out
