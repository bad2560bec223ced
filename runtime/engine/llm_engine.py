"""LLMEngine: requests in, one scheduled forward pass per step(), RequestOutputs out.

Single-threaded by design: the server calls add_request/abort_request/step from one thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.runtime.engine.block_manager import BlockManager
from kvserve.runtime.config import EngineConfig
from kvserve.runtime.engine.detokenizer import IncrementalDetokenizer, make_decode_fn
from kvserve.runtime.engine.kv_cache_groups import KVCacheCoordinator
from kvserve.runtime.engine.prefix_cache import extra_key
from kvserve.runtime.executor import create_executor
from kvserve.runtime.kv_cache import kv_cache_torch_dtype
from kvserve.runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.runtime.sampler import SamplerOutput, SamplingRow
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.runtime.engine.sequence import Sequence, SequenceStatus
from kvserve.runtime.stats import EngineStats, StatsCollector
from kvserve.runtime.structured_outputs.manager import StructuredOutputManager

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Prompt = str | list[int] | dict[str, Any]


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    params: SamplingParams
    seq: Sequence
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    row: SamplingRow
    stop_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # n > 1: each sample is a _Request of its own sharing request_id; `group` lists them all
    # (index order). The other samples join the scheduler by forking sample 0's blocks once
    # its prompt is computed (`unforked` until then), so the prompt's KV is held once.
    index: int = 0
    group: list["_Request"] | None = None
    unforked: list["_Request"] = field(default_factory=list)

    @property
    def samples(self) -> list["_Request"]:
        return self.group or [self]


@dataclass(eq=False)
class _ModelInput:
    """One scheduled step as the executor takes it (runtime/executor/base.py)."""

    scheduled: list
    block_tables: list
    rows: list[SamplingRow]
    repeats: list[int]


@dataclass(eq=False)
class _Step:
    """One scheduled step on its way through the engine (and, overlapped, the forward thread)."""

    sched: SchedulerOutput
    tables: list[list[int]]
    rows: list[SamplingRow]
    repeats: list[int]  # sampling rows per sampling item, in schedule order
    t_start: float
    t_scheduled: float
    t_execute: float
    t_executed: float = 0.0
    timings: tuple[float, float, float] | None = None
    future: concurrent.futures.Future | None = None

    def without_finished(self, result: SamplerOutput) -> tuple[SchedulerOutput, SamplerOutput]:
        """The step and its sampled rows without the sequences that finished meanwhile."""
        tokens, logprobs, live = [], [], []
        k = 0
        repeats = iter(self.repeats)
        for item in self.sched.scheduled:
            n = next(repeats) if item.samples else 0
            if not item.seq.status.finished:
                live.append(item)
                tokens += result.token_ids[k:k + n]
                logprobs += result.logprobs[k:k + n]
            k += n
        return dataclasses.replace(self.sched, scheduled=live), SamplerOutput(tokens, logprobs)


from kvserve.runtime.executor.base import hybrid_kv_groups, kv_release_window  # noqa: E402,F401  (re-exported)
from kvserve.runtime.executor.platform import resolve_device  # noqa: E402,F401  (re-exported)


def resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return checkpoint_dtype if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def _check_kv_cache_dtype(kv_dtype: torch.dtype, backend: str, device: torch.device) -> None:
    """Triton reads float8 e4m3 with the conversion GPUs have from sm_89 (Ada, Hopper) on; on an
    older GPU that kernel cannot compile, so say so before any weight is loaded."""
    if kv_dtype == torch.float8_e4m3fn and backend == "triton" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype: fp8 / fp8_e4m3 needs a GPU of compute capability 8.9 or "
                             f"newer with the triton attention backend (this one is {major}.{minor}); "
                             f"use fp8_e5m2, attention_backend='torch', or kv_cache_dtype='auto'")


def check_kv_cache_dtype_for_model(kv_cache_dtype: str, model_config) -> None:
    """The latent (MLA) cache has no float8 form yet. Pure: the CLI runs it before listening."""
    if kv_cache_dtype != "auto" and model_config.shape.mla is not None:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not supported for multi-head latent "
                         f"attention models ({model_config.architecture}) yet; use 'auto'")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        from kvserve.runtime.attention.selector import get_attention_backend
        from kvserve.runtime.gguf import is_gguf_path
        from kvserve.runtime.gguf import load_tokenizer as load_gguf_tokenizer
        from kvserve.runtime.gguf.reader import resolve_model_path
        from kvserve.runtime.model_config import ModelConfig
        from kvserve.runtime.models.quantization import resolve_quantization

        config.model = resolve_model_path(config.model)  # a fetched GGUF directory -> its file
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config.dtype, self.device)
        # Before the tokenizer and any worker: a format this checkpoint or device cannot take fails first.
        self.quant_config = resolve_quantization(config.quantization, self.model_config.hf_config)
        if self.quant_config is not None:
            self.quant_config.check_supported(self.device, self.dtype)
        self.quantization = self.quant_config.name if self.quant_config is not None else None
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        check_kv_cache_dtype_for_model(config.kv_cache_dtype, self.model_config)
        self.max_model_len = self.model_config.resolve_max_model_len(config.max_model_len)
        if config.tokenizer is None and is_gguf_path(config.model):
            self.tokenizer = load_gguf_tokenizer(config.model)  # from the file's metadata
        else:
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
            except (ValueError, OSError) as exc:  # transformers' message is long and names no file
                raise ValueError(f"model: no usable tokenizer in {str(config.tokenizer or config.model)!r} "
                                 f"(tokenizer.json, tokenizer.model, ...): {' '.join(str(exc).split())[:300]}") from None
        self._decode = make_decode_fn(self.tokenizer)
        self.vocab_size = self.model_config.vocab_size

        _check_kv_cache_dtype(self.kv_cache_dtype, get_attention_backend(config.attention_backend, self.device).name,
                              self.device)
        self.max_num_batched_tokens = config.resolved_max_num_batched_tokens(self.max_model_len)
        # Weights, KV pools, graphs, the sampler and speculative decoding, on every rank.
        self.executor = create_executor(config, self.model_config, device=self.device, dtype=self.dtype,
                                        max_model_len=self.max_model_len, quant_config=self.quant_config)
        ex = self.executor
        self.attention_backend = ex.attention_backend
        self.kv_groups = ex.kv_groups
        self.kv_group_blocks = ex.num_blocks_per_group
        self.num_kv_blocks = ex.num_blocks_per_group[0]
        self.model_weight_bytes = ex.model_weight_bytes
        if self.kv_groups is not None:
            self.block_manager = KVCacheCoordinator(self.kv_groups, self.kv_group_blocks, config.block_size,
                                                    enable_caching=config.enable_prefix_caching)
        else:
            self.block_manager = BlockManager(self.num_kv_blocks, config.block_size,
                                              enable_caching=config.enable_prefix_caching,
                                              sliding_window=ex.kv_release_window)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_model_len=self.max_model_len,
                            enable_chunked_prefill=config.enable_chunked_prefill),
            self.block_manager,
        )
        self._eos = frozenset(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self._eos |= {self.tokenizer.eos_token_id}
        # Grammars compile in the manager's threads; a request whose grammar is still compiling
        # waits here (not in the scheduler) and costs the running batch nothing.
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.vocab_size, self._eos)
        self._awaiting_grammar: dict[str, tuple[_Request, concurrent.futures.Future]] = {}
        self._requests: dict[str, _Request] = {}  # request id -> its sample 0
        self._by_seq: dict[int, _Request] = {}  # seq id -> the sample it belongs to
        self._pending: list[RequestOutput] = []  # aborted requests' final outputs, sent by step()
        self._stats = StatsCollector()
        self._ids = itertools.count()
        # async_scheduling: step N+1's forward pass runs in this one thread while the engine thread
        # detokenizes step N. Speculative steps (their drafts read the newest tokens) keep the
        # synchronous loop.
        self._overlap = config.async_scheduling and self.executor.supports_overlap
        if config.async_scheduling and not self._overlap:
            log.info("async_scheduling: not with speculative decoding; steps run synchronously")
        self._forward_pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-forward")
                              if self._overlap else None)
        self._inflight: _Step | None = None
        log.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens (%s), max_model_len %d, backend %s",
                 self.model_config.architecture, self.device, self.dtype, self.num_kv_blocks,
                 config.block_size, str(self.kv_cache_dtype).removeprefix("torch."), self.max_model_len,
                 self.attention_backend)
        if self.kv_groups is not None:
            log.info("KV cache groups: %s", ", ".join(
                f"{'full attention' if g.window is None else f'window {g.window}'}: {len(g.layers)} layers, {n} blocks"
                for g, n in zip(self.kv_groups, self.kv_group_blocks)))

    # Rank 0's parts, owned by the executor (None once closed).
    @property
    def model(self):
        return self.executor.model

    @property
    def kv_caches(self):
        return self.executor.kv_caches

    @property
    def runner(self):
        return self.executor.runner

    @property
    def spec_decoder(self):
        return self.executor.spec_decoder

    @classmethod
    def from_args(cls, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig.from_args(**kwargs))

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | dict | None = None,
                    arrival_time: float | None = None) -> None:
        """Queues a request; raises ValueError naming the bad field (and queues nothing)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        prompt_text, prompt_ids = self._tokenize(prompt)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: must be a non-empty string")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(prompt_ids))
        self.scheduler.check_fits(len(prompt_ids), max_tokens)
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {self.vocab_size})")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured_outputs.compile(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()

        now = StatsCollector.now()
        metrics = RequestMetrics(arrival_time=arrival_time or now)
        samples = [self._new_sample(request_id, prompt_text, prompt_ids, max_tokens, params, metrics,
                                    extra_key(cache_salt), index) for index in range(params.n)]
        req = samples[0]
        if params.n > 1:
            req.group, req.unforked = samples, samples[1:]
            for s in samples[1:]:
                s.group = samples
        for s in samples:
            self._by_seq[s.seq.seq_id] = s
        self._requests[request_id] = req
        if grammar is not None:
            self._stats.structured_output_requests_total += 1
            if not grammar.done():
                self._awaiting_grammar[request_id] = (req, grammar)
                return
            self._attach_grammar(req, grammar.result())
        self.scheduler.add(req.seq)

    def _attach_grammar(self, req: _Request, compiled) -> None:
        for s in req.samples:  # one matcher per sample: n > 1 samples diverge
            s.row.grammar = self.structured_outputs.new_state(compiled)

    def _admit_compiled(self) -> None:
        """Moves requests whose grammar finished compiling into the scheduler; one whose grammar
        failed ends with finish_reason "abort" (the server compiles first and answers 400)."""
        if not self._awaiting_grammar:
            return
        if not self.scheduler.has_unfinished():
            # Nothing else to run: wait a little for a compile rather than spin the caller's loop.
            concurrent.futures.wait([f for _, f in self._awaiting_grammar.values()], timeout=0.01,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for request_id, (req, fut) in list(self._awaiting_grammar.items()):
            if not fut.done():
                continue
            del self._awaiting_grammar[request_id]
            exc = fut.exception()
            if exc is not None:
                log.warning("request %s: %s", request_id, exc)
                self.abort_request(request_id)
                continue
            self._attach_grammar(req, fut.result())
            self.scheduler.add(req.seq)

    def _new_sample(self, request_id: str, prompt_text: str | None, prompt_ids: list[int], max_tokens: int,
                    params: SamplingParams, metrics: RequestMetrics, cache_extra: bytes | None,
                    index: int) -> _Request:
        seq = Sequence(request_id, prompt_ids, max_tokens, arrival_time=metrics.arrival_time,
                       cache_extra=cache_extra)
        generator = None
        if params.seed is not None and not params.greedy:
            # seed + index: distinct samples, each reproducible whatever else runs.
            generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        banned = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos)))
        return _Request(
            request_id=request_id,
            prompt=prompt_text,
            params=params,
            seq=seq,
            detok=IncrementalDetokenizer(self._decode, prompt_ids,
                                         skip_special_tokens=params.skip_special_tokens,
                                         stop=params.stop,
                                         include_stop_str_in_output=params.include_stop_str_in_output),
            metrics=metrics if index == 0 else RequestMetrics(arrival_time=metrics.arrival_time),
            row=SamplingRow(params, seq.token_ids, len(prompt_ids), generator, banned),
            stop_token_ids=frozenset(params.stop_token_ids),
            eos_token_ids=frozenset() if params.ignore_eos else self._eos,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            index=index,
        )

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            text = prompt
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt_token_ids", "prompt", "cache_salt"})
            if unknown:
                raise ValueError(f"prompt: unknown field {unknown[0]!r}")
            if "prompt_token_ids" not in prompt:
                raise ValueError("prompt_token_ids: missing")
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif isinstance(prompt, (list, tuple)):
            ids = prompt
        else:
            raise ValueError(f"prompt: expected a string, a token id list or "
                             f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        ids = list(ids)
        if not ids:
            raise ValueError("prompt: must not be empty" if text is not None or isinstance(prompt, str)
                             else "prompt_token_ids: must not be empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: {t!r} is not a token id in the vocabulary "
                                 f"[0, {self.vocab_size})")
        return text, ids

    def abort_request(self, request_id: str) -> None:
        """Ends a request at once and frees its KV blocks; unknown or finished ids are ignored.
        Its final output (finish_reason "abort") comes with the next step()."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self._awaiting_grammar.pop(request_id, None)
        for s in req.samples:
            if s.finish_reason is None:
                self.scheduler.finish(s.seq, SequenceStatus.FINISHED_ABORTED)
                s.finish_reason = "abort"
            self._by_seq.pop(s.seq.seq_id, None)
        req.unforked = []
        now = StatsCollector.now()
        req.metrics.finished_time = now
        self._stats.request_success_total["abort"] += 1
        self._pending.append(self._make_output(req, finished=True))

    def withdraw_request(self, request_id: str) -> None:
        """Undoes an add_request whose batch failed validation before any step ran: the request
        disappears without an output and is not counted as aborted (it was a bad request, not an
        abort). Unknown ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self._awaiting_grammar.pop(request_id, None)
        if req.params.structured_outputs is not None:  # a withdrawn request was never served
            self._stats.structured_output_requests_total -= 1
        for s in req.samples:
            self.scheduler.finish(s.seq, SequenceStatus.FINISHED_ABORTED)
            self._by_seq.pop(s.seq.seq_id, None)
        req.unforked = []

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending) or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def check_health(self) -> None:
        """Raises if the engine can no longer step (a tensor-parallel worker died)."""
        self.executor.check_health()

    def close(self) -> None:
        """Stops and reaps the tensor-parallel workers, if any, and frees the weights and KV
        pools. Idempotent; no step() after it."""
        self.executor.shutdown()
        if self._forward_pool is not None:
            self._forward_pool.shutdown(wait=True)
        self.structured_outputs.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one iteration ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._admit_compiled()
        outputs, self._pending = self._pending, []
        if self._overlap:
            return outputs + self._step_overlapped()
        begun = self._begin_step()
        if begun is None:
            return outputs
        result = self._run_step(begun)
        changed = self._finish_step(begun, result)
        outputs += self._emit(changed)
        self._record_phases(begun, time.perf_counter() - begun.t_executed)
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        """async_scheduling: the forward pass of step N+1 runs in the forward thread while this
        thread detokenizes step N's tokens and builds its outputs, and while the caller streams
        them. Scheduling waits for step N's tokens as always, so every decision (and every
        output) is the one the synchronous engine makes."""
        changed = None
        done, self._inflight = self._inflight, None
        if done is not None:
            try:
                result = done.future.result()
            except Exception:
                self._fail_step(done.sched)
                raise
            t_joined = time.perf_counter()
            changed = self._finish_step(done, result)
            bookkeeping = time.perf_counter() - t_joined
        begun = self._begin_step()
        if begun is not None:
            # The forward thread reads only what _begin_step built (copied block tables, rows) and
            # the sequences' token lists, which this thread does not touch until the next join.
            begun.future = self._forward_pool.submit(self._run_step, begun)
            self._inflight = begun
        if changed is None:
            return []
        t_emit = time.perf_counter()
        outputs = self._emit(changed)
        self._record_phases(done, bookkeeping + time.perf_counter() - t_emit)
        return outputs

    def _begin_step(self) -> "_Step | None":
        t_start = time.perf_counter()
        self.executor.propose_drafts(self.scheduler.running, self._params_of)
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
        # Copies: an abort between steps frees (and edits) a sequence's table while a forward
        # pass of the overlapped engine may still read it.
        if self.kv_groups is not None:
            tables = [self.block_manager.group_tables(item.seq.seq_id) for item in sched.scheduled]
        else:
            tables = [list(self.block_manager.block_tables[item.seq.seq_id]) for item in sched.scheduled]
        return _Step(sched, tables, rows, repeats, t_start, t_scheduled, time.perf_counter())

    def _run_step(self, step: "_Step"):
        sched = step.sched
        try:
            result = self.executor.execute_model(_ModelInput(sched.scheduled, step.tables, step.rows, step.repeats))
        except Exception:
            if not self._overlap:
                self._fail_step(sched)
            raise
        step.timings = self.executor.last_timings
        step.t_executed = time.perf_counter()
        return result

    def _finish_step(self, step: "_Step", result) -> dict[str, _Request]:
        """Appends the step's tokens and finishes sequences (EOS, stop tokens, length, stop
        strings); returns the requests whose outputs changed, in schedule order."""
        sched = step.sched
        if self._overlap and any(item.seq.status.finished for item in sched.scheduled):
            # Requests aborted while the forward pass ran: their tokens are dropped.
            sched, result = step.without_finished(result)
        self.scheduler.on_step_done(sched)
        self._stats.computed_tokens_total += sched.num_batched_tokens
        now = StatsCollector.now()
        by_seq = self._by_seq
        num_prompt = num_generated = 0
        k = 0
        changed: dict[str, _Request] = {}  # one output per request per step, in schedule order
        for item in sched.scheduled:
            if not item.samples:
                continue
            req = by_seq[item.seq.seq_id]
            samples = [req]
            if req.unforked:
                samples += self._fork(req, now)
            for s in samples:
                token, lp = result.token_ids[k], result.logprobs[k]
                k += 1
                if s.index == 0 and s.seq.num_output_tokens == 0:
                    num_prompt += s.seq.num_prompt_tokens
                if isinstance(token, list):  # verified drafts, then the target's own token
                    self._on_spec_tokens(s, item, token, now)
                    num_generated += len(token)
                    continue
                num_generated += 1
                self._on_token(s, token, lp, now)
            head = req.group[0] if req.group else req
            changed[head.request_id] = head
        self._stats.on_tokens(now, num_prompt, num_generated)
        return changed

    def _emit(self, changed: dict[str, _Request]) -> list[RequestOutput]:
        # Detokenization happens here (lazily, for requests without stop strings).
        return [self._make_output(head, finished=all(s.finish_reason is not None for s in head.samples))
                for head in changed.values()]

    def _record_phases(self, step: "_Step", output: float) -> None:
        # Building the sampling rows counts as prepare; a speculative step (whose verification
        # the runner does not time phase by phase) counts as forward. Output is the token
        # bookkeeping plus detokenization and building the outputs.
        timings = step.timings
        prepare, forward, sample = timings if timings is not None else (0.0, step.t_executed - step.t_execute, 0.0)
        self._stats.on_step(step.t_scheduled - step.t_start, (step.t_execute - step.t_scheduled) + prepare,
                            forward, sample, output)

    def _params_of(self, seq: Sequence) -> SamplingParams | None:
        req = self._by_seq.get(seq.seq_id)
        return None if req is None else req.params

    def _on_spec_tokens(self, req: _Request, item, tokens: list[int], now: float) -> None:
        """Appends a verified run (stopping early if the request finishes on the way) and rolls the
        sequence back to its verified length: drafts past the first rejection had K/V written."""
        s = self._stats
        s.spec_num_drafts += 1
        s.spec_num_draft_tokens += item.num_spec
        s.spec_num_accepted_tokens += len(tokens) - 1
        for t in tokens:
            self._on_token(req, t, None, now)
            if req.finish_reason is not None:
                return  # finished: its blocks are already freed
        seq = req.seq
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.truncate(seq.seq_id, seq.num_tokens)

    def _fork(self, req: _Request, now: float) -> list[_Request]:
        """Samples 1..n-1 take sample 0's blocks (its prompt is computed) and start running."""
        children, req.unforked = req.unforked, []
        parent = req.seq
        for child in children:
            self.block_manager.fork(parent.seq_id, child.seq.seq_id)
            seq = child.seq
            seq.num_computed_tokens = parent.num_computed_tokens
            seq.block_hashes = list(parent.block_hashes)
            seq.num_cached_tokens = parent.num_cached_tokens
            self.scheduler.add_running(seq)
            child.metrics.first_scheduled_time = req.metrics.first_scheduled_time
        return children

    def _on_token(self, req: _Request, token: int, lp: dict[int, Logprob] | None, now: float) -> None:
        seq, m = req.seq, req.metrics
        seq.append_token(token)
        if m.first_token_time is None:
            m.first_token_time = now
            if req.index == 0:  # one TTFT per request, whatever n is
                self._stats.time_to_first_token.append(now - m.arrival_time)
        else:
            self._stats.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        if lp is not None:
            for tid, entry in lp.items():
                entry.decoded_token = self._decode([tid], False)
            req.logprobs.append(lp)
            req.cumulative_logprob += lp[token].logprob

        status = None
        grammar = req.row.grammar
        if grammar is not None and not grammar.is_terminated and not grammar.accept(token):
            # Only reachable when every allowed token was also banned (min_tokens against a
            # finished grammar): end the sample rather than emit text the grammar refuses.
            log.warning("request %s: token %d is not allowed by its grammar; stopping", req.request_id, token)
            status = SequenceStatus.FINISHED_STOPPED
            req.detok.flush()
        elif token in req.stop_token_ids:
            status, req.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            req.detok.flush()
        elif token in req.eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
            req.detok.flush()
        else:
            stop = req.detok.add_token(token)
            if stop is not None:
                status, req.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
            elif seq.num_output_tokens >= seq.max_tokens:
                status = SequenceStatus.FINISHED_LENGTH
                if req.detok.flush() is not None:
                    status, req.stop_reason = SequenceStatus.FINISHED_STOPPED, req.detok.stop_reason
        if status is None and grammar is not None and grammar.is_terminated:
            # The grammar took its stop token: nothing may follow it, even with ignore_eos.
            status = SequenceStatus.FINISHED_STOPPED
            req.detok.flush()
        if status is not None:
            self.scheduler.finish(seq, status)
            req.finish_reason = status.finish_reason
            m.finished_time = now
            head = req.group[0] if req.group else req
            if all(s.finish_reason is not None for s in head.samples):
                head.metrics.finished_time = now
                self._stats.e2e_latencies.append(now - head.metrics.arrival_time)
                self._stats.request_success_total[req.finish_reason] += 1
                del self._requests[req.request_id]
                for s in head.samples:
                    self._by_seq.pop(s.seq.seq_id, None)

    def _fail_step(self, sched: SchedulerOutput) -> None:
        """A forward pass raised: end the step's requests (their cache state is unknown)."""
        for item in sched.scheduled:
            req = self._requests.get(item.seq.request_id)
            if req is not None:
                self.abort_request(req.request_id)

    def _make_output(self, req: _Request, finished: bool) -> RequestOutput:
        seq = req.seq
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.detok.visible_text(s.finish_reason is not None),
                token_ids=s.seq.output_token_ids,
                finish_reason=s.finish_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob,
                stop_reason=s.stop_reason,
            )
            for s in req.samples
        ]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=req.metrics,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )

    # -- statistics ------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        """Gauges and counters now, plus latency observations made since the previous call."""
        now = StatsCollector.now()
        s = self._stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            block_size=self.block_manager.block_size,
            max_num_seqs=self.config.max_num_seqs,
            tensor_parallel_size=self.config.tensor_parallel_size,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=self.scheduler.prefix_cache_queries,
            prefix_cache_hits_total=self.scheduler.prefix_cache_hits,
            computed_tokens_total=s.computed_tokens_total,
            spec_decode_num_drafts_total=s.spec_num_drafts,
            spec_decode_num_draft_tokens_total=s.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens_total=s.spec_num_accepted_tokens,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            request_success_total=dict(s.request_success_total),
            generation_tokens_per_second=s.rate(now),
            structured_output_requests_total=s.structured_output_requests_total,
            model_weight_bytes=self.model_weight_bytes,
            quantization=self.quantization or "none",
            dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=str(getattr(self.config, "kv_cache_dtype", "auto")),
            grammar_compile_times=self.structured_outputs.drain_compile_times(),
            timestamp=now,
            **s.drain(),
        )
