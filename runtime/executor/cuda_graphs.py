"""Uniform steps replayed from CUDA graphs, one graph per (batch-size bucket, query length).

An eager step of a small model on a GPU is launch-bound: every layer launches a dozen kernels,
each a few microseconds of host time, for a few microseconds of GPU work. A CUDA graph records the
launches of one whole forward pass once and replays them with one call. A graph replays fixed
addresses and shapes, so only *uniform* steps replay one: every sequence of the step has the same
number of new tokens q (the query length), and

- inputs live in static buffers sized for the largest bucket (token ids, positions, slot
  mapping: bucket x q rows; context lengths, block tables as wide as max_model_len needs: one row
  per sequence); each step copies its inputs into them and pads the sequences up to the bucket;
- a padded sequence is a harmless dummy: tokens 0 at position 0, slot mapping -1 (its K/V is
  never written), context length q over block 0, and its output is dropped;
- the attention metadata says max_seq_len = max_model_len, so a kernel's launch grid covers any
  context (each program skips what lies past its sequence's length).

``DecodeGraphs`` (q = 1) replays decode-only steps. With ``query_len=q > 1`` it replays
speculative verification steps: a chain's pending token and its k drafts (q = 1 + k: n-gram,
draft model, EAGLE, MTP), or a candidate tree of q rows (Medusa / EAGLE / MTP trees,
``tree=True``). A tree graph also holds the step's ancestor masks (AttentionMetadata.tree_masks)
in a static buffer; a sequence that verifies a chain in a tree step (mask 0) gets chain masks
(row j sees rows 0..j), which is causal attention, and the metadata says ``all_trees`` so the
attention backend runs the tree kernel over every row without reading the device. Which query
lengths are captured, and which steps qualify, is runtime/executor/verify_graphs.py's policy;
a step of shorter queries is padded to q first (runtime/executor/verify_padding.py), and steps
with a prefill in them run eagerly.

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
    """Static inputs of uniform steps of `query_len` tokens per sequence and one CUDA graph per
    bucket (or, with capture=False, the same padded static-buffer path run eagerly: the CPU twin
    the tests use). `sizes` are batch sizes in sequences."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, *, block_size: int, max_model_len: int,
                 sizes: list[int], device: torch.device, capture: bool,
                 kv_group_windows: list[int | None] | None = None, pool: Any = None,
                 query_len: int = 1, tree: bool = False):
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one capture size")
        if isinstance(query_len, bool) or not isinstance(query_len, int) or query_len < 1:
            raise ValueError(f"DecodeGraphs: query_len must be an integer >= 1, got {query_len!r}")
        if tree and not 1 < query_len <= 64:
            raise ValueError(f"DecodeGraphs: a tree has 2 to 64 rows (64-bit masks), got query_len {query_len}")
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(sizes)
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.query_len, self.tree = query_len, tree
        q = query_len
        largest = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        dev = self.device
        self.input_ids = torch.zeros(largest * q, dtype=torch.long, device=dev)
        self.positions = torch.zeros(largest * q, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((largest * q,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.full((largest,), q, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(largest, max_blocks, dtype=torch.int32, device=dev)
        # A tree graph's ancestor masks; padding (and a chain's rows) get the chain's: row j sees
        # rows 0..j of its sequence, i.e. causal attention.
        self.tree_masks = self._chain_masks = None
        if tree:
            j = torch.arange(largest * q, dtype=torch.long, device=dev) % q
            # Row 63's mask is all 64 bits (-1): no shift by 64, whose result differs by device.
            self._chain_masks = torch.where(j == 63, -1, (torch.ones_like(j) << torch.clamp(j + 1, max=63)) - 1)
            self.tree_masks = self._chain_masks.clone()
        # KV cache groups (a hybrid model): one slot mapping and block table per group's window,
        # the first group's being the buffers above; None: one table serves every layer.
        self.kv_group_windows = kv_group_windows
        self._group_buffers: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, window in enumerate(kv_group_windows or []):
            self._group_buffers[window] = ((self.slot_mapping, self.block_tables) if i == 0 else
                                           (torch.full_like(self.slot_mapping, -1), torch.zeros_like(self.block_tables)))
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=dev) * q
        self.capture_enabled = capture
        # The graphs' shared memory pool (torch.cuda.graph_pool_handle); another instance's to
        # share it (the KV sizing measures what a further graph adds to a pool).
        self.pool = pool
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # EAGLE-3 reads the residual stream of some target layers (model.aux_hidden): a graph's
        # are captured tensors too, handed back after each replay.
        self.aux_outputs: dict[int, list[torch.Tensor]] = {}
        self._rows_loaded = 0  # rows of the static buffers that hold a real sequence's data
        self.replays = 0

    def bucket(self, n: int) -> int | None:
        return bucket_for(n, self.sizes)

    def metadata(self, size: int) -> AttentionMetadata:
        q = self.query_len
        masks = None if self.tree_masks is None else self.tree_masks[: size * q]

        def of(slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> AttentionMetadata:
            return AttentionMetadata(query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
                                     block_tables=block_tables[:size], slot_mapping=slot_mapping[: size * q],
                                     max_query_len=q, max_seq_len=self.max_model_len, is_decode_only=q == 1,
                                     tree_masks=masks, all_trees=self.tree)

        meta = of(self.slot_mapping, self.block_tables)
        if self._group_buffers:
            meta.kv_groups = {w: of(*buffers) for w, buffers in self._group_buffers.items()}
        return meta

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copies one uniform step of s sequences (s x query_len rows) into the static buffers and
        pads sequences s..size-1 (only the rows a previous, larger step dirtied are reset)."""
        q = self.query_len
        s = meta.num_seqs
        n = input_ids.shape[0]
        if q == 1 and (not meta.is_decode_only or n > size):
            raise ValueError(f"DecodeGraphs.load: a decode-only step of at most {size} rows, got {n}")
        if n != s * q or meta.max_query_len != q or s > size:
            raise ValueError(f"DecodeGraphs.load: a step of at most {size} sequences of {q} tokens each, "
                             f"got {n} tokens in {s} sequences (longest {meta.max_query_len})")
        if meta.tree_masks is not None and not self.tree:
            raise ValueError("DecodeGraphs.load: a tree step needs a graph captured with tree masks")
        if (meta.kv_groups is None) != (not self._group_buffers):
            raise ValueError("DecodeGraphs.load: the step's KV cache groups differ from the captured ones")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:s].copy_(meta.seq_lens, non_blocking=True)
        if self.tree:
            chain = self._chain_masks[:n]
            if meta.tree_masks is None:
                self.tree_masks[:n].copy_(chain)
            else:  # a sequence verifying a chain in a tree step has masks 0: causal, as chain masks are
                masks = meta.tree_masks.to(self.device, non_blocking=True)
                self.tree_masks[:n].copy_(torch.where(masks != 0, masks, chain))
        tables = ([(self.slot_mapping, self.block_tables, meta)] if not self._group_buffers else
                  [(slots, blocks, meta.kv_groups[w]) for w, (slots, blocks) in self._group_buffers.items()])
        dirty = max(self._rows_loaded, s)
        for slot_mapping, block_tables, group_meta in tables:
            width = group_meta.block_tables.shape[1]
            if width > block_tables.shape[1]:
                raise ValueError(f"block table width {width} exceeds the {block_tables.shape[1]} blocks "
                                 f"max_model_len {self.max_model_len} needs")
            slot_mapping[:n].copy_(group_meta.slot_mapping, non_blocking=True)
            block_tables[:s, :width].copy_(group_meta.block_tables, non_blocking=True)
            if width < block_tables.shape[1]:
                block_tables[:s, width:].zero_()
            if dirty > s:
                slot_mapping[n:dirty * q].fill_(-1)
                block_tables[s:dirty].zero_()
        if dirty > s:
            self.input_ids[n:dirty * q].zero_()
            self.positions[n:dirty * q].zero_()
            self.seq_lens[s:dirty].fill_(q)
            if self.tree:
                self.tree_masks[n:dirty * q].copy_(self._chain_masks[n:dirty * q])
        self._rows_loaded = s

    def _forward(self, size: int) -> torch.Tensor:
        rows = size * self.query_len
        return self.model(self.input_ids[:rows], self.positions[:rows], self.kv_caches, self.metadata(size))

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
                if getattr(self.model, "aux_hidden_layers", None):
                    self.aux_outputs[size] = list(self.model.aux_hidden)
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for %s batch sizes %s",
                 "decode" if self.query_len == 1 else f"{self.query_len}-token {'tree' if self.tree else 'chain'} "
                 "verification", self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of one uniform step of s <= max(sizes) sequences (n = s x query_len rows)."""
        n = input_ids.shape[0]
        s = -(-n // self.query_len)  # load checks that the step's sequences are these
        size = self.bucket(s)
        if size is None:
            raise ValueError(f"DecodeGraphs.run: {s} sequences is outside the capture sizes {self.sizes}")
        self.load(input_ids, positions, meta, size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            out = self.outputs[size]
            aux = self.aux_outputs.get(size)
        else:
            out = self._forward(size)
            aux = self.model.aux_hidden if getattr(self.model, "aux_hidden_layers", None) else None
        if aux is not None:
            self.model.aux_hidden = [a[:n] for a in aux]
        self.replays += 1
        return out[:n]
