"""The multi-process executor: tensor parallelism over N ranks, rank 0 in the engine's process.

Design. Ranks 1..N-1 are fresh interpreters (``kvserve.runtime.executor.worker_process``, so a user
script needs no ``if __name__ == "__main__"`` guard) that join a ``torch.distributed`` group with
rank 0 (the platform's collective backend: NCCL on CUDA, gloo on CPU). Every rank runs the same
``Worker``. Each step, the ForwardInput rank 0's ModelRunner built (packed tokens, positions,
attention metadata with one table per KV cache group, logits rows, copy-on-write block copies) is
pickled once and written to every worker's control pipe, then rank 0's own Worker runs it. Row-
parallel layers all-reduce and the vocab-parallel head all-gathers, so rank 0 ends with the full
logits and samples (or verifies drafts) exactly as a single-process engine; that is why every
feature of the single-process executor works here unchanged.

Failures. Each worker's report pipe doubles as its death signal (the worker holds the only write
end, so EOF means it exited). A monitor thread waits on those pipes: a death while idle is seen at
once, the other workers are killed, and on NCCL the process group is aborted so no collective
waits for its timeout. On gloo a collective with a dead peer fails within milliseconds, and every
collective has a timeout (``KVSERVE_TP_TIMEOUT_S``, default 120 s) for a peer that hangs without
dying. Then the step raises ``WorkerDiedError`` naming the rank, pid and cause (signal, exit code,
or the last line of the worker's traceback); the group is torn down and every later step raises
the same error. ``shutdown()`` (engine/LLM ``close()``, their context managers, atexit) stops and
reaps every worker; workers also exit on their own when the engine process disappears.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from kvserve.runtime.executor import protocol
from kvserve.runtime.executor.base import Executor
from kvserve.runtime.executor.forward_input import ForwardInput
from kvserve.runtime.executor.worker_process import Preload, WorkerArgs

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
# Startup handshakes wait at least this long: a fresh interpreter importing torch on a busy
# machine can take seconds, and a worker that dies while starting is reported at once anyway.
STARTUP_TIMEOUT_FLOOR_S = 60.0
# After a failed step, how long to wait for a dead worker to show itself before blaming rank 0.
FAILURE_GRACE_S = 3.0

_BOOT = ("import json, os, sys; sys.path[:0] = json.loads(os.environ.pop('KVSERVE_TP_SYS_PATH', '[]')); "
         "from kvserve.runtime.executor.worker_process import main; main()")

_live: weakref.WeakSet[MultiProcExecutor] = weakref.WeakSet()


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed; the engine cannot step any more."""


class WorkerDiedError(TensorParallelError):
    """A worker process died or failed. ``rank``, ``pid`` and ``cause`` say which and why."""

    def __init__(self, rank: int, pid: int | None, cause: str):
        self.rank, self.pid, self.cause = rank, pid, cause
        super().__init__(f"tensor-parallel worker rank {rank} (pid {pid}) {cause}")


def check_tensor_parallel(model_config, tp: int) -> None:
    """Raises ValueError when the model cannot be split `tp` ways (before any process starts)."""
    shape = model_config.shape
    error = shape.tp_error(tp)
    if error:
        raise ValueError(f"tensor_parallel_size: {error}")
    if shape.moe is None and shape.intermediate_size % tp:  # MoE models: tp_error checks each MLP's size
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's intermediate_size "
                         f"{shape.intermediate_size}")


def rank_devices(device: torch.device, tp: int) -> list[torch.device]:
    """Rank r's device: the CPU for every rank, or consecutive GPUs from the engine's."""
    if device.type == "cpu":
        return [device] * tp
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + tp > count:
        raise ValueError(f"tensor_parallel_size: {tp} ranks from cuda:{first} need {first + tp} GPUs, "
                         f"found {count}")
    return [torch.device("cuda", first + r) for r in range(tp)]


def _timeout_s() -> float:
    raw = os.environ.get("KVSERVE_TP_TIMEOUT_S")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"KVSERVE_TP_TIMEOUT_S: expected seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"KVSERVE_TP_TIMEOUT_S: must be > 0, got {raw!r}")
    return value


