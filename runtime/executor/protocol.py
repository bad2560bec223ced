"""What travels between the engine (rank 0) and its tensor-parallel workers, as bytes.

Pure and I/O-free. A step message carries the ``ForwardInput`` rank 0 prepared (dataclasses of
tensors, ``AttentionMetadata`` with its per-window dict, lists, ints), so a field added to either
travels without a protocol change. Tensors go as numpy arrays (pickled once for all workers) and
come back as CPU tensors; each Worker moves them to its device. A device tensor is refused: rank 0
prepares on the host, so one here would be a copy back every step.
"""

from __future__ import annotations

import dataclasses
import pickle
import signal
from typing import Any

import torch

# Message kinds, engine -> worker.
STEP = "step"
ALLOCATE = "allocate"
SHUTDOWN = "shutdown"
KV_OPS = "kv_ops"  # offload operations with loads: applied at once, answered with KV_DONE
# Reports, worker -> engine.
HELLO = "hello"
LOADED = "loaded"
READY = "ready"
ERROR = "error"
KV_DONE = "kv_done"  # the keys of KV_OPS' loads this rank could not load
IDLE = "idle"  # after a SHUTDOWN asking it to stay: the worker left the group and waits for an engine


class _Tensor:
    __slots__ = ("array", "tensor")

    def __init__(self, t: torch.Tensor):
        t = t.detach()
        if t.device.type != "cpu":
            # Rank 0 prepares every step on the host and each rank moves it to its own device;
            # a device tensor here would be a copy back to the host every step (a sync).
            raise ValueError(f"a message to the workers carries host tensors only; got one on {t.device} "
                             f"(shape {tuple(t.shape)})")
        try:
            self.array, self.tensor = t.numpy(), None
        except TypeError:  # dtypes numpy lacks (bfloat16): pickle the tensor itself
            self.array, self.tensor = None, t


class _Dataclass:
    __slots__ = ("cls", "fields")

    def __init__(self, cls: type, fields: dict[str, Any]):
        self.cls, self.fields = cls, fields


def _pack(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _Tensor(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _Dataclass(type(obj), {f.name: _pack(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                      if f.init})
    if isinstance(obj, tuple):
        return tuple(_pack(x) for x in obj)
    if isinstance(obj, list):
        return [_pack(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    return obj


def _unpack(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, _Tensor):
        t = torch.from_numpy(obj.array) if obj.tensor is None else obj.tensor
        return t.to(device, non_blocking=True) if device.type != "cpu" else t
    if isinstance(obj, _Dataclass):
        return obj.cls(**{k: _unpack(v, device) for k, v in obj.fields.items()})
    if isinstance(obj, tuple):
        return tuple(_unpack(x, device) for x in obj)
    if isinstance(obj, list):
        return [_unpack(x, device) for x in obj]
    if isinstance(obj, dict):
        return {k: _unpack(v, device) for k, v in obj.items()}
    return obj


def encode(kind: str, *payload: Any) -> bytes:
    """One message: a kind and a payload of tensors, dataclasses, lists, tuples and scalars."""
    return pickle.dumps((kind, _pack(payload)), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes, device: torch.device | str = "cpu") -> tuple[str, tuple[Any, ...]]:
    kind, payload = pickle.loads(data)
    return kind, _unpack(payload, torch.device(device))


def describe_exit(exitcode: int | None) -> str:
    """A process exit code in words: 'killed by signal SIGKILL', 'exited with code 1'."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by signal {name}"
    return f"exited with code {exitcode}"


def last_line(text: str) -> str:
    """The last non-empty line of a traceback (the exception and its message)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
