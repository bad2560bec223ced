"""Grammar compilation (off the engine and server loops, bounded, cached) and per-sample grammar matchers.

xgrammar does the work: ``TokenizerInfo`` maps the model's vocabulary (padded to the model's
logits width: rows the tokenizer does not have are never allowed), ``GrammarCompiler`` turns a
schema / regex / EBNF into a ``CompiledGrammar`` (its token-mask cache), and one ``GrammarMatcher``
per sample follows the accepted tokens and fills that sample's row of the step's token bitmask.

A compile is a job: its grammar is first checked against the limits (``limits.GrammarLimits``),
then compiled in a killable worker process (``worker_pool``) under a timeout, and only a grammar
that compiled there in time is compiled again here for use. Jobs wait in a fair queue
(``admission``); one key is one job however many requests wait for it, and a job nobody waits for
any more is dropped (waiting) or its worker killed (running). Finished compiles, failures
included, are kept in an LRU bounded by entries and bytes, so a schema is compiled once and a bad
or too-slow one is refused again without compiling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.runtime.executor.platform import platform_for
from kvserve.runtime.structured_outputs.admission import (
    Client,
    CompileSettings,
    check_admission,
    pick_next,
)
from kvserve.runtime.structured_outputs.compile import (
    MAX_JSON_WHITESPACE,  # noqa: F401  (re-exported)
    choice_grammar,  # noqa: F401  (re-exported)
    compile_params,
)
from kvserve.runtime.structured_outputs.compile import string_lengths_as_patterns as _string_lengths_as_patterns  # noqa: F401
from kvserve.runtime.structured_outputs.limits import GrammarLimits
from kvserve.runtime.structured_outputs.params import StructuredOutputsParams
from kvserve.runtime.structured_outputs.worker_pool import CompileWorker

log = logging.getLogger(__name__)


class GrammarState:
    """One sample's position in its grammar. Only the engine thread touches it."""

    __slots__ = ("matcher", "manager")

    def __init__(self, matcher: Any, manager: StructuredOutputManager) -> None:
        self.matcher = matcher
        self.manager = manager

    def accept(self, token_id: int) -> bool:
        """Advances by one sampled token; False if the grammar does not allow it (nothing changes)."""
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


@dataclass(eq=False)
class _Job:
    key: tuple
    params: StructuredOutputsParams
    client: Client
    future: Future = field(default_factory=Future)
    waiters: int = 1
    running: bool = False
    cancelled: bool = False
    pid: int | None = None  # the worker process compiling it, once it runs


class CompileTicket:
    """One waiter's hold on a compile: ``release()`` when it stops waiting (answered or gone);
    the last release of an unfinished compile stops it. Idempotent."""

    __slots__ = ("future", "_release")

    def __init__(self, future: Future, release=None) -> None:
        self.future = future
        self._release = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def _failed(exc: BaseException) -> Future:
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