def _spawn() -> tuple[subprocess.Popen, int, int]:
    """A worker interpreter and the engine's ends of its pipes (control write, report read)."""
    ctrl_r, ctrl_w = os.pipe()
    report_r, report_w = os.pipe()
    env = dict(os.environ, KVSERVE_TP_SYS_PATH=json.dumps([p for p in sys.path if p]))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank runs on this host
    try:
        popen = subprocess.Popen([sys.executable, "-c", _BOOT, str(ctrl_r), str(report_w)],
                                 pass_fds=(ctrl_r, report_w), env=env)
    finally:
        os.close(ctrl_r)
        os.close(report_w)
    return popen, ctrl_w, report_r


# Worker interpreters started ahead of need (prestart_workers): a live reshape to tensor
# parallelism (runtime/engine/data_parallel.py) then does not wait for Python and torch to start.
# Each has imported what a rank needs and waits for its rank on the control pipe; given a
# preload, it has also loaded the shard of the rank it will most likely get (the 4th item).
_spares: list[tuple[subprocess.Popen, int, int, int | None]] = []
# A preload message waits in the spare's pipe until it has imported torch: it must fit the pipe's
# buffer (64 KiB on Linux), or sending it would block the engine's thread that long.
PRELOAD_MESSAGE_MAX = 32768
_spares_lock = threading.Lock()
_recycle_max = 0  # recycle_workers


def _close_spare(spare: tuple[subprocess.Popen, int, int, int | None]) -> None:
    popen, ctrl_w, report_r, _ = spare
    for fd in (ctrl_w, report_r):
        try:
            os.close(fd)  # the spare reads EOF and exits
        except OSError:
            pass
    try:
        popen.wait(2.0)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()


def prestart_workers(n: int, preload: tuple[Any, int, str, str] | None = None) -> None:
    """Keeps `n` spare worker interpreters ready (0: stops them). `preload`: (engine config,
    world size, device, dtype name) of the tensor-parallel engine they will most likely serve;
    spare i then loads the shard of rank i + 1 while it waits (host memory: CPU devices only)."""
    with _spares_lock:
        dead = [s for s in _spares if s[0].poll() is not None]
        live = [s for s in _spares if s[0].poll() is None]
        extra, live = live[n:], live[:n]
        while len(live) < n:
            popen, ctrl_w, report_r = _spawn()
            rank = None
            if preload is not None:
                config, world_size, device, dtype = preload
                rank = len(live) + 1
                message = pickle.dumps((Preload(rank, world_size, device, dtype, torch.get_num_threads()), config),
                                       protocol=pickle.HIGHEST_PROTOCOL)
                if len(message) > PRELOAD_MESSAGE_MAX:
                    rank = None  # it would wait for the spare to read it: no preload
                else:
                    with Connection(os.dup(ctrl_w), readable=False) as conn:  # ctrl_w stays open
                        conn.send_bytes(message)
            live.append((popen, ctrl_w, report_r, rank))
        _spares[:] = live
    for spare in dead + extra:
        _close_spare(spare)


def recycle_workers(n: int) -> None:
    """Lets up to `n` workers of an engine that closes cleanly stay as spares (0: every worker
    exits with its engine, the default): the next engine's ranks then skip starting Python and
    importing torch. Each has left its process group and dropped its model before it waits."""
    global _recycle_max
    with _spares_lock:
        _recycle_max = max(0, n)


def _recycle_room() -> int:
    with _spares_lock:
        return max(0, _recycle_max - len(_spares))


def _keep_as_spare(w: _WorkerProcess, deadline: float) -> bool:
    """Takes a recycled worker's IDLE report (it has left the group) and makes it a spare."""
    try:
        if not w.report.poll(max(0.0, deadline - time.monotonic())):
            return False
        kind, _ = protocol.decode(w.report.recv_bytes())
    except (EOFError, OSError):
        return False
    if kind != protocol.IDLE or w.popen.poll() is not None:
        return False
    spare = (w.popen, os.dup(w.ctrl.fileno()), os.dup(w.report.fileno()), None)
    with _spares_lock:
        _spares.append(spare)
    return True


def spare_worker_pids() -> list[int]:
    with _spares_lock:
        return [s[0].pid for s in _spares]


def _take_spare(rank: int) -> tuple[subprocess.Popen, int, int] | None:
    """A live spare, the one that preloaded `rank`'s shard if there is one."""
    with _spares_lock:
        for spare in sorted(_spares, key=lambda s: s[3] != rank):
            _spares.remove(spare)
            if spare[0].poll() is None:
                return spare[:3]
            _close_spare(spare)
    return None


