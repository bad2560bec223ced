"""One tensor-parallel rank: its device, its weight shard, its KV pools, its CUDA graphs.

The same class runs on every rank, rank 0 inside the engine's process and ranks 1..N-1 in worker
processes (runtime/executor/worker_process.py), so a feature that works at one rank works at N:
every rank receives the same ForwardInput and runs the same ``execute_model``. A Worker never
schedules and never samples; the ranks' row-parallel layers all-reduce and the vocab-parallel
head all-gathers, so each rank ends a step with the full logits (rank 0 samples them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvserve.runtime.executor.forward_input import ForwardInput
from kvserve.runtime.executor.platform import platform_for, release_is_held
from kvserve.runtime.kv_cache import (
    allocate_kv_cache,
    copy_blocks,
    copy_group_blocks,
    determine_group_blocks,
    determine_num_blocks,
    graph_memory_estimate,
    kv_cache_bytes,
    kv_cache_torch_dtype,
    layer_group_blocks,
    profiled_kv_budget,
)

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, config, model_config, *, device: torch.device, dtype: torch.dtype, rank: int = 0,
                 world_size: int = 1, quant_config=None) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(device)
        self.platform = platform_for(self.device)
        self.platform.set_device(self.device)
        self.dtype = dtype
        self.rank, self.world_size = rank, world_size
        self.quant_config = quant_config
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
        self.attention_backend = None
        self.model = None
        self.kv_groups = None
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.graphs = None  # DecodeGraphs once captured (runtime/executor/cuda_graphs.py)
        # Speculative verification graphs by query length (runtime/executor/verify_graphs.py).
        self.verify_graphs: dict = {}
        self.offloader = None  # KVOffloader with an offload tier or swap space (runtime/kv_offload/)
        # Failed CUDA graph captures (each logged at ERROR with its traceback): the KV sizing's
        # measuring capture or the real one. kvserve:cuda_graph_capture_failures_total.
        self.graph_capture_failures = 0
        self._graphs_refused = False  # the measuring capture failed: the real one is not tried
        self._verify_graphs_refused = False  # the same, for the verification graphs only
        # Verification steps whose short queries were padded to replay a graph, and the dummy rows
        # that took (runtime/executor/verify_padding.py).
        self.verify_padded_steps = 0
        self.verify_padded_rows = 0
        self.lora = None  # WorkerLoRA with enable_lora (runtime/lora/worker.py)
        # Speculative heads (Medusa, EAGLE) on rank 0 read the hidden states behind the latest
        # step's logits rows: the final-norm output, and the model's aux_hidden_layers outputs.
        # "all": every row of the step, not only the logits rows (EAGLE's draft KV needs them).
        self.keep_hidden: bool | str = False
        self.last_hidden: torch.Tensor | None = None
        self.last_aux_hidden: list[torch.Tensor] = []

    # -- startup, in this order on every rank ----------------------------------------------------
    def load_model(self) -> None:
        from kvserve.runtime.attention.selector import get_attention_backend
        from kvserve.runtime.models import layers, load_model

        # The TP group is process-wide state: a pipeline engine earlier in this process (rank 0
        # lives in the engine's process) may have left its destroyed stage group there.
        layers.set_tp_group(None)
        self.attention_backend = get_attention_backend(self.config.attention_backend, self.device)
        self.model = load_model(self.config.model, dtype=self.dtype, device=self.device,
                                attention_backend=self.attention_backend, config=self.model_config,
                                tp_rank=self.rank, tp_size=self.world_size,
                                quantization=self.quant_config if self.quant_config is not None
                                else self.config.quantization)
        if getattr(self.config, "speculative_config", None) is not None:
            from kvserve.runtime.spec_decode.eagle import eagle3_target_layers

            self.model.aux_hidden_layers = eagle3_target_layers(self.config, self.model_config.num_layers)
        self._attach_lora()

    def _attach_lora(self) -> None:
        """With enable_lora: the model's layers (this stage's) wrapped with adapter slots."""
        if getattr(self.config, "enable_lora", False):
            from kvserve.runtime.lora.worker import WorkerLoRA

            config = self.config
            lora_dtype = getattr(config, "lora_dtype", "auto")
            self.lora = WorkerLoRA(self.model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                   max_cpu_loras=config.max_cpu_loras, model_dir=config.model,
                                   hf_config=self.model_config.hf_config,
                                   dtype=None if lora_dtype == "auto" else getattr(torch, lora_dtype))

    @property
    def weight_bytes(self) -> int:
        """This rank's weights (its shard): values, scales, zeros."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def determine_kv_blocks(self, kv_groups, *, max_model_len: int, max_step_tokens: int) -> list[int]:
        """Blocks per KV cache group this rank's budget holds ([blocks] without groups).
        `max_step_tokens`: the most tokens the scheduler packs into one step."""
        config, shape = self.config, self.model_config.shape
        budget = None
        if (self.platform.free_memory_bytes(self.device) is not None and config.num_kv_blocks is None
                and config.kv_cache_memory_bytes is None):
            budget = self._profiled_kv_budget(kv_groups, max_step_tokens, max_model_len)
        if kv_groups is None:
            return [determine_num_blocks(config, shape, self.kv_cache_dtype, self.device, budget_bytes=budget)]
        return determine_group_blocks(config, shape, self.kv_cache_dtype, self.device, kv_groups,
                                      max_model_len=max_model_len, max_step_tokens=max_step_tokens,
                                      budget_bytes=budget)

    def _profiled_kv_budget(self, kv_groups, max_step_tokens: int, max_model_len: int) -> int:
        """vLLM's rule (runtime/kv_cache.py's profiled_kv_budget): the device's total x
        gpu_memory_utilization, minus what is in use before the pools exist (this rank's weights,
        the CUDA context, other processes), the activation peak of the largest step, measured by
        running it, and the memory of the decode graphs (and the speculative verification graphs), each
        family measured by capturing two of them.

        What is in use is read again after the profiling: the first step loads kernels that CUDA
        loads lazily (cuBLAS, every Triton module) and library workspaces, device memory that no
        torch counter shows and that stays. Read only before, the first engine of a process would
        promise the pools ~100 MB that its own kernels then hold (a second engine in the same
        process, with those already loaded, got fewer blocks: measured on an H200)."""
        device, platform = self.device, self.platform
        free, total = platform.free_memory_bytes(device)  # after handing cached blocks back
        platform.reset_peak_memory(device)
        allocated = platform.memory_allocated(device)
        self.profile_run(kv_groups, max_step_tokens)
        platform.synchronize(device)
        activations = max(0, platform.peak_memory_allocated(device) - allocated)
        platform.release_memory()
        sizes, _ = self.graph_sizes()
        graph_bytes = self.profile_graphs(kv_groups, sizes, max_model_len=max_model_len) if sizes else 0
        for q, (verify_sizes, tree) in (self.verify_graph_plan(sizes).items() if not self._graphs_refused else ()):
            graph_bytes += self.profile_graphs(kv_groups, verify_sizes, max_model_len=max_model_len,
                                               query_len=q, tree=tree)
        free_after, _ = platform.free_memory_bytes(device)
        in_use = total - min(free, free_after)
        budget = profiled_kv_budget(total, self.config.gpu_memory_utilization, in_use, activations, graph_bytes)
        log.info("rank %d: KV budget %.2f GiB = %.2f GiB x %.2f - %.2f GiB in use - %.2f GiB activation peak "
                 "- %.2f GiB CUDA graphs (%d sizes)", self.rank, budget / 2**30, total / 2**30,
                 self.config.gpu_memory_utilization, in_use / 2**30, activations / 2**30,
                 graph_bytes / 2**30, len(sizes))
        return budget

    def profile_graphs(self, kv_groups, sizes: list[int], *, max_model_len: int, capture: bool | None = None,
                       query_len: int = 1, tree: bool = False) -> int:
        """Bytes the graphs of `sizes` (decode, or verification steps of `query_len` tokens per
        sequence) will take, measured before the KV pools exist: the
        largest size captured over a one-block pool, then the smallest into the same graph pool
        (runtime/kv_cache.py's graph_memory_estimate extrapolates to every size). capture=False
        runs the two forwards eagerly instead (the CPU twin; nothing to measure there). A capture
        that fails here is counted and logged once, and the real capture is not tried."""
        from kvserve.runtime.executor.cuda_graphs import DecodeGraphs

        capture = self.platform.supports_cuda_graphs if capture is None else capture
        device, platform = self.device, self.platform
        pools = allocate_kv_cache(self.model_config.shape, 1, self.config.block_size, self.kv_cache_dtype, device,
                                  self.world_size)
        windows = None if kv_groups is None else [g.window for g in kv_groups]
        measured, pool, kept = [], None, []
        free = self._free_bytes()
        try:
            for size in sorted({max(sizes), min(sizes)}, reverse=True):
                graphs = DecodeGraphs(self.model, pools, block_size=self.config.block_size,
                                      max_model_len=max_model_len, sizes=[size], device=device, capture=capture,
                                      kv_group_windows=windows, pool=pool, query_len=query_len, tree=tree)
                with torch.inference_mode():
                    graphs.capture()
                    if not capture:
                        graphs._forward(size)
                pool = graphs.pool
                kept.append(graphs)  # alive until both are measured: what they hold stays allocated
                now = self._free_bytes()
                measured.append(max(0, free - now))
                free = now
        except Exception:
            self._capture_failed("the KV sizing's measuring capture" + ("" if query_len == 1 else
                                                                        f" of {query_len}-token verification steps"))
            if query_len == 1:
                self._graphs_refused = True
            else:
                self._verify_graphs_refused = True
            measured = []
        finally:
            del kept, pools, pool
            platform.release_memory()
        if not measured:
            return 0
        return graph_memory_estimate(measured[0], measured[1] if len(measured) > 1 else measured[0], len(sizes))

    def _free_bytes(self) -> int:
        got = self.platform.free_memory_bytes(self.device)
        return 0 if got is None else got[0]

    def _capture_failed(self, what: str) -> None:
        # Every rank fails alike (same model, same sizes), so they all stay eager together.
        self.graph_capture_failures += 1
        log.exception("rank %d: CUDA graph capture failed (%s); those steps run eagerly", self.rank, what)

    @torch.inference_mode()
    def profile_run(self, kv_groups, num_tokens: int) -> None:
        """A forward pass of `num_tokens` prompt tokens (split into one-block sequences over a
        one-block pool that nothing writes: slot -1) and the logits of max_num_seqs rows: the
        activation peak of the largest step the scheduler may send."""
        from kvserve.runtime.attention.backend import AttentionMetadata

        bs, dev = self.config.block_size, self.device
        lens = [bs] * (num_tokens // bs) + ([num_tokens % bs] if num_tokens % bs else [])
        pools = allocate_kv_cache(self.model_config.shape, 1, bs, self.kv_cache_dtype, dev, self.world_size)
        starts = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        meta = AttentionMetadata(query_start_loc=starts.to(dev),
                                 seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                                 block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=dev),
                                 slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=dev),
                                 max_query_len=max(lens), max_seq_len=max(lens), is_decode_only=False)
        if kv_groups is not None:
            meta.kv_groups = {g.window: AttentionMetadata(**{**vars(meta), "kv_groups": None}) for g in kv_groups}
        positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=dev), positions, pools, meta)
        rows = min(self.config.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[:rows])

    def initialize_kv_cache(self, group_blocks: Sequence[int], kv_groups) -> int:
        """Allocates the pools (the block counts every rank agreed on); returns their bytes."""
        self.kv_groups = kv_groups
        layer_blocks = None if kv_groups is None else layer_group_blocks(kv_groups, group_blocks)
        self.kv_caches = allocate_kv_cache(self.model_config.shape, group_blocks[0], self.config.block_size,
                                           self.kv_cache_dtype, self.device, self.world_size,
                                           layer_blocks=layer_blocks)
        if self.config.kv_offload_bytes or self.config.swap_space:
            self.offloader = self._make_offloader()
        return kv_cache_bytes(self.kv_caches)

    @property
    def offload_ranks(self) -> int:
        """How many ranks each hold a part of every offloaded block (each in its own namespace)."""
        return self.world_size

    def offload_namespace(self, rank: int | None = None):
        """The namespace this rank's offloaded blocks live in (runtime/kv_offload/namespace.py):
        keyed by the KV heads it holds, not by the TP degree, so another degree can read them."""
        from kvserve.runtime.kv_offload.heads import head_copy, head_range, kv_head_count
        from kvserve.runtime.kv_offload.namespace import namespace_for

        shape = self.model_config.shape
        groups = self.kv_groups or ()
        pools, _, values = shape.kv_cache_layout(self.world_size)
        layout = {"groups": [[g.window, list(g.layers)] for g in groups],
                  "pools": [pools, kv_head_count(shape), values], "layers": self.model_config.num_layers}
        rank = self.rank if rank is None else rank
        heads = head_range(kv_head_count(shape), self.world_size, rank)
        return namespace_for(self.config, self.model_config, dtype=str(self.dtype).removeprefix("torch."),
                             kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."), heads=heads,
                             layout=repr(layout), copy=head_copy(kv_head_count(shape), self.world_size, rank))

    def offload_block_bytes(self) -> list[int]:
        """Bytes per offloaded block of each group, as the offload manager counts them."""
        return list(self.offloader.block_bytes)

    def offload_geometry(self):
        """How an offloaded block's bytes are laid out (runtime/kv_offload/heads.py)."""
        from kvserve.runtime.kv_offload.heads import HeadGeometry, kv_head_count

        groups = ([g.layers for g in self.kv_groups] if self.kv_groups is not None
                  else [tuple(range(len(self.kv_caches)))])
        pool = self.kv_caches[0][0]
        return HeadGeometry(num_kv_heads=kv_head_count(self.model_config.shape),
                            segments=tuple(sum(len(self.kv_caches[layer]) for layer in g) for g in groups),
                            block_size=pool.shape[1], value_bytes=pool.shape[3] * pool.element_size())

    def _make_offloader(self):
        from kvserve.runtime.kv_offload.offloader import SWAP, TIER, KVOffloader
        from kvserve.runtime.kv_offload.store import FileStore, HostStore

        pin = self.platform.name == "cuda"  # pinned host memory copies at full speed
        stores = {}
        if self.config.kv_offload_bytes:
            if self.config.kv_offload_dir:
                ns = self.offload_namespace()
                # The root holds this pod's ranks' budgets; other namespaces go first when it is
                # over, never this layout's other ranks (they may not have started yet).
                ranks = self.offload_ranks  # every TP (and pipeline) rank of the pod
                # A reshape's transient tier (runtime/engine/reshape_kv.py) lives in RAM for a
                # second: no fsync, and no copy of the old layout's files into its own directory.
                transient = getattr(self.config, "kv_offload_transient", False)
                # (A transient tier's directory is new and holds only the move: never trimmed,
                # which could take the old layout's files the move reads.)
                stores[TIER] = FileStore(self.config.kv_offload_dir, ns,
                                         root_budget_bytes=None if transient else self.config.kv_offload_bytes * ranks,
                                         keep=frozenset(self.offload_namespace(r).dirname for r in range(ranks)),
                                         geometry=self.offload_geometry(), fsync=not transient)
                stores[TIER].migrate = not transient
            else:
                stores[TIER] = HostStore(pin_memory=pin)
        if self.config.swap_space:
            stores[SWAP] = HostStore(pin_memory=pin)
        groups = ([g.layers for g in self.kv_groups] if self.kv_groups is not None
                  else [tuple(range(len(self.kv_caches)))])
        return KVOffloader(self.kv_caches, groups, stores)

    def write_transient_tier(self, ops: list[tuple], directory: str) -> int:
        """Writes pool blocks ("save" ops) into a reshape's transient tier, this rank's heads, before
        the pools go (runtime/engine/reshape_kv.py); returns how many reached their files."""
        from kvserve.runtime.kv_offload.offloader import TIER, KVOffloader
        from kvserve.runtime.kv_offload.store import FileStore

        store = FileStore(directory, self.offload_namespace(), fsync=False, geometry=self.offload_geometry())
        groups = ([g.layers for g in self.kv_groups] if self.kv_groups is not None
                  else [tuple(range(len(self.kv_caches)))])
        offloader = KVOffloader(self.kv_caches, groups, {TIER: store})
        try:
            offloader.apply(ops)
        finally:
            offloader.close()  # waits for the writes
        return len(ops) - offloader.write_errors

    def offload_scan(self) -> list[tuple[bytes, int]]:
        """The persistent tier's blocks every rank holds (the ranks of a pod share its directory),
        least recently written first: what a restarted engine starts its index with."""
        from kvserve.runtime.kv_offload.offloader import TIER
        from kvserve.runtime.kv_offload.store import FileStore

        if self.offloader is None or not getattr(self.offloader.stores.get(TIER), "persistent", False):
            return []
        found = self.offloader.stores[TIER].scan()
        geometry = self.offload_geometry()
        for rank in range(1, self.offload_ranks):
            store = FileStore(self.config.kv_offload_dir, self.offload_namespace(rank), geometry=geometry)
            other = store.readable_keys()
            store.close()
            found = [(k, n) for k, n in found if k in other]
        return found

    def graph_sizes(self) -> tuple[list[int], str | None]:
        """The decode batch sizes this rank captures as CUDA graphs, or ([], why not). Every rank
        decides the same way from the same config, so at tensor parallelism every rank replays a
        graph for the same steps (their collectives pair up)."""
        config = self.config
        if not self.platform.supports_cuda_graphs or config.enforce_eager:
            return [], "eager"
        if self._graphs_refused:
            return [], "capture failed while sizing the KV cache"
        sizes = config.compilation_config.capture_sizes(config.max_num_seqs)
        name = self.attention_backend.name
        why_not = ("no capture sizes" if not sizes
                   else f"the {name} attention backend syncs with the host" if name != "triton" else None)
        return ([], why_not) if why_not else (sizes, None)

    def verify_graph_plan(self, decode_sizes: list[int]) -> dict[int, tuple[list[int], bool]]:
        """Query length -> (batch sizes, tree masks?) of the speculative verification graphs this
        rank captures next to the decode graphs of `decode_sizes` (the same on every rank)."""
        from kvserve.runtime.executor.verify_graphs import (
            verify_capture_sizes,
            verify_query_lens,
            why_no_verify_graphs,
        )

        spec = getattr(self.config, "speculative_config", None)
        if (not decode_sizes or spec is None or self._verify_graphs_refused
                or why_no_verify_graphs(self.model_config)):
            return {}
        max_tokens = self.config.compilation_config.max_capture_size
        plan = {q: (verify_capture_sizes(decode_sizes, q, max_tokens), tree)
                for q, tree in verify_query_lens(spec).items()}
        return {q: entry for q, entry in plan.items() if entry[0]}

    def compile_and_capture(self, *, max_model_len: int) -> None:
        """torch.compile (compilation_config level 3) and CUDA graphs for decode steps and uniform
        speculative verification steps, where the platform has them."""
        config, platform = self.config, self.platform
        cc = config.compilation_config
        if cc.level == 3:
            if platform.supports_compile:
                self.model.forward = torch.compile(self.model.forward, dynamic=True)
            elif self.rank == 0:
                log.warning("compilation_config level 3: torch.compile is used on CUDA only; on the CPU the "
                            "native kernels already fuse each layer's elementwise work")
        sizes, why_not = self.graph_sizes()
        if not sizes:
            if why_not != "eager" and self.rank == 0:
                log.info("CUDA graphs off (%s): decode steps run eagerly", why_not)
            return
        self.graphs = self.build_graphs(sizes, max_model_len=max_model_len, capture=True)
        if self.graphs is not None:
            self.verify_graphs = self.build_verify_graphs(sizes, max_model_len=max_model_len, capture=True)
        else:
            why_not = "capture failed"
        if self.rank == 0 and getattr(self.config, "speculative_config", None) is not None and not self.verify_graphs:
            from kvserve.runtime.executor.verify_graphs import why_no_verify_graphs

            log.info("speculative verification steps run eagerly (%s)",
                     why_no_verify_graphs(self.model_config) or why_not or "no capture sizes")

    def build_graphs(self, sizes: list[int], *, max_model_len: int, capture: bool, query_len: int = 1,
                     tree: bool = False, pool=None):
        """Decode graphs (or verification graphs of `query_len` tokens per sequence) over this
        rank's pools (capture=False: the padded static-buffer path run eagerly, the CPU twin tests
        use). A model whose forward cannot be captured runs eagerly; the failure is logged at
        ERROR with its traceback and counted (graph_capture_failures)."""
        from kvserve.runtime.executor.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self.kv_caches, block_size=self.config.block_size,
                              max_model_len=max_model_len, sizes=sizes, device=self.device, capture=capture,
                              kv_group_windows=None if self.kv_groups is None else [g.window for g in self.kv_groups],
                              pool=pool, query_len=query_len, tree=tree)
        try:
            graphs.capture()
        except Exception:
            what = "decode" if query_len == 1 else f"{query_len}-token verification"
            self._capture_failed(f"{what} batch sizes {sizes}")
            return None
        return graphs

    def build_verify_graphs(self, decode_sizes: list[int], *, max_model_len: int, capture: bool) -> dict:
        """The verification graphs of verify_graph_plan, by query length, in the decode graphs'
        memory pool; a family whose capture fails is left out (its steps run eagerly)."""
        pool = None if self.graphs is None else self.graphs.pool
        built = {}
        for q, (sizes, tree) in self.verify_graph_plan(decode_sizes).items():
            graphs = self.build_graphs(sizes, max_model_len=max_model_len, capture=capture, query_len=q, tree=tree,
                                       pool=pool)
            if graphs is not None:
                built[q] = graphs
                pool = graphs.pool
        return built

    @property
    def verify_graph_replays(self) -> int:
        """Verification steps replayed from graphs (with capture=False: run on the static buffers)."""
        return sum(g.replays for g in self.verify_graphs.values())

    def _graphs_for(self, step: ForwardInput):
        """The graphs that replay this step, or None (it runs eagerly). Read from shapes and host
        flags only: nothing here waits for the device."""
        if step.lora is not None:
            return None
        meta = step.meta
        if meta.is_decode_only:
            graphs = self.graphs
            return graphs if graphs is not None and graphs.bucket(step.input_ids.shape[0]) is not None else None
        if not self.verify_graphs:
            return None
        from kvserve.kernels.short_query_attention import uniform_query_len

        q = uniform_query_len(step.input_ids.shape[0], meta.num_seqs, meta.max_query_len)
        graphs = self.verify_graphs.get(q)
        if (graphs is None or graphs.bucket(meta.num_seqs) is None
                or (meta.tree_masks is not None and not graphs.tree)):
            return None
        return graphs

    # -- every step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, step: ForwardInput) -> torch.Tensor | None:
        """Applies the step's block copies, runs the forward pass and returns the float32 logits
        of `step.logits_rows` (None when the step only fills the cache)."""
        if step.kv_slot_moves and self.rank != 0:  # rank 0 made them when it verified the tree
            from kvserve.runtime.spec_decode.tree_verify import move_slots

            move_slots(self.kv_caches, step.kv_slot_moves)
        if step.kv_ops and self.rank != 0:  # rank 0 applied them while scheduling
            failed = self.offloader.apply(step.kv_ops)
            if failed:
                # Rank 0 read these blocks, this rank cannot (its own file is damaged or gone):
                # computing on with a stale shard would give wrong tokens, so the step fails.
                raise RuntimeError(f"kv offload: rank {self.rank} could not load {len(failed)} block(s) rank 0 "
                                   "loaded; the step's requests are aborted")
        if self.kv_groups is None:
            copy_blocks(self.kv_caches, step.block_copies)
        else:
            copy_group_blocks(self.kv_caches, self.kv_groups, step.block_copies)
        keep = None
        graphs = self._graphs_for(step)
        if graphs is None and step.lora is None and self.verify_graphs and not step.meta.is_decode_only:
            padded = self._pad_for_graphs(step)
            if padded is not None:
                step, keep, graphs = padded
        if graphs is not None:
            # A replayed step's inputs go from the host straight into the graph's static buffers,
            # one copy each; moving them to the device first would copy each of them twice.
            return self._execute(step, graphs, keep)
        step = step.to(self.device)
        if step.lora is None:
            return self._execute(step, None, keep)
        # Adapter steps run eagerly (the graphs were captured without adapter work); the LM head's
        # adapters need the step's layout too, so it stays active until the logits are computed.
        self.lora.begin_step(step.lora, self.device)
        try:
            return self._execute(step, None)
        finally:
            self.lora.end_step()

    def _pad_for_graphs(self, step: ForwardInput):
        """(the step padded to a captured query length, its real rows, the graphs that replay it)
        when that lets a step that does not replay as it is (a uniform tree step of a chain's
        length pads to the tree graph) replay a verification graph, else None. Host tensors only,
        so every rank decides alike."""
        from kvserve.runtime.executor.verify_padding import pad_query_len, pad_step

        meta = step.meta
        families = {q: (g.tree, g.sizes) for q, g in self.verify_graphs.items()}
        q = pad_query_len(meta.max_query_len, meta.num_seqs, meta.tree_masks is not None, families)
        if q is None:
            return None
        padded = pad_step(step, q, self.verify_graphs[q].max_model_len)
        if padded is None:
            return None
        # Eagerly, dummy rows would read past the step's own (narrower) block tables: pad only
        # for a graph, whose static tables are as wide as max_model_len needs.
        graphs = self._graphs_for(padded[0])
        if graphs is None:
            return None
        self.verify_padded_steps += 1
        self.verify_padded_rows += padded[0].input_ids.shape[0] - step.input_ids.shape[0]
        return (*padded, graphs)

    def _execute(self, step: ForwardInput, graphs, keep: torch.Tensor | None = None) -> torch.Tensor | None:
        """The forward pass: replayed from `graphs` (the step's, from _graphs_for) or run eagerly."""
        if graphs is not None:
            hidden = graphs.run(step.input_ids, step.positions, step.meta)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        if keep is not None:  # a padded step: back to the step's own rows (dummy rows dropped)
            keep = keep.to(hidden.device, non_blocking=True)
            hidden = hidden[keep]
            if self.model.aux_hidden_layers:
                self.model.aux_hidden = [a[keep] for a in self.model.aux_hidden]
        rows = step.logits_rows
        if self.keep_hidden == "all":  # EAGLE writes a draft slot for every computed position
            self.last_hidden = hidden
            self.last_aux_hidden = list(self.model.aux_hidden) if self.model.aux_hidden_layers else []
        if not rows:
            if self.keep_hidden != "all":
                self.last_hidden, self.last_aux_hidden = None, []
            return None
        if len(rows) != hidden.shape[0]:
            index = torch.tensor(rows, device=hidden.device)
            hidden = hidden[index]
        else:
            index = None
        if self.keep_hidden is True:
            self.last_hidden = hidden
            aux = self.model.aux_hidden if self.model.aux_hidden_layers else []
            self.last_aux_hidden = [a if index is None else a[index] for a in aux]
        if step.lora is not None:
            self.lora.set_logits_rows(rows)
        return self.model.compute_logits(hidden)

    def close(self) -> None:
        """Drops the graphs, pools and weights and hands their memory back (a later engine in this
        process sizes its KV cache from what is really free)."""
        self.graphs = None
        self.verify_graphs = {}
        if self.offloader is not None:
            self.offloader.close()  # queued writes reach the disk first
            self.offloader = None
        self.kv_caches = []
        self.model = None
        if not release_is_held():  # else the caller closing several engines releases once
            self.platform.release_memory()
