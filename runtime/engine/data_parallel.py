"""DataParallelEngine: a server's G devices as data-parallel engines of tensor-parallel ranks
(vLLM's ``--data-parallel-size`` x ``--tensor-parallel-size``), whose layout can change live.

It is the server's one EngineClient (runtime/engine/client.py) and runs on the server's engine
thread. Each data-parallel engine is a whole LLMEngine (scheduler, block manager, executor); a
request group goes to the engine that ran its prompt's longest prefix (its prefix cache holds it)
unless that engine has clearly more unfinished requests than the least loaded one, which then
takes it; each step steps every busy engine (in parallel threads: the forward passes release the
GIL).

Reshape (``reshape(data_parallel, tensor_parallel)``, POST /admin/parallelism) on the engine
thread, between steps, so requests arriving meanwhile queue in the server's command queue and
none is refused:
1. each engine finishes the step it has in flight and hands back every unfinished request with
   its tokens so far, as after a preemption by recompute (runtime/engine/core.py detach_all);
2. the old engines free their devices (workers reaped, pools and weights dropped);
3. the new layout's engines are built from the checkpoint on local disk (the safetensors files
   are memory-mapped, so the weights come from the page cache, never fetched again); each sizes
   its KV pools with the capacity model for its tensor-parallel degree;
4. the requests resume on the new engines, oldest first, spread by least outstanding work: their
   prompt and generated tokens are prefilled again, and they go on with the same Request objects
   (same detokenizer, same stream), so greedy text is what it would have been without the reshape.
A failure in step 3 (a worker killed while starting, a device that cannot hold the shard) builds
the old layout again and resumes there; the reshape raises ReshapeError and serving goes on.
The pure decisions (valid layouts, devices, placement) are in runtime/engine/layout.py.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvserve.runtime.engine.layout import (
    Layout,
    assign,
    check_layout,
    choose_engine,
    engine_devices,
    prefix_keys,
)
from kvserve.runtime.kv_events.stream import open_server_stream
from kvserve.runtime.outputs import RequestOutput
from kvserve.runtime.stats import EngineStats

log = logging.getLogger(__name__)

# EngineStats fields that only grow: a retired engine's last values stay in the totals.
_COUNTERS = ("num_preemptions_total", "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
             "prefix_cache_hits_total", "computed_tokens_total", "spec_decode_num_drafts_total",
             "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
             "structured_output_requests_total", "cuda_graph_capture_failures_total",
             "kv_offload_queries_tokens_total", "kv_offload_hit_tokens_total",
             "kv_offload_hit_blocks_total", "kv_offload_stored_blocks_total", "kv_offload_stored_bytes_total",
             "kv_offload_loaded_bytes_total", "kv_offload_failed_loads_total", "kv_offload_prefetched_blocks_total",
             "kv_swap_outs_total",
             "kv_swap_ins_total")
# Counters of the KV events publisher, which engine 0 owns and the others share: counted once.
_PUBLISHER_COUNTERS = ("kv_events_published_total", "kv_events_dropped_total")
# Gauges that add up over engines.
_SUMMED = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "max_num_seqs",
           "generation_tokens_per_second", "kv_offload_capacity_bytes", "kv_offload_used_bytes",
           "kv_swap_capacity_bytes", "kv_swap_used_bytes", "num_swapped")
_OBSERVATIONS = ("queue_times", "time_to_first_token", "inter_token_latencies", "e2e_latencies",
                 "grammar_compile_times", "kv_offload_store_seconds", "kv_offload_load_seconds")


# After a reshape on the CPU, the garbage collection it skipped runs once the engines are idle
# (but not in the first COLLECT_IDLE_AFTER_S, while the reshape's answer is still on its way:
# the collection holds the GIL), or after COLLECT_AFTER_S of serving at the latest.
COLLECT_IDLE_AFTER_S = 2.0
COLLECT_AFTER_S = 30.0

# Prefix keys remembered for placement (a few MB at most): about 250 prompts of 4k tokens.
MAX_PREFIX_KEYS = 65536


class ReshapeError(RuntimeError):
    """A reshape failed part way; the previous layout was restored and serves on."""


def merge_stats(parts: list[EngineStats], retired: dict[str, Any], layout: Layout) -> EngineStats:
    """One EngineStats for the server: gauges and counters summed over engines (counters plus
    those of engines a reshape retired), observations concatenated."""
    first = parts[0]
    fields: dict[str, Any] = {f.name: getattr(first, f.name) for f in dataclasses.fields(EngineStats)}
    for name in _SUMMED:
        fields[name] = sum(getattr(p, name) for p in parts)
    for name in _COUNTERS:
        fields[name] = sum(getattr(p, name) for p in parts) + retired.get(name, 0)
    for name in _PUBLISHER_COUNTERS:
        fields[name] = getattr(first, name, 0) + retired.get(name, 0)
    success: dict[str, int] = dict(retired.get("request_success_total", {}))
    for p in parts:
        for k, v in p.request_success_total.items():
            success[k] = success.get(k, 0) + v
    fields["request_success_total"] = success
    for name in _OBSERVATIONS:
        fields[name] = [x for p in parts for x in getattr(p, name)]
    for name in ("running_lora_adapters", "waiting_lora_adapters"):  # the adapters of any engine's requests
        fields[name] = sorted({x for p in parts for x in getattr(p, name)})
    phases: dict[str, list[float]] = {}
    for p in parts:
        for k, v in p.step_phase_durations.items():
            phases.setdefault(k, []).extend(v)
    fields["step_phase_durations"] = phases
    fields["timestamp"] = max(p.timestamp for p in parts)
    fields["tensor_parallel_size"] = layout.tensor_parallel
    fields["data_parallel_size"] = layout.data_parallel
    return EngineStats(**fields)


def _retire_into(retired: dict[str, Any], stats: EngineStats, first: bool) -> None:
    for name in _COUNTERS + (_PUBLISHER_COUNTERS if first else ()):
        retired[name] = retired.get(name, 0) + getattr(stats, name, 0)
    success = retired.setdefault("request_success_total", {})
    for k, v in stats.request_success_total.items():
        success[k] = success.get(k, 0) + v


class DataParallelEngine:
    """`data_parallel_size` engines of `config.tensor_parallel_size` ranks; implements EngineClient."""

    def __init__(self, config, data_parallel_size: int = 1,
                 engine_factory: Callable[[Any], Any] | None = None, *, spare_workers: bool = False) -> None:
        from kvserve.runtime.engine.llm_engine import LLMEngine

        if engine_factory is None:
            engine_factory = LLMEngine
        self.config = config
        self._factory = engine_factory
        # Engine i's tokenizer, kept across layouts (each running engine keeps its own, as each
        # detokenizes in its own thread); only the default factory takes one.
        self._tokenizers: dict[int, Any] | None = {} if engine_factory is LLMEngine else None
        self.layout = Layout(data_parallel_size, config.tensor_parallel_size)
        self.num_devices = self.layout.devices
        check_layout(self.layout, self.num_devices)
        self._grammars = None  # one grammar manager for every engine, present and future
        self._started_one = False
        # The server's one KV events stream, kept across layouts (runtime/kv_events/stream.py).
        self._kv_events = open_server_stream(getattr(config, "kv_events_config", None))
        # Keep G - 1 worker interpreters started while no engine uses them, so a reshape to
        # tensor parallelism skips their start-up (multiproc.prestart_workers).
        self.spare_workers = spare_workers
        # On the CPU every layout's rank-0 weights stay in host memory (runtime/models/
        # host_weights.py): engines of one layout share one copy, and a reshape back to a layout
        # seen before builds its engines without reading or repacking the checkpoint.
        self._host_weights = str(config.device).startswith("cpu")
        if self._host_weights:
            from kvserve.runtime.models import host_weights

            host_weights.retain()
        # A full garbage collection costs most of a second in a process holding torch; on the
        # CPU a reshape does not need one before the new layout starts (the closed engines'
        # weights and pools go by reference counting), so it is run later (_collect_later).
        self._collect_due: float | None = None
        # A reshape's transient KV tier while its moved requests resume (runtime/engine/reshape_kv.py).
        self._move: Any = None
        try:
            self.engines: list[Any] = self._build(self.layout)
        except BaseException:
            self._release_host_weights()
            if self._kv_events is not None:  # its endpoint is free again for the next try
                self._kv_events.close()
            raise
        self._keep_spares()
        first = self.engines[0]
        self.model_config = first.model_config
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.structured_outputs = self._grammars
        self._owner: dict[str, Any] = {}  # request id -> the engine running it
        self._pending: list[RequestOutput] = []  # outputs owed by engines a reshape retired
        self._retired: dict[str, Any] = {}
        self._retired_obs: list[EngineStats] = []
        self._reshape_seconds: list[float] = []
        self.reshapes: list[dict[str, Any]] = []  # the history, newest last (bounded)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._loras: dict[int, Any] = {}  # adapters added through add_lora, loaded again after a reshape
        self._prefixes: collections.OrderedDict[int, int] = collections.OrderedDict()  # prefix key -> engine

    # -- building a layout -------------------------------------------------------------------------
    def _build(self, layout: Layout) -> list[Any]:
        devices = engine_devices(layout, str(self.config.device))
        configs = [self._engine_config(layout.tensor_parallel, device) for device in devices]
        engines: list[Any] = []
        # The engines start side by side: most of a start is torch work that leaves the GIL
        # (filling the KV pools, packing weights), so G engines take little more than one. The
        # process's first engine starts alone: lazy imports (transformers' among them) are not
        # safe to race from several threads.
        futures: list[concurrent.futures.Future] = []
        if not self._started_one:
            first: concurrent.futures.Future = concurrent.futures.Future()
            try:
                first.set_result(self._make(0, configs[0]))
            except BaseException as exc:
                first.set_exception(exc)
            futures.append(first)
            configs = configs[1:] if first.exception() is None else []
            self._started_one = first.exception() is None
        if configs:
            with concurrent.futures.ThreadPoolExecutor(len(configs), thread_name_prefix="kvserve-dp-start") as pool:
                done = len(futures)
                futures += [pool.submit(self._make, done + i, cfg) for i, cfg in enumerate(configs)]
                concurrent.futures.wait(futures)
        try:
            for fut in futures:
                engine = fut.result()
                own = engine.structured_outputs
                if self._grammars is None:
                    self._grammars = own
                elif own is not self._grammars:
                    # One manager (its limits, its compile workers, its cache) for every engine.
                    own.close()
                    engine.structured_outputs = self._grammars
                    engine.input_processor.structured_outputs = self._grammars
                engines.append(engine)
                if self._move is not None and engine.config.kv_offload_transient:
                    self._move.started_engine(engine)
            if self._kv_events is not None:
                self._kv_events.attach(engines)
        except BaseException:
            for fut in futures:  # every engine that did start, not only those already taken
                if fut.exception() is None:
                    self._close_engine(fut.result())
                    if fut.result().structured_outputs is not self._grammars:
                        fut.result().structured_outputs.close()
            raise
        return engines

    def _engine_config(self, tensor_parallel: int, device: str, *, move: bool = True) -> Any:
        config = dataclasses.replace(self.config, tensor_parallel_size=tensor_parallel, device=device)
        if self._kv_events is not None:  # the engines publish through the server's stream
            config = dataclasses.replace(config, kv_events_config=None)
        if move and self._move is not None and self._move.has_blocks and not self._move.detached:
            config = self._move.engine_config(config)  # the new layout reads the moved KV
        return config

    def _make(self, index: int, config: Any) -> Any:
        if self._tokenizers is None:
            return self._factory(config)
        engine = self._factory(config, tokenizer=self._tokenizers.get(index))
        self._tokenizers.setdefault(index, engine.tokenizer)
        return engine

    def _keep_spares(self) -> None:
        if not self.spare_workers or self.num_devices < 2:
            return
        from kvserve.runtime.executor.multiproc import prestart_workers

        wanted = self.num_devices - 1 if self.layout.tensor_parallel < self.num_devices else 0
        preload = None
        if wanted and self._host_weights:
            # On the CPU each spare also loads the shard its rank of 1 x TP G will need (host
            # memory: (G-1)/G of the weights, held while the layout is G x TP1).
            g = self.num_devices
            device = engine_devices(Layout(1, g), str(self.config.device))[0]
            preload = (self._engine_config(g, device, move=False), g, "cpu", str(self.engines[0].dtype).removeprefix("torch."))
        prestart_workers(wanted, preload)

    def _close_engine(self, engine: Any) -> None:
        """Frees an engine's devices but not the shared grammar manager."""
        persist = getattr(engine, "persist_kv_offload", None)
        if persist is not None:  # a persistent offload tier keeps the pool's cached blocks
            persist()
        engine.executor.shutdown()
        engine.core.shutdown()
        publisher = getattr(engine, "kv_event_publisher", None)
        if publisher is not None and not getattr(engine, "kv_events_shared", False):
            # its endpoint is free again for the next layout's engine
            publisher.close()

    # -- EngineClient ------------------------------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        return sum(e.max_num_seqs for e in self.engines)

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel

    @property
    def tensor_parallel_size(self) -> int:
        return self.layout.tensor_parallel

    def check_token_ids(self, ids: Iterable[Any], field: str) -> None:
        self.engines[0].check_token_ids(ids, field)

    def _loads(self) -> list[int]:
        return [e.get_num_unfinished_requests() for e in self.engines]

    def add_requests(self, requests: Iterable[tuple[str, Any, Any]], arrival_time: float | None = None,
                     **kwargs: Any) -> None:
        requests = list(requests)
        for rid, _, _ in requests:
            if rid in self._owner:
                raise ValueError(f"request_id: {rid!r} is already in use")
        # A group (n prompts of one HTTP request) stays on one engine: it is added all or nothing.
        # It goes where its first prompt's longest prefix ran (that engine's prefix cache holds
        # it: a conversation's next turn) unless that engine is clearly busier than the others.
        keys = prefix_keys(requests[0][1]) if len(self.engines) > 1 else []
        preferred = next((self._prefixes[k] for k in reversed(keys) if k in self._prefixes), None)
        index = choose_engine(self._loads(), preferred)
        engine = self.engines[index]
        engine.add_requests(requests, arrival_time, **kwargs)
        for rid, _, _ in requests:
            self._owner[rid] = engine
        for k in keys:
            self._prefixes[k] = index
            self._prefixes.move_to_end(k)
        while len(self._prefixes) > MAX_PREFIX_KEYS:  # bounded: the oldest keys go first
            self._prefixes.popitem(last=False)

    def add_request(self, request_id: str, prompt: Any, params: Any = None, arrival_time: float | None = None) -> None:
        # As LLMEngine.add_request: a grammar still compiling is waited for (all or nothing).
        self.add_requests([(request_id, prompt, params)], arrival_time=arrival_time, wait_for_grammars=True)

    def abort_request(self, request_id: str) -> None:
        engine = self._owner.pop(request_id, None)
        if engine is not None:
            engine.abort_request(request_id)

    # -- LoRA adapters: every engine holds every adapter (a request may land on any of them) ------
    def add_lora(self, lora_request: Any) -> bool:
        added = [e.add_lora(lora_request) for e in self.engines]
        self._loras[lora_request.lora_int_id] = lora_request
        return any(added)

    def remove_lora(self, lora_int_id: int) -> bool:
        for e in self.engines:  # refused (in use) on any engine: refused before any unloads
            users = sum(1 for r in e.core.requests.values()
                        if getattr(r, "lora_request", None) is not None and r.lora_request.lora_int_id == lora_int_id)
            if users:
                raise ValueError(f"lora_int_id: adapter {lora_int_id} is in use by {users} unfinished request(s)")
        self._loras.pop(lora_int_id, None)
        return any([e.remove_lora(lora_int_id) for e in self.engines])

    def pin_lora(self, lora_int_id: int) -> bool:
        return all([e.pin_lora(lora_int_id) for e in self.engines])

    def list_loras(self) -> set[int]:
        return self.engines[0].list_loras()

    def get_lora(self, lora_int_id: int) -> Any:
        return self.engines[0].get_lora(lora_int_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or any(e.has_unfinished_requests() for e in self.engines)

    def get_num_unfinished_requests(self) -> int:
        return sum(self._loads())

    def step(self) -> list[RequestOutput]:
        if self._collect_due is not None:
            self._collect_later()
        outputs, self._pending = self._pending, []
        busy = [e for e in self.engines if e.has_unfinished_requests()]
        if len(busy) == 1:
            outputs += busy[0].step()
        elif busy:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.num_devices, thread_name_prefix="kvserve-dp")
            for outs in self._pool.map(lambda e: e.step(), busy):
                outputs += outs
        if self._move is not None:
            self._move_tick({i for i, e in enumerate(self.engines) if e in busy})
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def get_stats(self) -> EngineStats:
        stats = merge_stats([e.get_stats() for e in self.engines], self._retired, self.layout)
        for old in self._retired_obs:  # observations a retired engine made since the last call
            for name in _OBSERVATIONS:
                getattr(stats, name).extend(getattr(old, name))
            for k, v in old.step_phase_durations.items():
                stats.step_phase_durations.setdefault(k, []).extend(v)
        self._retired_obs = []
        if self._kv_events is not None:  # one publisher for every layout: its own counts
            stats.kv_events_published_total = self._kv_events.published
            stats.kv_events_dropped_total = self._kv_events.dropped
        stats.reshape_seconds, self._reshape_seconds = self._reshape_seconds, []
        return stats

    def check_health(self) -> None:
        if self._collect_due is not None:  # the server's engine loop checks health when idle
            self._collect_later()
        if self._move is not None:
            self._move_tick(set())
        for e in self.engines:
            e.check_health()

    def _release_host_weights(self) -> None:
        if self._host_weights:
            from kvserve.runtime.models import host_weights

            self._host_weights = False
            host_weights.release()

    def _move_tick(self, stepped: set[int]) -> None:
        """Ends a reshape's transient KV tier: detached from the engines once every moved request
        was admitted (or too late), its directory deleted once no rank can still read it."""
        from kvserve.runtime.engine.reshape_kv import MOVE_MAX_SECONDS

        move = self._move
        if not move.detached and (move.admitted(self.engines) or
                                  time.monotonic() - move.started > MOVE_MAX_SECONDS):
            move.detach(self.engines)
        if move.detached and move.quiet(self.engines, stepped):
            move.remove()
            self._move = None

    def _end_move(self) -> Any:
        """Detaches the current move's tier now; returns it for removal once its engines closed."""
        move, self._move = self._move, None
        if move is not None:
            move.detach(self.engines)
        return move

    def _collect_later(self) -> None:
        """The collection a CPU reshape skipped: once the engines are idle, or at the latest
        COLLECT_AFTER_S after the reshape (then one pause of a full collection, as Python's own)."""
        if self._collect_due is None:
            return
        now = time.monotonic()
        idle_from = self._collect_due - COLLECT_AFTER_S + COLLECT_IDLE_AFTER_S
        if now < self._collect_due and (self.has_unfinished_requests() or now < idle_from):
            return
        self._collect_due = None
        from kvserve.runtime.executor.platform import platform_for

        platform_for(self.engines[0].device if self.engines else "cpu").release_memory()

    def close(self) -> None:
        from kvserve.runtime.executor.platform import held_release, platform_for

        device = self.engines[0].device if self.engines else "cpu"  # none left after a failed rollback
        self._collect_due = None
        move = self._end_move()
        with held_release(platform_for(device)):  # one collection for all engines
            for e in self.engines:
                self._close_engine(e)
            self._release_host_weights()
        if move is not None:
            move.remove()
        if self.spare_workers:
            from kvserve.runtime.executor.multiproc import prestart_workers

            prestart_workers(0)
        if self._grammars is not None:
            self._grammars.close()
        if self._kv_events is not None:
            self._kv_events.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reshape -----------------------------------------------------------------------------------
    def _tp_error(self, tp: int) -> str | None:
        from kvserve.runtime.executor.multiproc import check_tensor_parallel

        try:
            check_tensor_parallel(self.model_config, tp)
        except ValueError as exc:
            return str(exc).removeprefix("tensor_parallel_size: ")
        return None

    def reshape(self, data_parallel: int, tensor_parallel: int) -> dict[str, Any]:
        """Changes the layout live (engine thread only). Returns what was done; raises ValueError
        for a layout this server cannot run (nothing changes) and ReshapeError when the new layout
        failed to start (the old one serves again)."""
        target = Layout(data_parallel, tensor_parallel)
        if getattr(self.config, "pipeline_parallel_size", 1) != 1:
            raise ValueError("tensor_parallel: a live layout change is not supported with pipeline parallelism")
        check_layout(target, self.num_devices, self._tp_error)
        old = self.layout
        if target == old:
            return self._record(old, target, 0.0, 0, changed=False)
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        previous_move = self._end_move()  # the last reshape's tier, if its requests still resume
        # 1. Stop: finish what is in flight, take every unfinished request out.
        heads = []
        by_engine: dict[int, list[Any]] = {}
        for i, engine in enumerate(self.engines):
            outputs, detached = engine.detach_requests()
            self._pending += outputs
            heads += detached
            by_engine[i] = detached
        heads.sort(key=lambda h: h.metrics.arrival_time)
        phases["stop"] = time.perf_counter() - t0
        # 2. Free the devices; the old engines' counters stay in the totals. One collection for
        # all of them (each rank's own would cost most of a second).
        from kvserve.runtime.executor.platform import held_release, platform_for

        platform = platform_for(self.engines[0].device)
        # A GPU needs the memory back before the new layout sizes its pools; the CPU does not.
        collect_now = platform.name != "cpu"
        kv = self._open_move(by_engine)
        with held_release(platform, release=collect_now):
            for i, engine in enumerate(self.engines):
                if self._move is not None:
                    self._save_move(engine, by_engine[i], kv)
                stats = engine.get_stats()
                _retire_into(self._retired, stats, first=i == 0)
                self._retired_obs.append(stats)
                self._close_engine(engine)
            self.engines = []
        if previous_move is not None:
            previous_move.remove()
        if self._move is not None and not self._move.has_blocks:
            self._move.remove()  # nothing was written: recompute
            self._move = None
        if self._kv_events is not None:
            self._kv_events.layout_changed()
        phases["free"] = time.perf_counter() - t0 - sum(phases.values())
        # 3. Start the new layout, or the old one again.
        failure: BaseException | None = None
        try:
            self.engines = self._build(target)
            self.layout = target
        except Exception as exc:
            failure = exc
            log.error("reshape %s -> %s failed (%s: %s); restoring %s", old, target, type(exc).__name__, exc, old)
            try:
                self.engines = self._build(old)  # if even this fails, the engine loop ends and /health says why
            except BaseException:
                if self._move is not None:
                    self._move.remove()
                    self._move = None
                raise
        phases["start"] = time.perf_counter() - t0 - sum(phases.values())
        for lora in self._loras.values():  # the adapters the old engines had (from local files)
            for engine in self.engines:
                engine.add_lora(lora)
        # 4. Resume every request on the engines now running (their caches start empty: the
        # placement memory goes too).
        self._prefixes.clear()
        self._resume(heads)
        self._keep_spares()
        if not collect_now:
            self._collect_due = time.monotonic() + COLLECT_AFTER_S
        seconds = time.perf_counter() - t0
        phases["resume"] = seconds - sum(phases.values())
        record = self._record(old, target, seconds, len(heads), changed=failure is None,
                              error=None if failure is None else f"{type(failure).__name__}: {failure}")
        record["phases"] = {k: round(v, 4) for k, v in phases.items()}
        record["kv"] = kv  # updated when the move ends (read_blocks, read_tokens, seconds)
        log.debug("reshape %s -> %s phases: %s", old, target,
                  ", ".join(f"{k} {v:.3f}s" for k, v in phases.items()))
        if failure is not None:
            raise ReshapeError(f"reshape {old} -> {target} failed and was rolled back to {old} "
                               f"({type(failure).__name__}: {failure})") from failure
        self._reshape_seconds.append(seconds)
        log.info("reshaped %s -> %s in %.2fs, %d requests resumed (%d with their KV in a transient tier)",
                 old, target, seconds, len(heads), kv.get("requests", 0))
        return record

    def _open_move(self, by_engine: dict[int, list[Any]]) -> dict[str, Any]:
        """The transient KV tier for this reshape's requests (runtime/engine/reshape_kv.py), or
        why there is none (the requests are then recomputed)."""
        from kvserve.runtime.engine import reshape_kv

        why = reshape_kv.eligible(self.config)
        if why is None and any(by_engine.values()):
            try:
                self._move = reshape_kv.KVMove.open(self.engines, by_engine)
                why = None if self._move is not None else "no whole block to move"
            except reshape_kv.NoRoom as exc:
                why = str(exc)
            except Exception as exc:
                log.warning("reshape: no transient KV tier (%s: %s): requests are recomputed", type(exc).__name__, exc)
                why = f"{type(exc).__name__}: {exc}"
        elif why is None:
            why = "no request in flight"
        return self._move.record if self._move is not None else {"transient_dir": None, "reason": why}

    def _save_move(self, engine: Any, heads: list[Any], kv: dict[str, Any]) -> None:
        try:
            self._move.save(engine, heads)
        except Exception as exc:  # those requests are recomputed; the reshape goes on
            log.warning("reshape: writing the transient KV tier failed (%s: %s): requests are recomputed",
                        type(exc).__name__, exc)
            kv["errors"] = kv.get("errors", 0) + 1

    def _resume(self, heads: list[Any]) -> None:
        self._owner = {}
        placement = assign(self._loads(), [1] * len(heads))
        by_engine: dict[int, list[Any]] = {}
        for head, i in zip(heads, placement):
            by_engine.setdefault(i, []).append(head)
        for i, group in by_engine.items():
            engine = self.engines[i]
            engine.attach_requests(group)
            for head in group:
                self._owner[head.request_id] = engine
                try:
                    # A smaller pool than before may never hold it: end it now rather than hang it.
                    engine.scheduler.check_fits(head.seq.num_prompt_tokens, head.seq.max_tokens)
                except ValueError as exc:
                    log.warning("request %s no longer fits after the reshape: %s", head.request_id, exc)
                    engine.abort_request(head.request_id)

    def _record(self, old: Layout, new: Layout, seconds: float, resumed: int, *, changed: bool,
                error: str | None = None) -> dict[str, Any]:
        record = {"from": {"data_parallel": old.data_parallel, "tensor_parallel": old.tensor_parallel},
                  "to": {"data_parallel": new.data_parallel, "tensor_parallel": new.tensor_parallel},
                  "data_parallel": self.layout.data_parallel, "tensor_parallel": self.layout.tensor_parallel,
                  "changed": changed, "seconds": round(seconds, 4), "resumed_requests": resumed,
                  "at": time.time()}
        if error is not None:
            record["error"] = error
        self.reshapes = (self.reshapes + [record])[-32:]
        return record
