"""One rank of a pipeline-parallel group: a tensor-parallel shard of one stage's layers.

Ranks are laid out stage-major: global rank ``r`` is stage ``r // tp``, tensor-parallel rank
``r % tp`` within it, so global rank 0 (the engine's own process) is stage 0's first shard. Each
stage's TP ranks get their own process group for the layers' all-reduces and the head's
all-gather (runtime/models/layers.py ``set_tp_group``); activations cross stages point to point
on the world group: TP rank t of stage s sends (hidden, residual), stacked into one tensor, to TP
rank t of stage s + 1 (after a row-parallel layer every TP rank holds the whole activation, so
each pair carries a full copy and no stage needs a gather). The last stage's first shard samples
the step's rows and sends only the tokens to rank 0: the argmax ids of an all-greedy step
(ForwardInput.greedy_ids, 8 bytes a row), or otherwise the result of rank 0's own sampler run on
the last stage with the rows rank 0 described (ForwardInput.stage_rows, stage_sampling.py:
seeded generator states, penalties' tokens, the grammar bitmask go out, tokens, logprobs and
the advanced states come back). Speculative verification steps send the float32 logits and rank
0 verifies. Scheduling, grammars and stop checks stay on rank 0, so structured outputs,
speculative decoding, penalties and n > 1 need nothing else stage-specific.

Every rank receives the same ForwardInput from rank 0 (the executor broadcasts it as it does at
TP), so a stage knows each step's token count and rows before anything arrives: the receive
buffers are sized from it, and there is no shape exchange.

Several steps may be in flight (the engine's micro-batches, runtime/engine/core.py): rank 0's
``launch`` runs stage 0 and sends the activations on without waiting for them to be taken
(``isend``), then returns; ``land`` receives the step's result. So stage 0 runs micro-batch k + 1
while the later stages run k. Every stage takes the steps in launch order (each rank reads them
from one pipe); the last stage sends each result without waiting for rank 0 to take it, and rank
0 posts the receives when it lands the steps, in the same order, so every message on a channel
matches the receive posted for it without tags (NCCL has none). Other ranks run each step whole
(``execute_model``). The time rank 0 waits for a step's result over that plus its stage's compute
is its idle share, the bubble (``last_bubble``).

Each stage holds only its layers' weights (the loader skips other stages' tensors) and KV pools
(its layers' pools of the agreed block count; block ids mean the same slots on every stage, so
the block manager on rank 0 serves all of them).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.runtime.capacity.pipeline import layer_shape, split_layers
from kvserve.runtime.executor.forward_input import ForwardInput
from kvserve.runtime.executor.worker import Worker
from kvserve.runtime.kv_cache import allocate_kv_cache, copy_blocks, determine_num_blocks, kv_cache_bytes
from kvserve.runtime.sampler import argmax_last

log = logging.getLogger(__name__)


def stage_ranges(config, model_config) -> list[tuple[int, int]]:
    """The layer range of every stage, balanced by the capacity model (weights per GPU)."""
    # Weights and vocabulary share one dtype, so its size does not move the split: 2 bytes.
    return split_layers(model_config.shape, config.pipeline_parallel_size, tp=config.tensor_parallel_size)


@dataclass(eq=False)
class _InFlight:
    """Rank 0's handle of a launched step: what comes back for it, received when it lands."""

    step: ForwardInput  # its logits_rows, greedy_ids and stage_rows say what arrives
    busy: float  # seconds stage 0 spent on the step