class StructuredOutputManager:
    """Built by the engine; xgrammar's import and vocabulary scan (~1 s for a 50k vocabulary) and
    the worker processes wait for the first structured request, in a compile thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 limits: GrammarLimits | None = None, settings: CompileSettings | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.limits = limits or GrammarLimits()
        self.settings = settings or CompileSettings()
        self._lock = threading.Condition()
        # Finished compiles (a CompiledGrammar or the ValueError refusing it), least recently used first.
        self._futures: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_bytes = 0
        self._jobs: dict[tuple, _Job] = {}  # waiting or running
        self._waiting: deque[_Job] = deque()
        self._running: Counter = Counter()  # client -> its running compiles
        self._owned: Counter = Counter()  # client -> its waiting and running compiles
        self._slots: list[threading.Thread] = []
        self._workers: list[CompileWorker] = []
        self._closed = False
        self._info = None
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None
        # Observations for the engine's stats: compile seconds, drained by get_stats().
        self.compile_times: deque[float] = deque(maxlen=10_000)

    def configure(self, limits: GrammarLimits | None = None, settings: CompileSettings | None = None,
                  start_workers: bool = True) -> None:
        """The server's flags, before the first compile. ``start_workers``: start the worker
        processes now, in the background, rather than with the first structured request (whose
        answer would otherwise wait the ~3 s they take to import xgrammar)."""
        with self._lock:
            if self._slots:
                raise RuntimeError("structured outputs: configure() after compiles started")
            self.limits = limits or self.limits
            self.settings = settings or self.settings
            self._evict()
            if start_workers:
                self._start_slots()

    # -- compilation (any thread) --------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> Future:
        """A Future of the compiled grammar; its exception is a ValueError naming the field. For
        in-process callers: never capped, never cancelled (bounded by the compile timeout only)."""
        return self.acquire(params, client=None).future

    def acquire(self, params: StructuredOutputsParams, client: Client) -> CompileTicket:
        """A hold on the compile of ``params`` for ``client`` (the server passes the peer address).
        Raises GrammarCompileBusy if the client or the queue has no room (nothing is started)."""
        key = params.key()
        with self._lock:
            ticket = self._join(key)
        if ticket is not None:
            return ticket
        try:  # outside the lock: a walk over a big schema must not hold up other requests' lookups
            self.limits.check(params)
        except ValueError as exc:
            return CompileTicket(_failed(exc))  # not cached: checking again costs less than keeping it
        with self._lock:
            ticket = self._join(key)  # someone may have started it meanwhile
            if ticket is not None:
                return ticket
            check_admission(client, self._owned[client], len(self._waiting), self.settings)
            if self._closed:
                return CompileTicket(_failed(RuntimeError("structured outputs: the engine is closed")))
            job = _Job(key, params, client)
            self._jobs[key] = job
            self._waiting.append(job)
            if client is not None:
                self._owned[client] += 1
            self._start_slots()
            self._lock.notify_all()
            return CompileTicket(job.future, lambda: self._release(job))

    def _join(self, key: tuple) -> CompileTicket | None:
        """Under the lock: a hold on a finished or running compile of ``key``, if there is one."""
        fut = self._futures.get(key)
        if fut is not None and not fut.cancelled():
            self._futures.move_to_end(key)
            return CompileTicket(fut)
        job = self._jobs.get(key)
        if job is not None and not job.cancelled:
            job.waiters += 1
            return CompileTicket(job.future, lambda: self._release(job))
        return None

    def _release(self, job: _Job) -> None:
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done() or job.cancelled:
                return
            job.cancelled = True  # a running one: its slot sees it within worker_pool.POLL_S and kills the worker
            if not job.running:
                self._waiting.remove(job)
                self._finish(job)
                job.future.cancel()
            self._lock.notify_all()

    def _finish(self, job: _Job) -> None:
        """Under the lock: the job leaves the queue's books; what it gives is cached by the caller."""
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        if job.client is not None:
            self._owned[job.client] -= 1
            if not self._owned[job.client]:
                del self._owned[job.client]

    def _start_slots(self) -> None:
        while len(self._slots) < self.settings.workers:
            slot = threading.Thread(target=self._run_slot, args=(len(self._slots),),
                                    name=f"kvserve-grammar-{len(self._slots)}", daemon=True)
            self._slots.append(slot)
            slot.start()

    def _next_job(self) -> _Job | None:
        """Under the lock: blocks until a job may start (None once closed)."""
        while not self._closed:
            index = pick_next([j.client for j in self._waiting], self._running, self.settings)
            if index is not None:
                job = self._waiting[index]
                del self._waiting[index]
                job.running = True
                if job.client is not None:
                    self._running[job.client] += 1
                return job
            self._lock.wait()
        return None

    def _run_slot(self, slot: int) -> None:
        worker = None
        try:
            try:  # ready before the first job, so that no compile's time pays for the start
                self._get_compiler()
                worker = CompileWorker(self._tokenizer_info().serialize_json())
                with self._lock:
                    self._workers.append(worker)
                worker.start(lambda: self._closed)
            except ValueError:
                pass  # a tokenizer xgrammar cannot use: every job says so (_run_job)
            while True:
                if worker is not None and not self._closed:
                    worker.start(lambda: self._closed)  # after a kill: a fresh one now, not in the next compile's time
                with self._lock:
                    job = self._next_job()
                if job is None:
                    return
                try:
                    result = self._run_job(job, worker)
                except BaseException as exc:  # noqa: BLE001 - every waiter gets an answer
                    result = ValueError(f"structured_outputs.{job.params.kind}: {type(exc).__name__}: {exc}")
                    if not isinstance(exc, Exception):
                        raise
                finally:
                    with self._lock:
                        if job.client is not None:
                            self._running[job.client] -= 1
                            if not self._running[job.client]:
                                del self._running[job.client]
                        self._finish(job)
                        if job.cancelled or result is None:
                            job.future.cancel()
                        elif isinstance(result, ValueError):  # the grammar's fault: refused again at once
                            job.future.set_exception(result)
                            self._cache(job.key, job.future)
                        elif isinstance(result, BaseException):  # the server's: the next request tries again
                            job.future.set_exception(result)
                        else:
                            job.future.set_result(result)
                            self._cache(job.key, job.future)
                        self._lock.notify_all()
        finally:
            if worker is not None:
                worker.kill()

    def _run_job(self, job: _Job, worker: CompileWorker):
        """A CompiledGrammar, a ValueError to answer with (the grammar's fault), a RuntimeError
        (the server's), or None if cancelled."""
        kind = job.params.kind
        try:
            self._get_compiler()
        except ValueError as exc:
            return exc
        assert worker is not None
        if worker.start(lambda: job.cancelled):
            job.pid = worker.pid
        outcome = worker.trial(job.params.to_dict(), self.settings.timeout_s, lambda: job.cancelled,
                               max_growth_bytes=self.settings.max_compile_bytes)
        if outcome.status == "cancelled":
            return None
        if outcome.status == "unavailable":
            return RuntimeError("structured outputs: no grammar compile worker could be started (see the server log)")
        if outcome.status == "memory":
            log.warning("grammar compile (%s, %d bytes, client %s) stopped at %s: memory limit", kind,
                        len(job.key[1]), job.client, outcome.detail)
            return ValueError(f"structured_outputs.{kind}: compiling this grammar took more than the server's limit "
                              f"of {self.settings.max_compile_bytes >> 20} MiB of memory "
                              "(--structured-outputs-compile-max-memory); simplify it")
        if outcome.status == "timeout":
            log.warning("grammar compile (%s, %d bytes, client %s) stopped after %.1fs: timeout", kind,
                        len(job.key[1]), job.client, outcome.seconds)
            return ValueError(f"structured_outputs.{kind}: compiling this grammar took longer than the server's "
                              f"limit of {self.settings.timeout_s:g} s (--structured-outputs-compile-timeout); "
                              "simplify it (fewer alternatives, smaller enums, shorter patterns)")
        if outcome.status == "died":
            log.warning("grammar worker died compiling a %s grammar (%d bytes, client %s): %s", kind,
                        len(job.key[1]), job.client, outcome.detail)
            return ValueError(f"structured_outputs.{kind}: the grammar engine's worker died compiling this grammar "
                              f"({outcome.detail}); simplify it")
        if outcome.status == "error":
            return ValueError(outcome.detail)
        try:
            return self._compile(job.params)
        except ValueError as exc:
            return exc

    def _cache(self, key: tuple, fut: Future) -> None:
        """Under the lock: keeps a finished compile and evicts the least recently used past the bounds."""
        old = self._futures.pop(key, None)
        if old is not None:
            self._cache_bytes -= _size(old)
        self._futures[key] = fut
        self._cache_bytes += _size(fut)
        self._evict()

    def _evict(self) -> None:
        while len(self._futures) > 1 and (len(self._futures) > self.settings.cache_entries
                                          or self._cache_bytes > self.settings.cache_bytes):
            old_key, old = next(iter(self._futures.items()))
            if not old.done():
                break  # put there by hand (tests): someone waits on it
            del self._futures[old_key]
            self._cache_bytes -= _size(old)

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._workers if w.pid is not None]

    def _tokenizer_info(self):
        with self._compiler_lock:
            if self._info is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # Special tokens (<|im_start|>, <s>, ...) are text to xgrammar, but the
                # detokenizer drops them: an empty entry is one xgrammar never allows.
                special = {t for t in getattr(self.tokenizer, "all_special_ids", [])}
                special |= {i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items()
                            if getattr(t, "special", False)}
                special -= set(info.stop_token_ids)
                if special:
                    vocab = list(info.decoded_vocab)
                    for i in special:
                        if 0 <= i < len(vocab):
                            vocab[i] = b""
                    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                             stop_token_ids=list(info.stop_token_ids), add_prefix_space=False)
                self._info = info
            return self._info

    def _get_compiler(self):
        try:
            info = self._tokenizer_info()
        except Exception as exc:  # e.g. a tokenizer type xgrammar does not know
            raise ValueError(f"structured_outputs: this model's tokenizer cannot be used by the grammar "
                             f"engine: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams):
        """Compiles here, in the calling thread: only for grammars a worker compiled in time."""
        compiler = self._get_compiler()
        start = time.perf_counter()
        compiled = compile_params(compiler, params)
        self.compile_times.append(time.perf_counter() - start)
        return compiled

    def drain_compile_times(self) -> list[float]:
        """Compile durations (seconds) since the previous call; each is returned once."""
        out = []
        while True:
            try:
                out.append(self.compile_times.popleft())
            except IndexError:
                return out

    def close(self) -> None:
        """Stops the slots and kills the worker processes; waiting compiles are cancelled."""
        with self._lock:
            self._closed = True
            for job in self._waiting:
                job.cancelled = True
                self._finish(job)
                job.future.cancel()
            self._waiting.clear()
            for job in self._jobs.values():
                job.cancelled = True
            self._lock.notify_all()
            slots = list(self._slots)
        for slot in slots:
            slot.join(10)

    # -- matchers (engine thread) ----------------------------------------------------------------------
    def new_state(self, compiled: Any) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled), self)

    def bitmask(self, num_rows: int) -> torch.Tensor:
        """The step's bitmask buffer (int32, one bit per vocabulary entry), reused across steps."""
        words = (self.vocab_size + 31) // 32
        buf = self._bitmask
        if buf is None or buf.shape[0] < num_rows:
            buf = self._bitmask = torch.empty((max(num_rows, 8), words), dtype=torch.int32)
        return buf[:num_rows]


