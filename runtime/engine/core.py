"""EngineCore: one step is ``scheduler.schedule()`` -> ``executor.execute_model()`` ->
``scheduler.update_from_output()``.

The core owns the queue of admitted requests, the scheduler and the KV block manager; the
executor owns the model, the KV pools and everything on the device (runtime/executor/, or the
in-process executor of llm_engine.py). Requests arrive checked (runtime/engine/input_processor.py);
token updates leave for the output processor.

With async scheduling (`overlap`), the forward pass of step N+1 runs in a second thread while
this one turns step N's tokens into outputs and the caller streams them. Scheduling still waits
for step N's tokens, so every decision (and every output) is the one the synchronous loop makes.

Pipelined (`executor.max_concurrent_batches` > 1: pipeline parallelism, one micro-batch per
stage), up to that many steps are in flight at once, a queue of launched steps: while the last
stages run micro-batch k, stage 0 (this process) already runs micro-batch k + 1. A sequence is in
at most one micro-batch in flight (the scheduler skips and never preempts those), and each
micro-batch takes about 1/depth of the live sequences, so decoding sequences alternate between
the batches. Each stage runs the micro-batches in launch order, so KV blocks freed by an abort
while their step is in flight are written by that step before any later step reuses them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.runtime.engine.block_manager import BlockManager
from kvserve.runtime.engine.kv_cache_groups import KVCacheCoordinator, KVCacheGroup
from kvserve.runtime.engine.request import Request
from kvserve.runtime.engine.scheduler import (
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepUpdate,
)
from kvserve.runtime.engine.sequence import Sequence, SequenceStatus
from kvserve.runtime.sampler import SamplerOutput, SamplingRow
from kvserve.runtime.stats import StatsCollector

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvserve.runtime.sampling_params import SamplingParams


@dataclass(eq=False)
class ModelInput:
    """What the executor needs for one step, built right after scheduling."""

    scheduled: list[ScheduledSequence]
    # Per scheduled item: its block table, or with KV cache groups a tuple of one per group.
    # Copies: an abort between steps frees (and edits) a live table while an overlapped forward
    # pass may still read it.
    block_tables: list
    rows: list[SamplingRow]  # the sampling rows, in schedule order
    repeats: list[int]  # sampling rows per sampling item (n > 1: 1 + the unforked samples)


class Executor(Protocol):
    """The model-execution side, as the core sees it (the seam with runtime/executor/)."""

    kv_groups: tuple[KVCacheGroup, ...] | None  # None: one block table serves every layer
    num_blocks_per_group: list[int]
    block_size: int
    kv_release_window: int | None  # every layer slides: blocks behind it may go back
    supports_overlap: bool  # may execute_model run in a second thread?
    # Steps that may be in flight at once (launch_model / land_model); 1: execute_model only.
    max_concurrent_batches: int
    last_timings: tuple[float, float, float] | None  # (prepare, forward, sample) of the latest step

    def propose_drafts(self, running: list[Sequence],
                       params_of: Callable[[Sequence], SamplingParams | None]) -> None: ...

    def execute_model(self, model_input: ModelInput) -> SamplerOutput: ...

    def launch_model(self, model_input: ModelInput) -> Any: ...

    def land_model(self, pending: Any) -> SamplerOutput: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


@dataclass(eq=False)
class _Step:
    """One scheduled step on its way through the core (and, overlapped, the forward thread)."""

    sched: SchedulerOutput
    model_input: ModelInput
    t_start: float
    t_scheduled: float
    t_execute: float
    t_executed: float = 0.0
    timings: tuple[float, float, float] | None = None
    future: concurrent.futures.Future | None = None
    pending: Any = None  # pipelined: the executor's handle of the launched step

    def without_finished(self, result: SamplerOutput) -> tuple[SchedulerOutput, SamplerOutput]:
        """The step and its sampled rows without the sequences that finished meanwhile."""
        tokens, logprobs, live = [], [], []
        k = 0
        repeats = iter(self.model_input.repeats)
        for item in self.sched.scheduled:
            n = next(repeats) if item.samples else 0
            if not item.seq.status.finished:
                live.append(item)
                tokens += result.token_ids[k:k + n]
                logprobs += result.logprobs[k:k + n]
            k += n
        return dataclasses.replace(self.sched, scheduled=live), SamplerOutput(tokens, logprobs)


@dataclass
class CoreStep:
    """A finished step, for the output processor."""

    update: StepUpdate
    now: float
    step: _Step
    bookkeeping: float  # seconds the core spent taking the step's tokens


class EngineCore:
    def __init__(self, scheduler_config: SchedulerConfig, executor: Executor, *, enable_prefix_caching: bool,
                 async_scheduling: bool, stats: StatsCollector,
                 attach_grammar: Callable[[Request, Any], None] | None = None) -> None:
        self.executor = executor
        self._attach_grammar = attach_grammar
        self._awaiting_grammar: dict[str, Request] = {}
        if executor.kv_groups is not None:
            self.block_manager = KVCacheCoordinator(executor.kv_groups, executor.num_blocks_per_group,
                                                    executor.block_size, enable_caching=enable_prefix_caching)
        else:
            self.block_manager = BlockManager(executor.num_blocks_per_group[0], executor.block_size,
                                              enable_caching=enable_prefix_caching,
                                              sliding_window=executor.kv_release_window)
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        self.requests: dict[str, Request] = {}  # request id -> its sample 0
        self._by_seq: dict[int, Request] = {}  # seq id -> the sample it belongs to
        self._stats = stats
        self.overlap = async_scheduling and executor.supports_overlap
        self._forward_pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-forward")
                              if self.overlap else None)
        self._inflight: _Step | None = None
        self.depth = max(1, getattr(executor, "max_concurrent_batches", 1))
        if self.depth > 1:
            self.overlap = False  # the micro-batches in flight overlap the stages instead
        self._queue: deque[_Step] = deque()  # pipelined: launched steps, oldest first
        # Requests ended by a failed forward pass, for the output side to report as aborted.
        self.failed: list[Request] = []
        self.offload = None  # the offload tier's OffloadManager, once attached

    def attach_offload(self, offload) -> None:
        """Connects an OffloadManager (runtime/kv_offload/manager.py) to the block managers'
        hooks and the scheduler."""
        self.offload = offload
        bm = self.block_manager
        for group, manager in enumerate(bm.managers if isinstance(bm, KVCacheCoordinator) else [bm]):
            manager.tier_lookup = offload.tier_lookup(group)
            manager.on_evict = offload.on_evict(group, manager.stored_meta.get)
        self.scheduler.offload = offload

    def save_cached_blocks(self) -> int:
        """Copies every cached pool block into the offload tier (a persistent tier at shutdown)."""
        if self.offload is None:
            return 0
        bm = self.block_manager
        managers = bm.managers if isinstance(bm, KVCacheCoordinator) else [bm]
        return self.offload.save_cached([m.cached for m in managers], [m.stored_meta.get for m in managers])

    # -- requests --------------------------------------------------------------------------------
    def add(self, heads: list[Request]) -> None:
        """Queues checked requests (runtime/engine/input_processor.py); cannot fail."""
        for head in heads:
            self.requests[head.request_id] = head
            for s in head.samples:
                self._by_seq[s.seq.seq_id] = s
            if head.pending_grammar is not None:
                self._awaiting_grammar[head.request_id] = head
            else:
                self.scheduler.add(head.seq)

    def _admit_compiled(self) -> None:
        """Moves requests whose grammar finished compiling into the scheduler; one whose grammar
        failed ends with finish_reason "abort" (the server compiles first and answers 400)."""
        if not self._awaiting_grammar:
            return
        if not self.scheduler.has_unfinished():
            # Nothing else to run: wait a little for a compile rather than spin the caller's loop.
            concurrent.futures.wait([h.pending_grammar for h in self._awaiting_grammar.values()], timeout=0.01,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for request_id, head in list(self._awaiting_grammar.items()):
            fut = head.pending_grammar
            if not fut.done():
                continue
            del self._awaiting_grammar[request_id]
            head.pending_grammar = None
            exc = fut.exception()
            if exc is not None:
                log.warning("request %s: %s", request_id, exc)
                self.failed.append(self.abort(request_id))
                continue
            self._attach_grammar(head, fut.result())
            self.scheduler.add(head.seq)

    def abort(self, request_id: str) -> Request | None:
        """Ends a request at once and frees its blocks; returns its sample 0 (None if unknown)."""
        head = self.requests.pop(request_id, None)
        if head is None:
            return None
        self._awaiting_grammar.pop(request_id, None)
        for s in head.samples:
            if s.finish_reason is None:
                self.scheduler.finish(s.seq, SequenceStatus.FINISHED_ABORTED)
                s.finish_reason = "abort"
            self._by_seq.pop(s.seq.seq_id, None)
        head.unforked = []
        head.metrics.finished_time = StatsCollector.now()
        self._stats.request_success_total["abort"] += 1
        return head

    @property
    def busy(self) -> bool:
        return bool(self.requests) or self._inflight is not None or bool(self._queue)

    # -- one iteration ---------------------------------------------------------------------------
    def step(self) -> CoreStep | None:
        """Runs a step (overlapped: finishes the one in flight and launches the next); returns
        what the finished step did, or None when no step finished."""
        self._admit_compiled()
        if self.overlap:
            return self._step_overlapped()
        if self.depth > 1:
            return self._step_pipelined()
        begun = self._begin_step()
        if begun is None:
            return None
        result = self._run_step(begun)
        return self._finish_step(begun, result)

    def _step_overlapped(self) -> CoreStep | None:
        done, self._inflight = self._inflight, None
        finished = None
        if done is not None:
            try:
                result = done.future.result()
            except Exception:
                self._fail_step(done.sched)
                raise
            finished = self._finish_step(done, result)
        begun = self._begin_step()
        if begun is not None:
            # The forward thread reads only what _begin_step built (copied block tables, rows) and
            # the sequences' token lists, which this thread does not touch until the next join.
            begun.future = self._forward_pool.submit(self._run_step, begun)
            self._inflight = begun
        return finished

    def _step_pipelined(self) -> CoreStep | None:
        """Launches a micro-batch while fewer than `depth` are in flight and there is one to run;
        otherwise lands the oldest (waiting for its tokens) and returns what it did."""
        if len(self._queue) < self.depth:
            begun = self._begin_step(pipelined=True)
            if begun is not None:
                try:
                    begun.pending = self.executor.launch_model(begun.model_input)
                except Exception:
                    self._fail_queued(begun)
                    raise
                self._queue.append(begun)
                if len(self._queue) < self.depth:
                    return None
        return self._land_oldest() if self._queue else None

    def _land_oldest(self) -> CoreStep:
        """Waits for the oldest micro-batch in flight and finishes it."""
        done = self._queue.popleft()
        try:
            result = self.executor.land_model(done.pending)
        except Exception:
            self._fail_queued(done)
            raise
        done.timings = self.executor.last_timings
        done.t_executed = time.perf_counter()
        return self._finish_step(done, result)

    def _fail_queued(self, failed: _Step) -> None:
        """A launch or landing raised (the executor is torn down): every step in flight fails."""
        steps, self._queue = [failed, *self._queue], deque()
        for step in steps:
            self._fail_step(step.sched)

    def _micro_batch_cap(self) -> int:
        """Sequences per micro-batch: the live ones (up to max_num_seqs) split over the depth."""
        sched = self.scheduler
        live = min(len(sched.running) + len(sched.waiting), sched.config.max_num_seqs)
        return max(1, math.ceil(live / self.depth))

    def _begin_step(self, pipelined: bool = False) -> _Step | None:
        t_start = time.perf_counter()
        self.executor.propose_drafts(self.scheduler.running, self._params_of)
        if pipelined:
            in_flight = {item.seq.seq_id for step in self._queue for item in step.sched.scheduled}
            sched = self.scheduler.schedule(in_flight, self._micro_batch_cap())
        else:
            sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        t_scheduled = time.perf_counter()
        now = StatsCollector.now()
        by_seq = self._by_seq
        rows, repeats = [], []
        for item in sched.scheduled:
            req = by_seq[item.seq.seq_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                self._stats.queue_times.append(now - req.metrics.arrival_time)
            if item.samples:
                # Sample 0's first token comes with every other sample's, from the same logits.
                rows.append(req.row)
                rows.extend(s.row for s in req.unforked)
                repeats.append(1 + len(req.unforked))
        bm = self.block_manager
        if self.executor.kv_groups is not None:
            tables = [bm.group_tables(item.seq.seq_id) for item in sched.scheduled]
        else:
            tables = [list(bm.block_tables[item.seq.seq_id]) for item in sched.scheduled]
        model_input = ModelInput(sched.scheduled, tables, rows, repeats)
        return _Step(sched, model_input, t_start, t_scheduled, time.perf_counter())

    def _run_step(self, step: _Step) -> SamplerOutput:
        try:
            result = self.executor.execute_model(step.model_input)
        except Exception:
            if not self.overlap:
                self._fail_step(step.sched)
            raise
        step.timings = self.executor.last_timings
        step.t_executed = time.perf_counter()
        return result

    def _finish_step(self, step: _Step, result: SamplerOutput) -> CoreStep:
        t_joined = time.perf_counter()
        sched = step.sched
        if (self.overlap or self.depth > 1) and any(item.seq.status.finished for item in sched.scheduled):
            # Requests aborted while the forward pass ran: their tokens are dropped.
            sched, result = step.without_finished(result)
        update = self.scheduler.update_from_output(sched, result, self._by_seq)
        if self.offload is not None and step.t_executed > step.t_execute:
            # What recomputing costs here, for the swap-or-recompute choice.
            self.offload.observe_prefill(sched.num_batched_tokens, step.t_executed - step.t_execute)
        self._stats.computed_tokens_total += sched.num_batched_tokens
        for su in update.samples:
            head = su.req.head
            if su.finished and head.all_finished and self.requests.pop(head.request_id, None) is not None:
                for s in head.samples:
                    self._by_seq.pop(s.seq.seq_id, None)
        return CoreStep(update, StatsCollector.now(), step, time.perf_counter() - t_joined)

    def _params_of(self, seq: Sequence) -> SamplingParams | None:
        req = self._by_seq.get(seq.seq_id)
        return None if req is None else req.params

    def _fail_step(self, sched: SchedulerOutput) -> list[Request]:
        """A forward pass raised: end the step's requests (their cache state is unknown)."""
        failed = []
        for item in sched.scheduled:
            head = self.abort(item.seq.request_id)
            if head is not None:
                failed.append(head)
        self.failed.extend(failed)
        return failed

    # -- reshape: requests leave this core for another (runtime/engine/data_parallel.py) --------
    def finish_inflight(self) -> CoreStep | None:
        """Overlapped: joins the step in flight without launching another (a reshape needs the
        core still); what it did goes to the output side like any finished step."""
        if self._queue:  # pipelined: the oldest; the caller repeats until None
            return self._land_oldest()
        done, self._inflight = self._inflight, None
        if done is None:
            return None
        try:
            result = done.future.result()
        except Exception:
            self._fail_step(done.sched)
            raise
        return self._finish_step(done, result)

    def detach_all(self) -> list[Request]:
        """Takes every unfinished request out, oldest first, as it would come back from a
        preemption by recompute: its KV blocks freed, its tokens kept, so another core (another
        layout) prefills them again and goes on. The core is left empty. No step may be in flight."""
        assert self._inflight is None and not self._queue, "finish_inflight() first"
        heads = list(self.requests.values())
        sched, bm = self.scheduler, self.block_manager
        for head in heads:
            for s in head.samples:
                seq = s.seq
                if s.finish_reason is not None or s in head.unforked:
                    continue
                if seq.status is SequenceStatus.RUNNING:
                    sched.running.remove(seq)
                elif seq.status is SequenceStatus.WAITING and seq in sched.waiting:
                    sched.waiting.remove(seq)
                bm.free(seq.seq_id)
                if seq.swapped is not None:  # its swapped blocks stay behind with this core
                    self.offload.discard(seq.swapped)
                    seq.swapped = None
                seq.num_computed_tokens = 0
                seq.spec_token_ids.clear()
                seq.status = SequenceStatus.WAITING
        self.requests.clear()
        self._by_seq.clear()
        self._awaiting_grammar.clear()
        return heads

    def attach(self, heads: list[Request]) -> None:
        """Takes requests another core detached (detach_all); each recomputes its tokens here.
        They queue behind nothing: they were admitted before anything waiting here."""
        resumed = []
        for head in heads:
            self.requests[head.request_id] = head
            for s in head.samples:
                self._by_seq[s.seq.seq_id] = s
            if head.pending_grammar is not None:
                self._awaiting_grammar[head.request_id] = head
                continue
            resumed += [s.seq for s in head.samples if s.finish_reason is None and s not in head.unforked]
        self.scheduler.waiting.extendleft(reversed(resumed))

    def record_phases(self, step: _Step, output: float) -> None:
        # Building the sampling rows counts as prepare; a speculative step (whose verification
        # the runner does not time phase by phase) counts as forward. Output is the token
        # bookkeeping plus detokenization and building the outputs.
        timings = step.timings
        prepare, forward, sample = timings if timings is not None else (0.0, step.t_executed - step.t_execute, 0.0)
        self._stats.on_step(step.t_scheduled - step.t_start, (step.t_execute - step.t_scheduled) + prepare,
                            forward, sample, output)

    def shutdown(self) -> None:
        if self._forward_pool is not None:
            self._forward_pool.shutdown(wait=True)
