"""Runs one scheduled step: packs the batch, runs the model, samples the rows that yield tokens.

Every scheduled sequence contributes its new tokens (a prompt chunk or one decode token) to one
packed token axis, with no padding. Logits are computed only for the last row of each sequence
whose chunk reaches its end; a partial prefill chunk only fills the cache.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np
import torch

from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.kv_cache import copy_blocks, copy_group_blocks
from kvserve.runtime.engine.kv_cache_groups import KVCacheGroup
from kvserve.runtime.sampler import Sampler, SamplerOutput, SamplingRow
from kvserve.runtime.engine.scheduler import ScheduledSequence


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, sampler: Sampler,
                 kv_groups: Sequence[KVCacheGroup] | None = None) -> None:
        self.model = model
        # With KV cache groups, each sequence's block table is a tuple of one table per group.
        self.kv_groups = tuple(kv_groups) if kv_groups is not None else None
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        # Seconds spent in (prepare, forward, sample) by the latest execute(); on a GPU, forward is
        # the time to launch the kernels and sample includes waiting for them (the one sync).
        self.last_timings: tuple[float, float, float] | None = None
        # Decode-only steps whose batch fits a bucket replay a CUDA graph (runtime/cuda_graphs.py).
        self.graphs = None

    def prepare(self, scheduled: list[ScheduledSequence],
                block_tables: list) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Packed (input_ids, positions, metadata, logits row indices) for one step. With KV cache
        groups, `block_tables[i]` holds one table per group, and the metadata one per window."""
        if self.kv_groups is None:
            return self._prepare(scheduled, block_tables)
        per_group = [self._prepare(scheduled, [tables[g] for tables in block_tables])
                     for g in range(len(self.kv_groups))]
        input_ids, positions, meta, logits_rows = per_group[0]
        by_window = {group.window: prepared[2] for group, prepared in zip(self.kv_groups, per_group)}
        return input_ids, positions, dataclasses.replace(meta, kv_groups=by_window), logits_rows

    def _prepare(self, scheduled: list[ScheduledSequence],
                 block_tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        num_seqs = len(scheduled)
        decode_only = all(item.num_new_tokens == 1 for item in scheduled)
        query_start_loc = [0] * (num_seqs + 1)
        seq_lens = [0] * num_seqs
        max_blocks = max(len(t) for t in block_tables)
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        logits_rows: list[int] = []

        if decode_only:
            input_ids = [0] * num_seqs
            positions = [0] * num_seqs
            slots = [0] * num_seqs
            for i, (item, table) in enumerate(zip(scheduled, block_tables)):
                pos = item.start
                input_ids[i] = item.seq.token_ids[pos]
                positions[i] = pos
                slots[i] = table[pos // bs] * bs + pos % bs
                query_start_loc[i + 1] = i + 1
                seq_lens[i] = pos + 1
                tables[i, : len(table)] = table
                if item.samples:
                    logits_rows.append(i)
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

        # Blocks given back behind a sliding window (FREED, -1) are never read; 0 keeps every id valid.
        np.maximum(tables, 0, out=tables)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            slot_mapping=slot_t.to(dev, non_blocking=True),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            is_decode_only=decode_only,
        )
        return input_t.to(dev, non_blocking=True), pos_t.to(dev, non_blocking=True), meta, logits_rows

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence], block_tables: list[list[int]],
                rows: list[SamplingRow], repeats: list[int] | None = None) -> SamplerOutput:
        """Runs the step; `rows` describe, in order, the scheduled sequences that sample.
        With `repeats`, sampling sequence i gives repeats[i] rows (n > 1: one logits row, n draws)."""
        t0 = time.perf_counter()
        for item in scheduled:
            if self.kv_groups is None:
                copy_blocks(self.kv_caches, item.block_copies)
            else:
                copy_group_blocks(self.kv_caches, self.kv_groups, item.block_copies)
        input_ids, positions, meta, logits_rows = self.prepare(scheduled, block_tables)
        assert len(logits_rows) == (len(rows) if repeats is None else len(repeats))
        t1 = time.perf_counter()
        graphs = self.graphs
        if graphs is not None and meta.is_decode_only and graphs.bucket(input_ids.shape[0]) is not None:
            hidden = graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not rows:
            self.last_timings = (t1 - t0, time.perf_counter() - t1, 0.0)
            return SamplerOutput([], [])
        if len(logits_rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(logits_rows, device=hidden.device)]
        logits = self.model.compute_logits(hidden)
        if repeats is not None:
            logits = logits.repeat_interleave(torch.tensor(repeats, device=logits.device), dim=0)
        t2 = time.perf_counter()
        out = self.sampler(logits, rows)
        self.last_timings = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        return out