def _size(fut: Future) -> int:
    """What a cached compile holds: the CompiledGrammar's own estimate (0 for a refusal)."""
    if fut.done() and not fut.cancelled() and fut.exception() is None:
        return int(getattr(fut.result(), "memory_size_bytes", 0) or 0)
    return 0


def apply_grammar_bitmask(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """Masks, in place, the logits rows whose sample has a grammar (states[i] for row i; None rows
    are untouched): one bitmask for the whole step, each grammar row filled by its matcher, then
    applied once. Columns past the grammar's vocabulary (a padded LM head) are masked too."""
    filled = fill_grammar_bitmask(states)
    if filled is not None:
        apply_token_bitmask(logits, *filled)


def fill_grammar_bitmask(states: list[GrammarState | None]) -> tuple[torch.Tensor, list[int], int] | None:
    """The step's bitmask (a view of the manager's reused buffer), the rows it masks and the
    grammar's vocabulary size; None when no row has a live grammar."""
    rows = [i for i, s in enumerate(states) if s is not None and not s.is_terminated]
    if not rows:
        return None
    manager = states[rows[0]].manager
    mask = manager.bitmask(len(states))
    for i in rows:
        states[i].matcher.fill_next_token_bitmask(mask, i)
    return mask, rows, manager.vocab_size


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Masks `rows` of `logits` in place by `mask` (and every column past `vocab_size`)."""
    import xgrammar as xgr

    if logits.device.type != "cpu":
        mask = mask.to(logits.device, non_blocking=True)
    if logits.shape[1] > vocab_size:
        logits[rows, vocab_size:] = float("-inf")
    if platform_for(logits.device).native_token_bitmask(logits):
        from kvserve.kernels.cpu import native

        # xgrammar's CPU kernel tests one bit at a time: ~9 ms for 32 rows of a 49k vocabulary,
        # as much as the rest of the sampler at batch 32 on the fast path; the native one ~0.3 ms.
        native.apply_token_bitmask(logits, mask, rows, vocab_size)
        return
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab_size, indices=rows)


def apply_grammar_to_drafts(logits: torch.Tensor, state: GrammarState, drafts: list[int]) -> None:
    """Masks a verification span in place: row j (of len(drafts) + 1) gets the mask of the
    grammar state after drafts[:j]. The matcher walks the drafts and rolls back to where it was;
    a draft the grammar refuses leaves the rows after it unmasked (verification stops at that
    draft anyway: its masked probability is 0)."""
    import xgrammar as xgr

    if state.is_terminated:
        return
    mask = state.manager.bitmask(len(drafts) + 1)
    rows, walked = [], 0
    for j in range(len(drafts) + 1):
        state.matcher.fill_next_token_bitmask(mask, j)
        rows.append(j)
        if j == len(drafts) or not state.accept(drafts[j]):
            break
        walked += 1
        if state.is_terminated:
            break
    state.rollback(walked)
    if logits.device.type != "cpu":
        mask = mask.to(logits.device, non_blocking=True)
    vocab = state.manager.vocab_size
    if logits.shape[1] > vocab:
        logits[rows, vocab:] = float("-inf")
    xgr.apply_token_bitmask_inplace(logits, mask[: len(drafts) + 1], vocab_size=vocab, indices=rows)