class PipelineWorker(Worker):
    """A Worker whose model is one stage's layers; `rank` and `world_size` are global."""

    def __init__(self, config, model_config, *, device: torch.device, dtype: torch.dtype, rank: int = 0,
                 world_size: int = 1, quant_config=None) -> None:
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if world_size != tp * pp:
            raise ValueError(f"pipeline worker: world size {world_size} is not tensor_parallel_size {tp} x "
                             f"pipeline_parallel_size {pp}")
        super().__init__(config, model_config, device=device, dtype=dtype, rank=rank % tp, world_size=tp,
                         quant_config=quant_config)
        self.global_rank, self.tp, self.pp = rank, tp, pp
        self.stage = rank // tp
        self.ranges = stage_ranges(config, model_config)
        self.layer_start, self.layer_end = self.ranges[self.stage]
        self.stage_shape = layer_shape(model_config.shape, self.layer_start, self.layer_end)
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self.prev_rank = rank - tp if not self.first else None
        self.next_rank = rank + tp if not self.last else None
        # The rank that sends the sampled rows' logits to rank 0: the last stage's first shard.
        self.logits_rank = (pp - 1) * tp
        self.last_bubble: float | None = None
        # Steps whose tokens the last stage picked (ForwardInput.greedy_ids) or sampled
        # (ForwardInput.stage_rows), counted on rank 0; the second count is the latter alone.
        self.steps_sampled_on_last_stage = 0
        self.steps_with_stage_rows = 0
        self._send = None  # the activations' latest isend (its work, its tensor kept alive)
        self._results_out = collections.deque()  # last stage: its sends to rank 0 in flight
        self._stage_sampler = None  # last stage: samples with its own generator for unseeded rows
        # Medusa / EAGLE heads (on rank 0) read the last stage's hidden rows: pipeline_hidden.py.
        from kvserve.runtime.executor.pipeline_hidden import keep_hidden_mode

        self.keep_hidden = keep_hidden_mode(config)
        self.hidden_sends: list = []

    def load_model(self) -> None:
        import torch.distributed as dist

        from kvserve.runtime.attention.selector import get_attention_backend
        from kvserve.runtime.models import layers, load_model

        if self.tp > 1:
            # new_group is collective over the world: every rank creates every stage's group, in order.
            groups = [dist.new_group(list(range(s * self.tp, (s + 1) * self.tp))) for s in range(self.pp)]
            layers.set_tp_group(groups[self.stage])
        else:
            layers.set_tp_group(None)
        self.attention_backend = get_attention_backend(self.config.attention_backend, self.device)
        self.model = load_model(self.config.model, dtype=self.dtype, device=self.device,
                                attention_backend=self.attention_backend, config=self.model_config,
                                tp_rank=self.rank, tp_size=self.world_size,
                                quantization=self.quant_config if self.quant_config is not None
                                else self.config.quantization,
                                layer_range=(self.layer_start, self.layer_end))
        if getattr(self.config, "speculative_config", None) is not None:
            from kvserve.runtime.spec_decode.eagle import eagle3_target_layers

            # Every stage keeps the EAGLE-3 layers it holds (stage_forward captures them).
            self.model.aux_hidden_layers = eagle3_target_layers(self.config, self.model_config.num_layers)
        log.info("pipeline stage %d/%d (rank %d): layers %d..%d", self.stage, self.pp, self.global_rank,
                 self.layer_start, self.layer_end - 1)
        self._attach_lora()  # this stage's layers, under their global indices

    def close(self) -> None:
        from kvserve.runtime.models import layers

        super().close()
        # The stage group dies with the process group; a later engine in this process must not
        # reduce over it.
        layers.set_tp_group(None)

    def determine_kv_blocks(self, kv_groups, *, max_model_len: int, max_step_tokens: int) -> list[int]:
        """Blocks this stage's budget holds for its own layers (so a stage of fewer layers holds
        more; rank 0 takes the smallest count over all stages). With KV cache groups, per group,
        split over the groups this stage holds layers of (pipeline_kv_groups.py)."""
        budget = None
        config = self.config
        if (self.platform.free_memory_bytes(self.device) is not None and config.num_kv_blocks is None
                and config.kv_cache_memory_bytes is None):
            budget = self._profiled_kv_budget(kv_groups, max_step_tokens, max_model_len)
        if kv_groups is not None:
            from kvserve.runtime.executor.pipeline_kv_groups import stage_group_blocks

            return stage_group_blocks(config, self.stage_shape, self.kv_cache_dtype, self.device, kv_groups,
                                      self.layer_start, self.layer_end, max_model_len=max_model_len,
                                      max_step_tokens=max_step_tokens, budget_bytes=budget)
        return [determine_num_blocks(config, self.stage_shape, self.kv_cache_dtype, self.device, budget_bytes=budget)]

    @torch.inference_mode()
    def profile_run(self, kv_groups, num_tokens: int) -> None:
        """The activation peak of the largest step through this stage's layers alone."""
        from kvserve.runtime.attention.backend import AttentionMetadata
        from kvserve.runtime.models.pipeline_stage import stage_forward

        bs, dev = self.config.block_size, self.device
        lens = [bs] * (num_tokens // bs) + ([num_tokens % bs] if num_tokens % bs else [])
        pools = allocate_kv_cache(self.stage_shape, 1, bs, self.kv_cache_dtype, dev, self.world_size)
        starts = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        meta = AttentionMetadata(query_start_loc=starts.to(dev),
                                 seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                                 block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=dev),
                                 slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=dev),
                                 max_query_len=max(lens), max_seq_len=max(lens), is_decode_only=False)
        if kv_groups is not None:
            meta.kv_groups = {g.window: AttentionMetadata(**{**vars(meta), "kv_groups": None}) for g in kv_groups}
        positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
        hidden = residual = None
        if not self.first:
            hidden = torch.zeros(num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=dev)
            residual = torch.zeros_like(hidden)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        hidden, _ = stage_forward(self.model, ids, positions, pools, meta, hidden, residual)
        if self.last:
            self.model.compute_logits(hidden[:min(self.config.max_num_seqs, num_tokens)])

    def initialize_kv_cache(self, group_blocks: Sequence[int], kv_groups) -> int:
        layer_blocks = None
        self.kv_groups = None
        self.model_kv_groups = kv_groups  # the whole model's, for other stages' offload layouts
        if kv_groups is not None:
            from kvserve.runtime.executor.pipeline_kv_groups import local_groups
            from kvserve.runtime.kv_cache import layer_group_blocks

            # The model's groups, in order, with this stage's layers renumbered from 0 (a group
            # may have none here): block copies and the pools index the stage's own layer list.
            self.kv_groups = local_groups(kv_groups, self.layer_start, self.layer_end)
            layer_blocks = layer_group_blocks(self.kv_groups, group_blocks)
        self.kv_caches = allocate_kv_cache(self.stage_shape, group_blocks[0], self.config.block_size,
                                           self.kv_cache_dtype, self.device, self.world_size,
                                           layer_blocks=layer_blocks)
        if self.config.kv_offload_bytes or self.config.swap_space:
            # Each rank offloads its own stage's layers (and TP shard) of every block, in its own
            # namespace: rank 0's block manager decides for all, as at tensor parallelism.
            self.offloader = self._make_offloader()
        return kv_cache_bytes(self.kv_caches)

    @property
    def offload_ranks(self) -> int:
        return self.tp * self.pp

    def offload_namespace(self, rank: int | None = None):
        """Global rank `rank`'s namespace: its stage's layer range and pool shape are part of it, so
        a stage never reads another's blocks and a new split (another P) starts cold; its KV heads
        (its rank within the stage's TP group) are too, as without pipeline parallelism."""
        from kvserve.runtime.kv_offload.heads import head_copy, head_range, kv_head_count
        from kvserve.runtime.kv_offload.namespace import namespace_for

        rank = self.global_rank if rank is None else rank
        start, end = self.ranges[rank // self.tp]
        shape = layer_shape(self.model_config.shape, start, end)
        pools, _, values = shape.kv_cache_layout(self.world_size)
        layout = {"groups": [[g.window, list(g.layers)] for g in self._stage_groups(start, end)],
                  "pools": [pools, kv_head_count(shape), values], "layers": [start, end]}
        heads = head_range(kv_head_count(shape), self.tp, rank % self.tp)
        return namespace_for(self.config, self.model_config, dtype=str(self.dtype).removeprefix("torch."),
                             kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."), heads=heads,
                             layout=repr(layout), copy=head_copy(kv_head_count(shape), self.tp, rank % self.tp))

    def _stage_groups(self, start: int, end: int) -> tuple:
        """The KV cache groups of the stage holding layers [start, end), renumbered (none: ())."""
        from kvserve.runtime.executor.pipeline_kv_groups import local_groups

        groups = getattr(self, "model_kv_groups", None)
        return () if groups is None else local_groups(groups, start, end)

    def offload_block_bytes(self) -> list[int]:
        """Bytes per offloaded block of each group as rank 0's offload manager counts them against
        the per-rank budget: the most any stage's rank stores (stages hold different layers; a
        stage may hold no layer of a group, which rank 0 alone would count as nothing)."""
        from kvserve.runtime.executor.pipeline_kv_groups import stage_block_bytes

        layer_bytes = sum(pool[0].numel() * pool.element_size() for pool in self.kv_caches[0])
        return stage_block_bytes(self.model_kv_groups, self.ranges, layer_bytes)

    def offload_scan(self) -> list[tuple[bytes, int]]:
        # Sizes as offload_block_bytes counts them (the scan reads rank 0's own files).
        own, counted = self.offloader.block_bytes, self.offload_block_bytes()
        return [(key, counted[key[0]] if key[0] < len(own) and n == own[key[0]] else n)
                for key, n in super().offload_scan()]

    def graph_sizes(self) -> tuple[list[int], str | None]:
        return [], "pipeline parallelism"  # see compile_and_capture

    def compile_and_capture(self, *, max_model_len: int) -> None:
        # A stage's forward pass ends in a send and starts with a receive: neither CUDA graphs
        # (captured around the whole model's forward) nor torch.compile of CausalLM.forward apply.
        if self.global_rank == 0 and (self.config.compilation_config.level == 3 or not self.config.enforce_eager):
            log.info("pipeline parallelism: steps run eagerly (no CUDA graphs or torch.compile per stage yet)")

    @torch.inference_mode()
    def execute_model(self, step: ForwardInput) -> torch.Tensor | None:
        """Runs this stage's part of the step. Rank 0 returns the sampling rows' logits (from the
        last stage); the last stage's ranks return them too; the others return None."""
        t0 = time.perf_counter()
        if step.kv_ops and self.global_rank != 0:  # rank 0 applied them while scheduling
            failed = self.offloader.apply(step.kv_ops)
            if failed:  # a stage computing on without these blocks would give wrong tokens
                raise RuntimeError(f"kv offload: rank {self.global_rank} could not load {len(failed)} block(s) "
                                   "rank 0 loaded; the step's requests are aborted")
        if step.kv_slot_moves and self.global_rank != 0:  # rank 0 made them when it verified a Medusa tree
            from kvserve.runtime.spec_decode.tree_verify import move_slots

            move_slots(self.kv_caches, step.kv_slot_moves)
        self._copy_blocks(step.block_copies)
        step = step.to(self.device)
        if step.lora is None:
            return self._stage_step(step, t0)
        self.lora.begin_step(step.lora, self.device)  # every stage fills its own layers' slots
        try:
            return self._stage_step(step, t0)
        finally:
            self.lora.end_step()

    def _copy_blocks(self, copies) -> None:
        if self.kv_groups is None:
            copy_blocks(self.kv_caches, copies)
        else:
            from kvserve.runtime.kv_cache import copy_group_blocks

            copy_group_blocks(self.kv_caches, self.kv_groups, copies)

    def _stage_step(self, step: ForwardInput, t0: float) -> torch.Tensor | None:
        import torch.distributed as dist

        from kvserve.runtime.executor import pipeline_hidden
        from kvserve.runtime.models.pipeline_stage import stage_forward

        num_tokens = step.input_ids.shape[0]
        hidden = residual = None
        if not self.first:
            buf = torch.empty(2, num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(buf, self.prev_rank)
            hidden, residual = buf[0], buf[1]
        hidden, residual = stage_forward(self.model, step.input_ids if self.first else None, step.positions,
                                         self.kv_caches, step.meta, hidden, residual)
        rows = step.logits_rows
        logits = None
        final = hidden
        if not self.last:
            self._send_on(torch.stack((hidden, residual)))
        elif rows:
            if len(rows) != hidden.shape[0]:
                hidden = hidden[torch.tensor(rows, device=hidden.device)]
            if step.lora is not None:
                self.lora.set_logits_rows(rows)
            logits = self.model.compute_logits(hidden).contiguous()
            if step.greedy_ids:
                logits = argmax_last(logits)  # int64 ids: rank 0's Sampler would pick the same
            if self.global_rank == self.logits_rank and self.global_rank != 0:
                if step.stage_rows is not None:
                    self._send_sample(logits, step)
                else:
                    self._send_to_rank0(logits)
        if self.keep_hidden and self.global_rank != 0:  # after the result: rank 0 receives in that order
            pipeline_hidden.send(self, rows, final if self.last else None)
        if self.global_rank == 0:
            self.steps_sampled_on_last_stage += bool(rows and (step.greedy_ids or step.stage_rows is not None))
            self.steps_with_stage_rows += bool(rows and step.stage_rows is not None)
            busy = time.perf_counter() - t0
            if rows and not self.last:
                logits = self._receive_result(step)
            if self.keep_hidden:
                pipeline_hidden.receive(self, rows, num_tokens)
            # Stage 0's idle share of the step: with one step in flight, about (pp - 1) / pp
            # when the stages are balanced and the transfers are cheap.
            wall = time.perf_counter() - t0
            self.last_bubble = max(0.0, 1.0 - busy / wall) if wall > 0 else 0.0
        return logits


    def _send_on(self, activations: torch.Tensor) -> None:
        """Sends a step's (hidden, residual) to the next stage without waiting for it to be taken
        (a gloo send returns only once the receiver asks for it); one send is outstanding at most."""
        import torch.distributed as dist

        if self._send is not None:
            self._send[0].wait()
        self._send = (dist.isend(activations, self.next_rank), activations)

    def _send_sample(self, logits: torch.Tensor, step: ForwardInput) -> None:
        """Last stage: samples the step's rows as rank 0 would and sends the result: its size,
        then its pickled bytes."""
        from kvserve.runtime.executor import stage_sampling

        if self._stage_sampler is None:
            from kvserve.runtime.sampler import Sampler

            self._stage_sampler = Sampler(torch.Generator(device=logits.device).manual_seed(self.config.seed + 1))
        data = stage_sampling.encode(stage_sampling.sample_on_stage(logits, step.stage_rows, self._stage_sampler))
        data = data.to(self.device)
        self._send_to_rank0(torch.tensor([data.numel()], dtype=torch.long, device=self.device))
        self._send_to_rank0(data)

    def _send_to_rank0(self, tensor: torch.Tensor) -> None:
        """Last stage: sends a step's result to rank 0 without waiting for rank 0 to take it (it
        does when it lands that step, after launching later ones): the stage goes on to its next
        step at once. Every result travels in step order on one channel, so each receive rank 0
        posts matches its own message without tags (NCCL has none)."""
        import torch.distributed as dist

        while self._results_out and self._results_out[0][0].is_completed():
            self._results_out.popleft()
        if len(self._results_out) >= 8:  # rank 0 is far behind: wait for the oldest
            self._results_out.popleft()[0].wait()
        self._results_out.append((dist.isend(tensor, 0), tensor))

    def _receive_result(self, step: ForwardInput):
        """Rank 0: the step's result from the last stage: token ids, logits, or a StageSample
        (its size first, then its bytes)."""
        import torch.distributed as dist

        from kvserve.runtime.executor import stage_sampling

        head = self._logits_buffer(step)
        dist.recv(head, self.logits_rank)
        if step.stage_rows is None:
            return head
        data = torch.empty(int(head.item()), dtype=torch.uint8, device=self.device)
        dist.recv(data, self.logits_rank)
        return stage_sampling.decode(data)

    def _logits_buffer(self, step: ForwardInput) -> torch.Tensor:
        n = len(step.logits_rows)
        if step.stage_rows is not None:
            return torch.empty(1, dtype=torch.long, device=self.device)  # the size of the sampled rows' bytes
        if step.greedy_ids:
            return torch.empty(n, dtype=torch.long, device=self.device)
        return torch.empty(n, self.model_config.vocab_size, dtype=torch.float32, device=self.device)

    @torch.inference_mode()
    def launch(self, step: ForwardInput) -> _InFlight:
        """Rank 0, pipelined: runs stage 0 of the step and sends the activations on without
        waiting for the next stage to take them; ``land`` receives the step's result."""
        from kvserve.runtime.models.pipeline_stage import stage_forward

        assert self.global_rank == 0 and not self.last
        t0 = time.perf_counter()
        self._copy_blocks(step.block_copies)
        step = step.to(self.device)
        if step.lora is not None:
            # The step's own adapter layout and slot loads: every stage applies them in launch
            # order, so a slot rank 0 gives a new adapter for this micro-batch still holds the old
            # one on a later stage until that stage has finished the earlier micro-batches.
            self.lora.begin_step(step.lora, self.device)
        try:
            hidden, residual = stage_forward(self.model, step.input_ids, step.positions, self.kv_caches, step.meta,
                                             None, None)
        finally:
            if step.lora is not None:
                self.lora.end_step()
        self._send_on(torch.stack((hidden, residual)))
        return _InFlight(step, time.perf_counter() - t0)

    def land(self, pending: _InFlight) -> torch.Tensor | None:
        """Waits for a launched step's result (steps land in launch order): token ids when the
        last stage took the argmax, a StageSample when it sampled, logits otherwise."""
        step, result = pending.step, None
        t0 = time.perf_counter()
        if step.logits_rows:
            result = self._receive_result(step)
            self.steps_sampled_on_last_stage += bool(step.greedy_ids or step.stage_rows is not None)
            self.steps_with_stage_rows += step.stage_rows is not None
        idle = time.perf_counter() - t0
        total = idle + pending.busy
        self.last_bubble = idle / total if total > 0 else 0.0
        return result


def check_pipeline_parallel(model_config, pp: int) -> None:
    """Raises ValueError when the model cannot be split into `pp` stages (before any process starts)."""
    from kvserve.runtime.capacity.pipeline import pipeline_error

    error = pipeline_error(model_config.shape, pp)
    if error:
        raise ValueError(error)
