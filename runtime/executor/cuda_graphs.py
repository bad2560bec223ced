"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

An eager decode step of a small model on a GPU is launch-bound: every layer launches a dozen
kernels, each a few microseconds of host time, for a few microseconds of GPU work. A CUDA graph
records the launches of one whole forward pass once and replays them with one call. A graph
replays fixed addresses and shapes, so:

- inputs live in static buffers sized for the largest bucket (token ids, positions, slot
  mapping, context lengths, block tables as wide as max_model_len needs); each step copies its
  inputs into them and pads the rows up to the bucket;
- a padded row is a harmless dummy sequence: token 0 at position 0, slot mapping -1 (its K/V is
  never written), context length 1 over block 0, and its output is dropped;
- the attention metadata says max_seq_len = max_model_len, so a kernel's launch grid covers any
  context (each program skips what lies past its sequence's length).

Only decode-only steps (one new token per sequence, batch size up to the largest bucket) replay
graphs. Prefill, mixed and speculative verification steps (1 + k tokens per sequence) run eager:
their token counts vary step to step, and a verification step would need a graph per
(batch, k) pair and per acceptance pattern of its metadata; that is not done yet.

Everything but the capture itself is plain torch and runs on the CPU too (``capture=False``
runs the model eagerly on the padded static buffers), which is how the tests check bucket
selection, padding and the static buffer updates without a GPU.
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.runtime.attention.backend import AttentionMetadata

log = logging.getLogger(__name__)

# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8 (up to max_capture_size).
DEFAULT_MAX_CAPTURE_SIZE = 512


def default_capture_sizes(max_size: int = DEFAULT_MAX_CAPTURE_SIZE) -> list[int]:
    return [s for s in [1, 2, 4, *range(8, max_size + 1, 8)] if s <= max_size]


@dataclass
class CompilationConfig:
    """How the model runs, in the spirit of vLLM's ``--compilation-config`` (a JSON object).

    ``level``: 0 runs the model eagerly (kernel by kernel); 3 wraps the model's forward in
    ``torch.compile`` (dynamic shapes) where the device's kernels allow it (the CUDA path; on the
    CPU the native kernels are opaque calls that compile would only break around).
    ``cudagraph_capture_sizes``: the decode batch-size buckets captured as CUDA graphs (default:
    1, 2, 4, 8, 16, ... up to ``max_capture_size``, capped by max_num_seqs). ``[]`` captures none.
    """

    level: int = 0
    cudagraph_capture_sizes: list[int] | None = None
    max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE

    @classmethod
    def parse(cls, value: Any) -> CompilationConfig:
        """None, a dict, a JSON string, a bare level (0 or 3), or a CompilationConfig."""
        if value is None:
            return cls()
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.isdigit():
                value = {"level": int(text)}
            else:
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"compilation_config: not valid JSON ({exc.msg})") from None
        if isinstance(value, int) and not isinstance(value, bool):
            value = {"level": value}
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config: expected a JSON object, got {type(value).__name__}")
        known = ("level", "cudagraph_capture_sizes", "max_capture_size")
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"compilation_config.{unknown[0]}: unknown field; known: {list(known)}")
        level = value.get("level", 0)
        if level not in (0, 3) or isinstance(level, bool):
            raise ValueError(f"compilation_config.level: must be 0 (eager) or 3 (torch.compile), got {level!r}")
        max_size = value.get("max_capture_size", DEFAULT_MAX_CAPTURE_SIZE)
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"compilation_config.max_capture_size: must be an integer >= 1, got {max_size!r}")
        sizes = value.get("cudagraph_capture_sizes")
        if sizes is not None:
            if not isinstance(sizes, list) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                                  for s in sizes):
                raise ValueError("compilation_config.cudagraph_capture_sizes: must be a list of integers >= 1, "
                                 f"got {sizes!r}")
            sizes = sorted(set(sizes))
        return cls(level=level, cudagraph_capture_sizes=sizes, max_capture_size=max_size)

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            sizes = default_capture_sizes(self.max_capture_size)
        return [s for s in sizes if s <= min(max_num_seqs, self.max_capture_size)]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest capture size that holds n rows, or None (run eager)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) and n >= 1 else None