class _WorkerProcess:
    """One worker process and its two pipes (control: engine -> worker; report: worker -> engine)."""

    def __init__(self, args: WorkerArgs, config, kv_groups, max_model_len: int) -> None:
        self.rank = args.rank
        self.popen, ctrl_w, report_r = _take_spare(args.rank) or _spawn()
        self.pid = self.popen.pid
        self.ctrl = Connection(ctrl_w, readable=False)
        self.report = Connection(report_r, writable=False)
        self.eof = False  # the report pipe closed: the process has exited (or is exiting)
        self.ctrl.send_bytes(pickle.dumps((args, config, kv_groups, max_model_len), protocol=pickle.HIGHEST_PROTOCOL))

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout_s: float) -> None:
        try:
            self.popen.wait(max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def close(self) -> None:
        self.ctrl.close()
        self.report.close()


class MultiProcExecutor(Executor):
    """Rank 0 here, ranks 1..N-1 in worker processes, one process group."""

    def _start_ranks(self, *, max_step_tokens: int) -> None:
        import torch.distributed as dist

        config, tp = self.config, self.world_size  # every rank: tensor x pipeline parallel
        check_tensor_parallel(self.model_config, config.tensor_parallel_size)
        if config.pipeline_parallel_size > 1:
            from kvserve.runtime.executor.pipeline_worker import check_pipeline_parallel

            check_pipeline_parallel(self.model_config, config.pipeline_parallel_size)
        from kvserve.runtime.executor.rendezvous import Rendezvous

        # Several nodes (a LeaderWorkerSet group): this node hosts ranks 0..local-1, the others connect.
        rdv = Rendezvous.from_env()
        local = tp if rdv is None else rdv.ranks_per_node(tp)
        devices = rank_devices(self.device, local)
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: this process already has a torch.distributed "
                             "group (another tensor-parallel engine?); close it first")
        self.backend = self.driver_worker.platform.dist_backend
        self.timeout_s = _timeout_s()
        self.failure: TensorParallelError | None = None
        self._lock = threading.Lock()
        self._reported = threading.Condition(self._lock)  # notified when reports were read
        self._report_gen = 0
        self._closing = False
        self._closed = False
        self._group_up = False
        self._errors: dict[int, str] = {}
        self._kv_ops: list[tuple] = []  # offload operations for ranks 1..N-1 (rank 0 applied them)
        self._inbox: dict[int, list[tuple[str, Any]]] = {}
        self.lora_targets: dict = {}  # with LoRA: every rank's adaptable modules (from LOADED)
        self._workers: list[_WorkerProcess] = []
        self._monitor: threading.Thread | None = None
        self._stop_r, self._stop_w = os.pipe()
        if sys.platform.startswith("linux") and rdv is None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank runs on this host

        timeout = datetime.timedelta(seconds=self.timeout_s)
        store_host = "127.0.0.1" if rdv is None else rdv.leader_address
        store = dist.TCPStore(store_host, 0 if rdv is None else rdv.store_port, tp, True, timeout=timeout,
                              wait_for_workers=False)
        dtype_name = str(self.dtype).removeprefix("torch.")
        _live.add(self)

        def worker_args(rank: int) -> WorkerArgs:
            return WorkerArgs(rank=rank, world_size=tp, store_host=store_host, store_port=store.port,
                              backend=self.backend, device=str(devices[rank % local]), dtype=dtype_name,
                              num_threads=torch.get_num_threads(), timeout_s=self.timeout_s,
                              parent_pid=os.getpid(), max_step_tokens=max_step_tokens)

        try:
            for rank in range(1, local):
                worker = _WorkerProcess(worker_args(rank), config, self.kv_groups, self.max_model_len)
                self._workers.append(worker)
                self.rank_reports.append(dict(rank=rank, pid=worker.pid))
            if rdv is not None:
                from kvserve.runtime.executor.rendezvous import accept_ranks

                def init_message(rank: int) -> bytes:
                    return pickle.dumps((worker_args(rank), config, self.kv_groups, self.max_model_len),
                                        protocol=pickle.HIGHEST_PROTOCOL)

                remote = accept_ranks(rdv, range(local, tp), init_message, time.monotonic() + rdv.timeout_s)
                self._workers.extend(remote)
                self.rank_reports.extend(dict(rank=r.rank, pid=None, node=r.peer) for r in remote)
            # Join the group only once every worker is up: a worker that fails to start is then
            # reported at once instead of after the rendezvous timeout.
            hello = self._collect(protocol.HELLO, max(self.timeout_s, STARTUP_TIMEOUT_FLOOR_S))
            for w in self._workers:
                if w.pid is None:  # a remote rank: its pid on its own node
                    w.pid = self.rank_reports[w.rank]["pid"] = hello[w.rank][1]
                # a spare that had loaded its shard before its rank came (prestart_workers)
                self.rank_reports[w.rank]["preloaded"] = bool(hello[w.rank][2:3] and hello[w.rank][2])
            dist.init_process_group(self.backend, store=store, rank=0, world_size=tp, timeout=timeout)
            self._group_up = True
        except BaseException:
            self._stop_ranks()
            raise
        log.info("tensor parallel: %d ranks over %s, worker pids %s", tp, self.backend, self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    # -- startup handshakes ----------------------------------------------------------------------
    def _drain_reports(self) -> None:
        """Reads every report waiting on the workers' pipes (errors into `_errors`)."""
        with self._lock:
            for w in self._workers:
                if w.eof or w.report.closed:
                    continue
                try:
                    while w.report.poll():
                        kind, payload = protocol.decode(w.report.recv_bytes())
                        if kind == protocol.ERROR:
                            self._errors[w.rank] = payload[1]
                        else:
                            self._inbox.setdefault(w.rank, []).append((kind, payload))
                        self._report_gen += 1
                except (EOFError, OSError):
                    w.eof = True
                    self._report_gen += 1
            self._reported.notify_all()

    def _collect(self, kind: str, timeout_s: float | None) -> dict[int, tuple[Any, ...]]:
        """Waits for one `kind` report from every worker, failing fast if one dies."""
        got: dict[int, tuple[Any, ...]] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._drain_reports()
            with self._lock:
                seen = self._report_gen
            for rank, queue in self._inbox.items():
                while queue and rank not in got:
                    msg_kind, payload = queue.pop(0)
                    if msg_kind == kind:
                        got[rank] = payload
            if len(got) == len(self._workers):
                return got
            for w in self._workers:
                if w.rank in self._errors or (w.rank not in got and (w.eof or w.exitcode is not None)):
                    raise self._death(w.rank)
            pending = [w for w in self._workers if w.rank not in got]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TensorParallelError(f"tensor-parallel workers {[w.rank for w in pending]} did not "
                                          f"report {kind!r} within {timeout_s:.0f}s")
            if self._monitor is not None and self._monitor.is_alive():
                # The monitor reads the pipes too: what it takes wakes us here, not the pipe.
                with self._lock:
                    self._reported.wait_for(lambda: self._report_gen != seen,
                                            timeout=1.0 if left is None else min(left, 1.0))
            else:
                wait([w.report for w in pending], timeout=left)

    def _agree_kv_blocks(self, blocks: list[int]) -> list[int]:
        """Every rank sized its own KV pools; all use the smallest count per group, so block ids
        mean the same slots everywhere. Sends the agreed counts for the workers to allocate."""
        loaded = self._collect(protocol.LOADED, None)
        agreed = [min(counts) for counts in zip(blocks, *(payload[1] for payload in loaded.values()))]
        for rank, payload in loaded.items():
            self.rank_reports[rank].update(num_kv_blocks_fit=payload[1][0], weight_bytes=payload[2])
            if len(payload) > 3 and payload[3]:
                self.lora_targets.update(payload[3])
        self._send_all(protocol.encode(protocol.ALLOCATE, agreed))
        return agreed

    def _await_ranks_ready(self) -> None:
        ready = self._collect(protocol.READY, max(self.timeout_s, STARTUP_TIMEOUT_FLOOR_S))
        for rank, payload in ready.items():
            self.rank_reports[rank].update(num_kv_blocks=self.rank_reports[0]["num_kv_blocks"],
                                           kv_cache_bytes=payload[1])
        # Started only now: during startup _collect reads the report pipes itself.
        self._monitor = threading.Thread(target=self._watch, args=(weakref.ref(self), self._stop_r),
                                         name="kvserve-tp-monitor", daemon=True)
        self._monitor.start()

    # -- every step ------------------------------------------------------------------------------
    def _forward(self, step: ForwardInput) -> torch.Tensor | None:
        """Sends the step to every worker, then runs it here; a failure names the rank."""
        logits = self._on_driver(lambda: self.driver_worker.execute_model(step), self._step_message(step))
        if self.failure is not None:
            # A worker died during the step and the group was aborted under it (NCCL): its
            # collectives may have returned garbage, so the step's tokens are not used.
            self.check()
        return logits

    def _launch(self, step: ForwardInput):
        """Pipelined: sends the step to every worker and starts rank 0's stage of it."""
        return self._on_driver(lambda: self.driver_worker.launch(step), self._step_message(step))

    def _land(self, handle) -> torch.Tensor | None:
        logits = self._on_driver(lambda: self.driver_worker.land(handle))
        if self.failure is not None:
            self.check()
        return logits

    def _step_message(self, step: ForwardInput) -> bytes:
        self.check()
        if self._kv_ops:
            step.kv_ops, self._kv_ops = self._kv_ops, []
        return protocol.encode(protocol.STEP, step)

    def _on_driver(self, run, message: bytes | None = None):
        """Sends `message` to the workers (when given), then runs rank 0's part; a failure is
        turned into the group's failure, which names the rank."""
        try:
            if message is not None:
                self._send_all(message)
            return run()
        except BaseException as exc:
            failure = self._step_failed(exc)
            if isinstance(exc, Exception):
                raise failure from exc
            raise  # KeyboardInterrupt and the like: the group is torn down, the signal goes on

    def _share_kv_ops(self, ops: list[tuple]) -> None:
        self._kv_ops.extend(ops)  # sent with the next step, applied before its forward pass

    def _load_on_every_rank(self, ops: list[tuple]) -> list[bytes]:
        """Loads go out at once (after the saves and drops still queued, in order) and every
        rank answers with the keys it could not read: the engine forgets a key that failed on
        any rank before a step reads its block."""
        self.check()
        ops, self._kv_ops = self._kv_ops + ops, []
        reports = self._on_driver(lambda: self._collect(protocol.KV_DONE, self.timeout_s),
                                  protocol.encode(protocol.KV_OPS, ops))
        failed = {rank: keys for rank, (_, keys) in reports.items() if keys}
        if failed:
            log.warning("kv offload: rank(s) %s could not load %d block(s) rank 0 loaded; they are recomputed",
                        sorted(failed), len({k for keys in failed.values() for k in keys}))
        return [k for keys in failed.values() for k in keys]

    def check_health(self) -> None:
        self.check()

    # -- failure handling ------------------------------------------------------------------------
    def check(self) -> None:
        """Raises the group's failure, if any. Cheap: for health checks between steps. Call it
        from the thread that steps the engine (it may leave the process group)."""
        if self.failure is not None:
            self._teardown(graceful=False)
            raise self.failure
        if self._closed:
            raise TensorParallelError("the tensor-parallel engine is closed")

    def _send_all(self, data: bytes) -> None:
        for w in self._workers:
            try:
                w.ctrl.send_bytes(data)
            except OSError:
                raise self._death(w.rank, grace_s=FAILURE_GRACE_S) from None

    def _death(self, rank: int, grace_s: float = 1.0) -> WorkerDiedError:
        w = self._workers[rank - 1]
        w.join(grace_s)  # a closed pipe may come a moment before the exit status
        self._drain_reports()
        if rank in self._errors:
            cause = f"failed: {protocol.last_line(self._errors[rank])}"
        elif getattr(w, "lost", None):
            cause = w.lost  # a rank on another node: its connection is all the leader sees
        elif w.exitcode is None:
            cause = "closed its pipe but is still running"
        else:
            cause = protocol.describe_exit(w.exitcode)
        return WorkerDiedError(rank, w.pid, cause)

    def _first_dead(self, timeout_s: float) -> int | None:
        """The rank of a worker that exited or reported an error, waiting up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain_reports()
            for w in self._workers:
                if w.rank in self._errors or w.eof or w.exitcode is not None:
                    return w.rank
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            wait([w.report for w in self._workers], timeout=left)

    def _step_failed(self, exc: BaseException) -> TensorParallelError:
        """Names the failure of a step the workers had joined, and tears the group down."""
        if self.failure is not None:
            failure: TensorParallelError = self.failure
        elif isinstance(exc, WorkerDiedError):
            failure = exc
        elif not isinstance(exc, Exception):
            failure = TensorParallelError(f"a tensor-parallel step was interrupted on rank 0 "
                                          f"({type(exc).__name__})")
        else:
            rank = self._first_dead(FAILURE_GRACE_S)
            if rank is not None:
                failure = self._death(rank)
            else:
                # Every worker is alive: rank 0 failed, or a worker hangs (a collective timeout).
                failure = TensorParallelError(
                    f"tensor-parallel step failed with every worker still running (a hung worker shows "
                    f"as a collective timeout, KVSERVE_TP_TIMEOUT_S={self.timeout_s:g}s): "
                    f"{type(exc).__name__}: {exc}")
        self._fail(failure)
        self._teardown(graceful=False)
        return self.failure  # type: ignore[return-value]

    def _fail(self, failure: TensorParallelError) -> None:
        """Records the first failure and kills every worker. Safe from any thread: leaving the
        process group is left to the engine's thread (a collective may still be running there)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
        log.error("%s; stopping the tensor-parallel group", failure)
        for w in self._workers:
            w.kill()

    @staticmethod
    def _watch(ref: weakref.ref[MultiProcExecutor], stop_r: int) -> None:
        # Holds the executor only weakly between wake-ups, so an engine dropped without close()
        # is still collected (and __del__ stops its workers).
        while True:
            self = ref()
            if self is None or self._closing:
                return
            waitables = [w.report for w in self._workers if not w.eof] + [stop_r]
            del self
            ready = wait(waitables)
            self = ref()
            if self is None or stop_r in ready or self._closing:
                return
            self._drain_reports()
            dead = [w.rank for w in self._workers if w.rank in self._errors or w.eof]
            if not dead:
                continue
            failure = self._death(min(dead), grace_s=1.0)
            if self._closing:
                return
            self._fail(failure)  # first, so a step that the abort below unblocks is discarded
            if self.backend == "nccl":
                self._abort_group()  # unblocks a rank-0 collective NCCL would hold until timeout
            return

    def _abort_group(self) -> None:
        try:
            from torch.distributed import distributed_c10d

            distributed_c10d._abort_process_group()
        except Exception as exc:  # best effort: the collective timeout still bounds the wait
            log.warning("could not abort the process group: %s", exc)

    # -- shutdown --------------------------------------------------------------------------------
    def _stop_ranks(self, timeout_s: float = 5.0) -> None:
        """Stops and reaps every worker and leaves the process group. Idempotent."""
        if hasattr(self, "_workers"):  # _start_ranks may have failed before creating any
            self._teardown(graceful=True, timeout_s=timeout_s)

    def _teardown(self, graceful: bool, timeout_s: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing = True
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass
        # Before they report READY workers may be mid-load or mid-rendezvous, deaf to a shutdown message.
        staying: list[_WorkerProcess] = []  # asked to stay as spares (recycle_workers)
        deadline = time.monotonic() + timeout_s
        if graceful and self.failure is None and getattr(self, "_monitor", None) is not None:
            # Offload operations still waiting for a step (the pool's cached blocks that a
            # persistent tier saves at shutdown) ride the shutdown message: each rank saves its
            # own shard of them before it closes, or a restart would find rank 0's half only.
            ops, self._kv_ops = self._kv_ops, []
            transient = getattr(self, "_transient_writes", None)
            room = _recycle_room()
            for w in self._workers:
                stay = room > 0 and isinstance(w, _WorkerProcess)
                try:
                    w.ctrl.send_bytes(protocol.encode(protocol.SHUTDOWN, ops, transient, stay))
                except OSError:
                    continue
                if stay:
                    staying.append(w)
                    room -= 1
            for w in self._workers:
                if w not in staying:
                    w.join(deadline - time.monotonic())
        leaving = [w for w in self._workers if w not in staying]
        for w in leaving:
            w.kill()
        for w in leaving:
            w.join(timeout_s)
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(1.0)  # before reading the IDLE reports: it reads the same pipes
        for w in staying:
            if not _keep_as_spare(w, deadline):
                w.kill()
                w.join(timeout_s)
        for w in self._workers:
            w.close()
        if monitor is None or not monitor.is_alive():
            for fd in (self._stop_r, self._stop_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self._group_up:
            self._group_up = False
            self._leave_group()
        _live.discard(self)

    def _leave_group(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        try:
            if self.failure is not None and self.backend == "nccl":
                self._abort_group()
            else:
                dist.destroy_process_group()
        except Exception as exc:
            log.warning("leaving the process group: %s", exc)

    def __del__(self) -> None:
        try:
            self._stop_ranks(timeout_s=1.0)
        except Exception:
            pass


@atexit.register
def _shutdown_all() -> None:
    for executor in list(_live):
        executor._stop_ranks(timeout_s=2.0)
    prestart_workers(0)
