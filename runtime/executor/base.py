"""The Executor: what the engine core calls to run a scheduled step, at any tensor-parallel degree.

It owns rank 0's Worker (weights, KV pools, graphs), the ModelRunner that packs each step and
samples its logits, and speculative decoding (the proposer and the draft model run on rank 0;
verification is an ordinary forward pass on every rank). The two implementations differ only in
where ranks 1..N-1 live: ``UniProcExecutor`` has none; ``MultiProcExecutor`` runs them in worker
processes and broadcasts every ForwardInput to them before rank 0 runs it. The engine sees one
interface (runtime/engine/core.py's Executor protocol): the KV facts it sizes its block manager
with, ``propose_drafts``, ``execute_model``, ``check_health`` and ``shutdown``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvserve.runtime.executor.forward_input import ForwardInput
from kvserve.runtime.executor.model_runner import ModelRunner
from kvserve.runtime.executor.worker import Worker
from kvserve.runtime.sampler import Sampler, SamplerOutput

log = logging.getLogger(__name__)


def worker_class(config) -> type[Worker]:
    """Worker, or PipelineWorker (one stage's layers) at pipeline_parallel_size > 1."""
    if config.pipeline_parallel_size > 1:
        from kvserve.runtime.executor.pipeline_worker import PipelineWorker

        return PipelineWorker
    return Worker


def kv_release_window(model_config, draft=None) -> int | None:
    """The window behind which no layer reads K/V again, so the block manager may give those
    blocks back: only when every layer of the model (and of a draft model sharing its block
    tables) is a sliding-window layer; the widest window wins. None keeps every block."""
    configs = [model_config] + ([draft.config] if draft is not None else [])
    if not all(c.all_layers_sliding for c in configs):
        return None
    return max(c.sliding_window for c in configs)


def hybrid_kv_groups(config, model_config) -> tuple | None:
    """The KV cache groups of a model that mixes local and global layers (each group its own
    block tables and pool: runtime/engine/kv_cache_groups.py; at pipeline parallelism each stage
    pools its own layers by group: runtime/executor/pipeline_kv_groups.py), or None for one block
    table serving every layer: a model with one kind of layer, the hybrid manager disabled,
    speculative decoding (its draft model and verification step take one table per sequence
    today)."""
    from kvserve.runtime.engine.kv_cache_groups import kv_cache_groups

    groups = kv_cache_groups([model_config.layer_window(i) for i in range(model_config.num_layers)])
    if len(groups) == 1 or config.disable_hybrid_kv_cache_manager:
        return None
    if config.speculative_config is not None:
        log.info("hybrid KV cache manager off (speculative decoding): one block table serves every layer, "
                 "so the local layers hold the whole context")
        return None
    return groups


class Executor:
    """Builds rank 0 (and, through the subclass's hooks, every other rank) and runs steps."""

    def __init__(self, config, model_config, *, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 quant_config=None) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.last_timings: tuple[float, float, float] | None = None
        self.pipeline_bubble_fraction = 0.0
        self.rank_reports: list[dict[str, Any]] = [dict(rank=0, pid=os.getpid())]
        self.driver_worker = worker_class(config)(config, model_config, device=device, dtype=dtype, rank=0,
                                                  world_size=self.world_size, quant_config=quant_config)
        draft = self._load_draft()
        heads = self._load_heads()
        self.kv_groups = hybrid_kv_groups(config, model_config)
        self.kv_release_window = None if self.kv_groups is not None else kv_release_window(model_config, draft)
        max_step = (config.resolved_max_num_batched_tokens(max_model_len) if config.enable_chunked_prefill
                    else max_model_len)
        self._start_ranks(max_step_tokens=max_step)
        try:
            worker = self.driver_worker
            worker.load_model()
            blocks = worker.determine_kv_blocks(self.kv_groups, max_model_len=max_model_len, max_step_tokens=max_step)
            if isinstance(heads, tuple) and config.num_kv_blocks is None:
                # An EAGLE head's one-layer pools take their share of the budget (about one layer's).
                n = model_config.num_layers
                blocks = [max(1, blocks[0] * n // (n + 1))]
            if draft is not None and config.num_kv_blocks is None:
                from kvserve.runtime.spec_decode.worker import split_blocks_with_draft

                # The draft's pools take as many blocks as the target's, out of the same budget.
                blocks = [split_blocks_with_draft(blocks[0], model_config.shape, draft.config.shape)]
            self.rank_reports[0].update(num_kv_blocks_fit=blocks[0], weight_bytes=worker.weight_bytes)
            blocks = self._agree_kv_blocks(blocks)
            kv_bytes = worker.initialize_kv_cache(blocks, self.kv_groups)
            self.rank_reports[0].update(num_kv_blocks=blocks[0], kv_cache_bytes=kv_bytes)
            self._await_ranks_ready()
            worker.compile_and_capture(max_model_len=max_model_len)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks_per_group = list(blocks)
        self.model_weight_bytes = worker.weight_bytes
        generator = torch.Generator(device=device).manual_seed(config.seed)
        self.lora_manager = None
        if worker.lora is not None:
            from kvserve.runtime.lora.manager import LoRAManager

            if config.pipeline_parallel_size > 1:  # adapters are checked against every stage's modules
                worker.lora.all_targets = {**getattr(self, "lora_targets", {}), **worker.lora.target_shapes}

            self.lora_manager = LoRAManager(worker.lora, max_loras=config.max_loras)
        self.runner = ModelRunner(self._forward, config.block_size, Sampler(generator), kv_groups=self.kv_groups,
                                  lora=self.lora_manager, verify_as_decode_rows=device.type == "cpu")
        self.runner.greedy_on_last_stage = config.pipeline_parallel_size > 1
        self.spec_decoder = None
        if config.speculative_config is not None:
            from kvserve.runtime.spec_decode.worker import SpecDecoder

            worker.keep_hidden = heads is not None
            if isinstance(heads, tuple):  # EAGLE: every computed row, and EAGLE-3's target layers
                worker.keep_hidden = "all"
                heads = self._eagle_aux(worker.model, heads)
            self.spec_decoder = SpecDecoder(config.speculative_config, self.runner, num_blocks=blocks[0],
                                            block_size=config.block_size, device=device,
                                            kv_cache_dtype=worker.kv_cache_dtype,
                                            max_model_len=max_model_len, draft_model=draft, heads=heads,
                                            hidden_source=lambda: worker.last_hidden,
                                            aux_source=lambda: worker.last_aux_hidden, target=worker.model,
                                            model_dir=config.model, max_num_seqs=config.max_num_seqs,
                                            kv_source=lambda: worker.kv_caches,
                                            attention_backend=worker.attention_backend.name)
            if draft is not None and worker.graphs is not None:  # the draft runs on rank 0 only
                self._capture_draft_graphs(worker, max_model_len)

    def _capture_draft_graphs(self, worker, max_model_len: int) -> None:
        """The draft model's decode graphs, for the target's decode buckets, in the target graphs'
        memory pool (captured as the target's were: a CPU twin's draft graphs are twins too); a
        failed capture is logged, counted, and leaves the proposals eager."""
        try:
            self.spec_decoder.build_draft_graphs(worker.graphs.sizes, max_model_len=max_model_len,
                                                 capture=worker.graphs.capture_enabled, pool=worker.graphs.pool)
        except Exception:
            worker._capture_failed(f"draft model decode batch sizes {worker.graphs.sizes}")

    @staticmethod
    def _eagle_aux(model, heads):
        """Points rank 0's aux_hidden_layers hook at the layers an EAGLE-3 head reads: vLLM's
        id i (the stream entering layer i) is the hook's output of layer i - 1. Returns (head,
        each id's index into the hook's list)."""
        from kvserve.runtime.spec_decode.eagle import aux_hook_layers

        head, ids = heads
        if not ids:
            return head, ()
        hook = aux_hook_layers(ids)
        model.aux_hidden_layers = hook  # each rank's Worker.load_model set the same already
        return head, tuple(hook.index(i - 1) for i in ids)

    def _load_heads(self):
        """Medusa heads on rank 0, loaded (like a draft) before the KV pools are sized."""
        if self.config.speculative_config is None:
            return None
        from kvserve.runtime.attention.selector import get_attention_backend
        from kvserve.runtime.spec_decode.worker import load_heads

        return load_heads(self.config.speculative_config, hidden_size=self.model_config.hidden_size,
                          vocab_size=self.model_config.vocab_size, device=self.device, dtype=self.dtype,
                          num_layers=self.model_config.num_layers, model_config=self.model_config,
                          model_dir=self.config.model,
                          quant_config=self.driver_worker.quant_config or self.config.quantization,
                          attention_backend=get_attention_backend(self.config.attention_backend, self.device))

    def _load_draft(self):
        if self.config.speculative_config is None:
            return None
        from kvserve.runtime.attention.selector import get_attention_backend
        from kvserve.runtime.spec_decode.worker import load_draft

        # The draft runs whole on rank 0 (it is small): proposals need no collectives.
        return load_draft(self.config.speculative_config, device=self.device, dtype=self.dtype,
                          attention_backend=get_attention_backend(self.config.attention_backend, self.device),
                          vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len)

    # -- what the engine core calls --------------------------------------------------------------
    @property
    def supports_overlap(self) -> bool:
        """Whether execute_model may run in a second thread while the engine thread works on the
        previous step's outputs (async scheduling). Speculative steps read the newest tokens."""
        return self.spec_decoder is None

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may keep in flight (launch_model before the previous land_model):
        one per pipeline stage at pipeline_parallel_size > 1, so every stage has a micro-batch
        to run; 1 otherwise, and with speculative decoding (its drafts read the newest tokens).
        LoRA steps carry their adapter layout and slot loads, which each stage applies in launch
        order, so micro-batches may use different adapters."""
        pp = self.config.pipeline_parallel_size
        if pp == 1 or self.spec_decoder is not None:
            return 1
        configured = self.config.max_concurrent_batches
        return pp if configured is None else configured

    def launch_model(self, model_input):
        """Starts a step and returns a handle for land_model; at depth 1 it simply runs it."""
        if self.max_concurrent_batches == 1:
            return self.execute_model(model_input)
        self.runner.last_timings = None
        return self.runner.start(model_input.scheduled, model_input.block_tables, model_input.rows,
                                 model_input.repeats, self._launch)

    def land_model(self, pending) -> SamplerOutput:
        """The sampled tokens of a launched step, in launch order."""
        if isinstance(pending, SamplerOutput):
            return pending
        out = self.runner.finish(pending, self._land)
        self.last_timings = self.runner.last_timings
        self._observe_bubble()
        return out

    def _observe_bubble(self) -> None:
        bubble = getattr(self.driver_worker, "last_bubble", None)
        if bubble is not None:
            self.pipeline_bubble_fraction = 0.9 * self.pipeline_bubble_fraction + 0.1 * bubble

    @property
    def model(self) -> torch.nn.Module:
        return self.driver_worker.model

    @property
    def kv_caches(self) -> list:
        return self.driver_worker.kv_caches

    @property
    def attention_backend(self) -> str:
        return self.driver_worker.attention_backend.name

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.driver_worker.kv_cache_dtype

    @property
    def graph_capture_failures(self) -> int:
        """Failed CUDA graph captures on rank 0 (every rank fails alike)."""
        return self.driver_worker.graph_capture_failures

    def propose_drafts(self, running: Sequence, params_of: Callable) -> None:
        """Speculative decoding: sets each running sequence's spec_token_ids before scheduling."""
        if self.spec_decoder is not None:
            self.spec_decoder.plan(running, params_of)

    def execute_model(self, model_input) -> SamplerOutput:
        """One scheduled step (runtime/engine/core.py's ModelInput): forward on every rank, then
        rank 0 samples (or verifies drafts)."""
        runner = self.runner
        runner.last_timings = None
        if self.spec_decoder is not None:
            out = self.spec_decoder.execute(model_input.scheduled, model_input.block_tables, model_input.rows,
                                            model_input.repeats)
        else:
            out = runner.execute(model_input.scheduled, model_input.block_tables, model_input.rows,
                                 model_input.repeats)
        self.last_timings = runner.last_timings
        self._observe_bubble()
        return out

    @property
    def offloader(self):
        """Rank 0's KVOffloader (None without an offload tier or swap space)."""
        return self.driver_worker.offloader

    @property
    def offload_block_bytes(self) -> list[int]:
        """Bytes per offloaded block of each KV cache group, as one rank's budget counts them."""
        return self.driver_worker.offload_block_bytes()

    def kv_offload_apply(self, ops: list[tuple]) -> list[bytes]:
        """Applies offload operations on rank 0 now and on the other ranks before their next
        forward pass; returns the keys whose loads failed on rank 0."""
        failed = self.driver_worker.offloader.apply(ops)
        if failed:  # the engine forgets those: the other ranks must not load them either
            lost = set(failed)
            ops = [op for op in ops if not (op[0] == "load" and op[4] in lost)]
        if any(op[0] == "load" for op in ops):
            # A block another rank cannot read (its file deleted by another server, a bad
            # checksum there) fails everywhere, before any forward pass reads it: recomputed.
            failed = list(dict.fromkeys(failed + self._load_on_every_rank(ops)))
        else:
            self._share_kv_ops(ops)
        return failed

    def write_transient_tier(self, ops: list[tuple], directory: str) -> int:
        """A reshape's transient KV tier (runtime/engine/reshape_kv.py): rank 0 writes its heads of
        the blocks now, the other ranks theirs as they shut down; returns rank 0's count written."""
        written = self.driver_worker.write_transient_tier(ops, directory)
        self._transient_writes = (ops, directory)
        return written

    def kv_offload_scan(self) -> list[tuple[bytes, int]]:
        return self.driver_worker.offload_scan()

    def _share_kv_ops(self, ops: list[tuple]) -> None:
        """Hands offload operations to ranks 1..N-1 (none here)."""

    def _load_on_every_rank(self, ops: list[tuple]) -> list[bytes]:
        """Applies offload operations that load blocks on ranks 1..N-1 now; returns the keys
        some rank could not load (none here)."""
        self._share_kv_ops(ops)
        return []

    def check_health(self) -> None:
        """Raises when the executor can no longer step (a tensor-parallel worker died)."""

    def shutdown(self) -> None:
        """Idempotent: stops the other ranks and frees rank 0's graphs, pools and weights."""
        self._stop_ranks()
        spec = getattr(self, "spec_decoder", None)
        if spec is not None:
            spec.close()
        self.driver_worker.close()

    # -- the subclass's ranks 1..N-1 ---------------------------------------------------------------
    def _start_ranks(self, *, max_step_tokens: int) -> None:
        """Starts ranks 1..N-1 loading their shards (before rank 0 loads its own)."""

    def _agree_kv_blocks(self, blocks: list[int]) -> list[int]:
        """Block counts every rank can hold (each sized its own pools)."""
        return blocks

    def _await_ranks_ready(self) -> None:
        """Returns once every other rank has allocated its pools."""

    def _forward(self, step: ForwardInput) -> torch.Tensor | None:
        return self.driver_worker.execute_model(step)

    def _launch(self, step: ForwardInput):
        """Starts rank 0's part of a step (pipelined: its stage, the activations sent on)."""
        return self.driver_worker.launch(step)

    def _land(self, handle) -> torch.Tensor | None:
        return self.driver_worker.land(handle)

    def _stop_ranks(self) -> None:
        pass