class DecodeGraphs:
    """Static decode inputs and one CUDA graph per bucket (or, with capture=False, the same padded
    static-buffer path run eagerly: the CPU twin the tests use)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, *, block_size: int, max_model_len: int,
                 sizes: list[int], device: torch.device, capture: bool,
                 kv_group_windows: list[int | None] | None = None, pool: Any = None):
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one capture size")
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(sizes)
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        largest = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        dev = self.device
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=dev)
        self.positions = torch.zeros(largest, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(largest, max_blocks, dtype=torch.int32, device=dev)
        # KV cache groups (a hybrid model): one slot mapping and block table per group's window,
        # the first group's being the buffers above; None: one table serves every layer.
        self.kv_group_windows = kv_group_windows
        self._group_buffers: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, window in enumerate(kv_group_windows or []):
            self._group_buffers[window] = ((self.slot_mapping, self.block_tables) if i == 0 else
                                           (torch.full_like(self.slot_mapping, -1), torch.zeros_like(self.block_tables)))
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=dev)
        self.capture_enabled = capture
        # The graphs' shared memory pool (torch.cuda.graph_pool_handle); another instance's to
        # share it (the KV sizing measures what a further graph adds to a pool).
        self.pool = pool
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._rows_loaded = 0  # rows of the static buffers that hold a real sequence's data
        self.replays = 0

    def bucket(self, n: int) -> int | None:
        return bucket_for(n, self.sizes)

    def metadata(self, size: int) -> AttentionMetadata:
        def of(slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> AttentionMetadata:
            return AttentionMetadata(query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
                                     block_tables=block_tables[:size], slot_mapping=slot_mapping[:size],
                                     max_query_len=1, max_seq_len=self.max_model_len, is_decode_only=True)

        meta = of(self.slot_mapping, self.block_tables)
        if self._group_buffers:
            meta.kv_groups = {w: of(*buffers) for w, buffers in self._group_buffers.items()}
        return meta

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copies one step's n decode rows into the static buffers and pads rows n..size-1 (only the
        rows a previous, larger step dirtied are reset)."""
        n = input_ids.shape[0]
        if not meta.is_decode_only or n > size:
            raise ValueError(f"DecodeGraphs.load: a decode-only step of at most {size} rows, got {n}")
        if (meta.kv_groups is None) != (not self._group_buffers):
            raise ValueError("DecodeGraphs.load: the step's KV cache groups differ from the captured ones")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        tables = ([(self.slot_mapping, self.block_tables, meta)] if not self._group_buffers else
                  [(slots, blocks, meta.kv_groups[w]) for w, (slots, blocks) in self._group_buffers.items()])
        dirty = max(self._rows_loaded, n)
        for slot_mapping, block_tables, group_meta in tables:
            width = group_meta.block_tables.shape[1]
            if width > block_tables.shape[1]:
                raise ValueError(f"block table width {width} exceeds the {block_tables.shape[1]} blocks "
                                 f"max_model_len {self.max_model_len} needs")
            slot_mapping[:n].copy_(group_meta.slot_mapping, non_blocking=True)
            block_tables[:n, :width].copy_(group_meta.block_tables, non_blocking=True)
            if width < block_tables.shape[1]:
                block_tables[:n, width:].zero_()
            if dirty > n:
                slot_mapping[n:dirty].fill_(-1)
                block_tables[n:dirty].zero_()
        if dirty > n:
            self.input_ids[n:dirty].zero_()
            self.positions[n:dirty].zero_()
            self.seq_lens[n:dirty].fill_(1)
        self._rows_loaded = n

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self.metadata(size))

    def capture(self) -> None:
        """Records one graph per bucket, largest first, sharing one memory pool (CUDA only)."""
        if not self.capture_enabled:
            return
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        pool = self.pool
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up: autotuning and lazy allocations stay out of the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of one decode-only step of n <= max(sizes) rows."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"DecodeGraphs.run: {n} rows is outside the capture sizes {self.sizes}")
        self.load(input_ids, positions, meta, size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            out = self.outputs[size]
        else:
            out = self._forward(size)
        self.replays += 1
        return out[:n]
