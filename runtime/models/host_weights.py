"""Loaded weights kept in host memory while a data-parallel server runs (issue 22: live layouts).

A live layout change (runtime/engine/data_parallel.py) closes G engines and builds others. On the
CPU, building an engine's model is mostly repeated work: reading the checkpoint, copying each
rank's slice, and repacking every full-precision matrix into the native kernels' panels. None of
it depends on the engine, only on (checkpoint, dtype, device, rank, TP degree). So, while a
`retain()` is held, `load_model` records each finished model's state (every module's parameters
and buffers, and the attributes loading and processing set) and hands the same tensors to the next
model of the same shard: a reshape back to a layout seen before, and the second and later
engines of a layout, skip the load. The weights are read-only at inference, so engines stepping
side by side share them (on the CPU, G x TP1 also holds one copy of the weights instead of G).

Only host-memory (CPU) full-precision safetensors models are kept, without pipeline stages: a GPU's
weights live on its device, where holding a second layout's shards would take the memory the
new layout needs; quantized formats and GGUF files are read again (their processing is not all
module state). A checkpoint file rewritten in place (another size or time) is another key.
Process-wide on purpose: the engines that share are built by independent LLMEngine calls.
"""

from __future__ import annotations

import contextlib
import pathlib
import threading
from collections.abc import Hashable, Iterator
from typing import Any

from torch import nn

# Module attributes a snapshot never copies: the containers (their contents are handled per
# entry) and the torch hooks bookkeeping a fresh module already has.
_CONTAINERS = frozenset({"_parameters", "_buffers", "_modules"})

# Module name -> (its parameters, its buffers, the attributes loading and processing set).
Snapshot = dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]

_lock = threading.Lock()
_retained = 0
_snapshots: dict[Hashable, Snapshot] = {}
_key_locks: dict[Hashable, threading.Lock] = {}


@contextlib.contextmanager
def retained() -> Iterator[None]:
    retain()
    try:
        yield
    finally:
        release()


def retain() -> None:
    """Starts (or joins) keeping loaded weights; each retain() needs one release()."""
    global _retained
    with _lock:
        _retained += 1


def release() -> None:
    """Drops the kept weights once the last holder releases (engines still running keep theirs)."""
    global _retained
    with _lock:
        _retained = max(0, _retained - 1)
        if not _retained:
            _snapshots.clear()
            _key_locks.clear()


def is_retained() -> bool:
    return _retained > 0


def keys() -> list[Hashable]:
    with _lock:
        return list(_snapshots)


def snapshot_key(model_dir: str, *, dtype: Any, device: Any, tp_rank: int, tp_size: int,
                 quant_config: Any, layer_range: Any) -> Hashable | None:
    """The key of a model's shard, or None where its weights are not kept (see the module doc)."""
    if not _retained or str(device) != "cpu" or quant_config is not None or layer_range is not None:
        return None
    # The files' sizes and times too: a checkpoint rewritten in place is another key, never
    # answered with the old tensors.
    path = pathlib.Path(model_dir)
    if not path.is_dir():  # a GGUF file: read again (see the module doc)
        return None
    try:
        files = tuple((f.name, st.st_size, st.st_mtime_ns) for f in sorted(path.glob("*.safetensors"))
                      for st in (f.stat(),))
    except OSError:
        return None
    return (str(model_dir), files, str(dtype), tp_rank, tp_size)


@contextlib.contextmanager
def loading(key: Hashable | None) -> Iterator[None]:
    """Serialises loads of one shard, so engines starting side by side load it once and the
    others take the first one's tensors."""
    if key is None:
        yield
        return
    with _lock:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        yield


def lookup(key: Hashable | None) -> Snapshot | None:
    if key is None:
        return None
    with _lock:
        return _snapshots.get(key)


def module_state(module: nn.Module) -> dict[str, Any]:
    """A module's own attributes (not its containers): what `record` compares before and after
    the weights were loaded and processed."""
    return {k: v for k, v in vars(module).items() if k not in _CONTAINERS}


def record(key: Hashable | None, model: nn.Module, before: dict[str, dict[str, Any]]) -> None:
    """Keeps `model`'s loaded state: each module's parameters and buffers, and the attributes
    loading and processing added or replaced (`before`: module_state of each module as built)."""
    if key is None:
        return
    snap: Snapshot = {}
    for name, module in model.named_modules():
        old = before.get(name, {})
        attrs = {k: v for k, v in module_state(module).items() if k not in old or old[k] is not v}
        snap[name] = (dict(module._parameters), dict(module._buffers), attrs)
    with _lock:
        if _retained:
            _snapshots.setdefault(key, snap)


def apply(model: nn.Module, snap: Snapshot) -> None:
    """Gives a freshly built model (same shard) the kept tensors and processing attributes."""
    modules = dict(model.named_modules())
    if set(modules) != set(snap):
        raise RuntimeError("host_weights: the model's modules differ from the kept snapshot")
    for name, (params, buffers, attrs) in snap.items():
        module = modules[name]
        module._parameters.clear()
        module._parameters.update(params)
        module._buffers.clear()
        module._buffers.update(buffers)
        for k, v in attrs.items():
            object.__setattr__(module, k, v)
