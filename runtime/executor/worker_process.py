"""The process around a tensor-parallel Worker of rank 1..N-1: startup handshakes, then a loop
that hands every step rank 0 broadcasts to the same ``Worker.execute_model`` rank 0 runs.

It never schedules or samples. It exits when told to, when the engine's pipe closes, or when the
engine process goes away (a watchdog thread), so an engine killed with SIGKILL leaves no worker
behind.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvserve.runtime.executor import protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    world_size: int
    store_host: str
    store_port: int
    backend: str  # "gloo" | "nccl"
    device: str  # this rank's device, e.g. "cpu" or "cuda:1"
    dtype: str  # "float32" | "float16" | "bfloat16"
    num_threads: int
    timeout_s: float
    parent_pid: int
    max_step_tokens: int  # the most tokens one step packs (KV groups size their pools by it)


@dataclass(frozen=True)
class Preload:
    """What a spare worker (multiproc.prestart_workers) loads before it gets its rank: the shard
    of `rank` of `world_size` that a reshape to that TP degree will ask of it (CPU only: the
    shard waits in host memory)."""
    rank: int
    world_size: int
    device: str
    dtype: str
    num_threads: int


def _preload(preload: Preload, config):
    """A Worker with its shard loaded, or None if that failed (the real start reports it)."""
    import torch

    from kvserve.runtime.executor.base import worker_class
    from kvserve.runtime.model_config import ModelConfig

    try:
        device = torch.device(preload.device)
        if device.type == "cpu":
            torch.set_num_threads(preload.num_threads)
        worker = worker_class(config)(config, ModelConfig.from_pretrained(config.model), device=device,
                                      dtype=getattr(torch, preload.dtype), rank=preload.rank,
                                      world_size=preload.world_size)
        worker.load_model()
        return worker
    except Exception:
        log.warning("a spare worker could not preload rank %d of %d; it loads when its rank comes",
                    preload.rank, preload.world_size, exc_info=True)
        return None


def _watch_parent(parent_pid: int) -> None:
    def run():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)  # the engine died without closing us: nothing to report to
            time.sleep(0.5)

    threading.Thread(target=run, name="kvserve-tp-watchdog", daemon=True).start()


def main() -> None:
    """Process entry point: ``python -c ... main() CTRL_FD REPORT_FD`` (see multiproc.WorkerProcess).

    The engine's first message on the control pipe is the pickled (WorkerArgs, EngineConfig,
    KV cache groups, max_model_len).
    """
    import pickle

    # Ctrl-C goes to the whole foreground process group: the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctrl = Connection(int(sys.argv[1]), writable=False)
    report = Connection(int(sys.argv[2]), readable=False)
    # What every rank needs, before waiting for the rank: a spare started ahead of a reshape
    # (multiproc.prestart_workers) has it loaded by the time its rank comes.
    import torch  # noqa: F401

    from kvserve.runtime.executor import worker  # noqa: F401
    watched = False
    while True:
        preloaded = None
        try:
            message = pickle.loads(ctrl.recv_bytes())
            if isinstance(message[0], Preload):
                preloaded = [(message[0], message[1], _preload(*message))]
                message = pickle.loads(ctrl.recv_bytes())
            args, config, kv_groups, max_model_len = message
        except EOFError:
            os._exit(0)
        if not watched:
            _watch_parent(args.parent_pid)
            watched = True
        if not _serve(args, config, kv_groups, max_model_len, ctrl, report, preloaded):
            os._exit(0)
        # Kept for the engine's next group (multiproc.recycle_workers): the last one's model,
        # pools and process group are gone; the imports stay.
        del preloaded, message, config
        gc.collect()


def main_remote() -> None:
    """Entry point of a rank on another node (``kvserve worker`` starts one per local rank, rank
    in ``KVSERVE_RANK``): connects to the leader (runtime/executor/rendezvous.py), then runs the
    same loop as a local worker over that one connection."""
    import dataclasses
    import pickle

    from kvserve.runtime.executor.rendezvous import Rendezvous, connect

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = int(os.environ["KVSERVE_RANK"])
    conn = connect(Rendezvous.from_env(), rank)
    try:
        args, config, kv_groups, max_model_len = pickle.loads(conn.recv_bytes())
    except EOFError:
        os._exit(0)
    # The watchdog follows the node's `kvserve worker` process, not the leader's.
    args = dataclasses.replace(args, parent_pid=os.getppid())
    _watch_parent(args.parent_pid)
    _serve(args, config, kv_groups, max_model_len, conn, conn)
    os._exit(0)


def _serve(args: WorkerArgs, config, kv_groups, max_model_len: int, ctrl: Connection, report: Connection,
           preloaded=None) -> bool:
    """Runs one engine's rank; True when the engine asked this process to stay for another."""
    try:
        if _run(args, config, kv_groups, max_model_len, ctrl, report, preloaded):
            report.send_bytes(protocol.encode(protocol.IDLE, args.rank))
            return True
    except EOFError:
        os._exit(0)  # the engine closed our pipe: it is gone or shutting down
    except BaseException:
        try:
            report.send_bytes(protocol.encode(protocol.ERROR, args.rank, traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)
    return False


def _run(args: WorkerArgs, config, kv_groups, max_model_len: int, ctrl: Connection, report: Connection,
         preloaded=None) -> bool:
    """One engine's rank, until its shutdown; True when asked to stay for another engine."""
    import torch
    import torch.distributed as dist

    from kvserve.runtime.executor.base import worker_class
    from kvserve.runtime.executor.platform import held_release
    from kvserve.runtime.model_config import ModelConfig

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.num_threads)
    worker = None
    if preloaded is not None:
        want = Preload(args.rank, args.world_size, args.device, args.dtype, args.num_threads)
        spec, preload_config, worker = preloaded.pop()  # the only reference left: dropped below if unused
        from kvserve.runtime.engine.reshape_kv import without_transient

        # A reshape's transient KV tier does not change what was loaded.
        if worker is not None and (spec != want or without_transient(preload_config) != without_transient(config)):
            worker = None  # loaded for another rank or engine: dropped, this one loads its own
        elif worker is not None:
            worker.config = config
    loaded = worker is not None
    if worker is None:
        worker = worker_class(config)(config, ModelConfig.from_pretrained(config.model), device=device,
                        dtype=getattr(torch, args.dtype), rank=args.rank, world_size=args.world_size)
    report.send_bytes(protocol.encode(protocol.HELLO, args.rank, os.getpid(), loaded))
    store = dist.TCPStore(args.store_host, args.store_port, args.world_size, False,
                          timeout=datetime.timedelta(seconds=args.timeout_s))
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        if not loaded:
            worker.load_model()
        blocks = worker.determine_kv_blocks(kv_groups, max_model_len=max_model_len,
                                            max_step_tokens=args.max_step_tokens)
        # With LoRA, each rank's adaptable modules: rank 0 checks adapters against every stage's.
        lora_targets = worker.lora.target_shapes if worker.lora is not None else None
        report.send_bytes(protocol.encode(protocol.LOADED, args.rank, blocks, worker.weight_bytes, lora_targets))

        kind, (blocks,) = protocol.decode(ctrl.recv_bytes())
        if kind != protocol.ALLOCATE:
            return False
        kv_bytes = worker.initialize_kv_cache(blocks, kv_groups)
        report.send_bytes(protocol.encode(protocol.READY, args.rank, kv_bytes))
        # After READY: rank 0 captures once every rank has reported, and capture runs collectives.
        worker.compile_and_capture(max_model_len=max_model_len)

        while True:
            kind, payload = protocol.decode(ctrl.recv_bytes())
            if kind == protocol.SHUTDOWN:
                if payload and payload[0] and worker.offloader is not None:
                    worker.offloader.apply(payload[0])  # written before close() returns
                if len(payload) > 1 and payload[1]:  # a reshape moves its requests' KV
                    worker.write_transient_tier(*payload[1])
                return len(payload) > 2 and bool(payload[2])  # stay for another engine
            if kind == protocol.KV_OPS:
                failed = worker.offloader.apply(payload[0])
                report.send_bytes(protocol.encode(protocol.KV_DONE, args.rank, failed))
                continue
            if kind != protocol.STEP:
                raise RuntimeError(f"unexpected message {kind!r}")
            worker.execute_model(payload[0])
    finally:
        with held_release(worker.platform, release=False):  # no collection here: the process exits
            worker.close()                                  # next, or main() collects before it waits
        dist.destroy_process_group()
