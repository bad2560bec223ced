"""A tensor-parallel worker process (ranks 1..N-1): loads its shard, then executes what rank 0 sends.

It never schedules or samples. Each step it receives the packed inputs rank 0 prepared, applies
the step's copy-on-write block copies to its own KV pool, runs the forward pass (joining the
all-reduces), and joins the logits all-gather whenever rank 0 computes logits. It exits when told
to, when the engine's pipe closes, or when the engine process goes away (a watchdog thread), so
an engine killed with SIGKILL leaves no worker behind.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvserve.runtime.distributed import protocol

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


def _watch_parent(parent_pid: int) -> None:
    def run():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)  # the engine died without closing us: nothing to report to
            time.sleep(0.5)

    threading.Thread(target=run, name="kvserve-tp-watchdog", daemon=True).start()


def main() -> None:
    """Process entry point: ``python -c ... main() CTRL_FD REPORT_FD`` (see executor.spawn_worker).

    The engine's first message on the control pipe is the pickled (WorkerArgs, EngineConfig).
    """
    import pickle

    # Ctrl-C goes to the whole foreground process group: the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctrl = Connection(int(sys.argv[1]), writable=False)
    report = Connection(int(sys.argv[2]), readable=False)
    try:
        args, config = pickle.loads(ctrl.recv_bytes())
    except EOFError:
        os._exit(0)
    _watch_parent(args.parent_pid)
    try:
        _run(args, config, ctrl, report)
    except EOFError:
        os._exit(0)  # the engine closed our pipe: it is gone or shutting down
    except BaseException:
        try:
            report.send_bytes(protocol.encode(protocol.ERROR, args.rank, traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def _run(args: WorkerArgs, config, ctrl: Connection, report: Connection) -> None:
    import torch
    import torch.distributed as dist

    from kvserve.runtime.attention.selector import get_attention_backend
    from kvserve.runtime.kv_cache import (
        allocate_kv_cache,
        copy_blocks,
        determine_num_blocks,
        kv_cache_bytes,
        kv_cache_torch_dtype,
    )
    from kvserve.runtime.model_config import ModelConfig
    from kvserve.runtime.models import load_model

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.num_threads)
    else:
        torch.cuda.set_device(device)
    report.send_bytes(protocol.encode(protocol.HELLO, args.rank, os.getpid()))
    store = dist.TCPStore(args.store_host, args.store_port, args.world_size, False,
                          timeout=datetime.timedelta(seconds=args.timeout_s))
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        dtype = getattr(torch, args.dtype)
        model_config = ModelConfig.from_pretrained(config.model)
        backend = get_attention_backend(config.attention_backend, device)
        model = load_model(config.model, dtype=dtype, device=device, attention_backend=backend,
                           tp_rank=args.rank, tp_size=args.world_size, config=model_config,
                           quantization=config.quantization)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
        num_blocks = determine_num_blocks(config, model_config.shape, kv_dtype, device)
        report.send_bytes(protocol.encode(protocol.LOADED, args.rank, num_blocks, weight_bytes))

        kind, (num_blocks,) = protocol.decode(ctrl.recv_bytes())
        if kind != protocol.ALLOCATE:
            return
        kv_caches = allocate_kv_cache(model_config.shape, num_blocks, config.block_size, kv_dtype, device,
                                      args.world_size)
        kv_bytes = kv_cache_bytes(kv_caches)
        report.send_bytes(protocol.encode(protocol.READY, args.rank, kv_bytes))

        with torch.inference_mode():
            while True:
                kind, payload = protocol.decode(ctrl.recv_bytes(), device)
                if kind == protocol.SHUTDOWN:
                    return
                if kind != protocol.STEP:
                    raise RuntimeError(f"unexpected message {kind!r}")
                copies, (input_ids, positions, meta, logits_rows) = payload
                copy_blocks(kv_caches, copies)
                hidden = model(input_ids, positions, kv_caches, meta)
                if logits_rows:
                    # Mirrors ModelRunner.execute: rank 0 gathers logits only when it samples.
                    if len(logits_rows) != hidden.shape[0]:
                        hidden = hidden[torch.tensor(logits_rows, device=hidden.device)]
                    model.compute_logits(hidden)
    finally:
        dist.destroy_process_group()
