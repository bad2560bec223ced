"""One rank's side of the offload tier: copies blocks between its KV pools and the stores.

The engine decides (manager.py); every rank applies the same list of operations to its own pools
and stores, in order:

- ``("save", store, group, block, key)``: copy the block out now (a gather on the device and one
  copy to the host); a file store's write happens on a background thread, so a step never waits
  for the disk. Until written, the bytes stay in ``_pending`` and a load finds them there.
- ``("load", store, group, block, key)``: copy the key's bytes into the block (all the loads of a
  batch go in with one scatter per layer pool). A key that cannot be read (a missing, truncated or
  corrupt file) is reported back and its block left untouched.
- ``("drop", store, key)``: forget the key (a file is deleted after any write still queued).
- ``("close", store)``: stop using the store (a reshape's transient tier, once its requests
  have read their blocks: runtime/engine/reshape_kv.py): queued writes finish, then it is closed.
- ``("prefetch", store, keys)``: a file store's blocks that waiting requests will load: a reader
  thread reads and checks them now, so the load at admission copies bytes already in memory
  instead of opening, reading and checksumming files while the step waits. Only a hint: a key not
  staged in time is read at the load as before, and staged bytes are capped (oldest go first).

``store`` is 0 for the tier and 1 for the swap space. ``group`` is the KV cache group whose layers
the block belongs to (0 without groups).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

TIER, SWAP = 0, 1
# Bytes read ahead for waiting requests and not loaded yet (a few returning conversations' prefixes).
STAGED_MAX_BYTES = 256 * 2**20
MARKER_BYTES = 1


def _u8(pool: torch.Tensor) -> torch.Tensor:
    """A pool's bytes: [num_blocks, block bytes] (the same memory)."""
    return pool.view(torch.uint8).view(pool.shape[0], -1)


class KVOffloader:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, ...]], group_layers: Sequence[Sequence[int]],
                 stores: dict[int, object]) -> None:
        self.kv_caches = kv_caches
        self.group_layers = [tuple(g) for g in group_layers]
        self.stores = stores
        self.device = kv_caches[0][0].device
        self._pools = [[_u8(pool) for layer in layers for pool in kv_caches[layer]] for layers in self.group_layers]
        # A group this rank holds no layer of (a pipeline stage of only sliding-window layers)
        # stores a one-byte marker per block, so every rank holds every key (warm restarts keep
        # the keys all ranks can read) and a load of it succeeds without touching a pool.
        self.block_bytes = [sum(p.shape[1] for p in pools) or MARKER_BYTES for pools in self._pools]
        # Written-behind bytes per (store, key), readable until the file is in place.
        self._pending: dict[tuple[int, bytes], torch.Tensor] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue | None = None
        self._writer: threading.Thread | None = None
        # Read ahead by the reader thread per (store, key), oldest first; a load takes them.
        self._staged: dict[tuple[int, bytes], torch.Tensor] = {}
        self._staged_bytes = 0
        self._reads: queue.Queue | None = None
        self._reader: threading.Thread | None = None
        self.prefetched_loads = 0  # blocks a load found read ahead
        self.write_errors = 0
        # Totals for the engine's statistics (bytes and seconds; the writer adds its own).
        self.stored_bytes = 0
        self.loaded_bytes = 0
        self.store_seconds: list[float] = []
        self.load_seconds: list[float] = []
        if any(getattr(s, "persistent", False) for s in stores.values()):
            self._queue = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, name="kvserve-kv-writer", daemon=True)
            self._writer.start()
            self._reads = queue.Queue()
            self._reader = threading.Thread(target=self._read_loop, name="kvserve-kv-reader", daemon=True)
            self._reader.start()

    # -- the operations --------------------------------------------------------------------------
    def apply(self, ops: Sequence[tuple]) -> list[bytes]:
        """Applies `ops` in order (consecutive saves and loads are batched); returns the keys of
        the loads that failed."""
        failed: list[bytes] = []
        i = 0
        while i < len(ops):
            kind = ops[i][0]
            j = i
            while j < len(ops) and ops[j][0] == kind and (kind == "drop" or ops[j][1:3] == ops[i][1:3]):
                j += 1
            batch = ops[i:j]
            if kind == "save":
                self._save(batch[0][1], batch[0][2], [op[3] for op in batch], [op[4] for op in batch])
            elif kind == "load":
                failed += self._load(batch[0][1], batch[0][2], [op[3] for op in batch], [op[4] for op in batch])
            elif kind == "drop":
                for _, store, key in batch:
                    self._drop(store, key)
            elif kind == "close":
                for _, store in batch:
                    self._close_store(store)
            elif kind == "prefetch":
                for _, store, keys in batch:
                    if self._reads is not None and getattr(self.stores[store], "persistent", False):
                        self._reads.put((store, keys))
            else:
                raise ValueError(f"unknown kv offload operation {kind!r}")
            i = j
        return failed

    def _save(self, store_id: int, group: int, blocks: list[int], keys: list[bytes]) -> None:
        t0 = time.perf_counter()
        store = self.stores[store_id]
        idx = torch.tensor(blocks, device=self.device)
        if self._pools[group]:
            rows = torch.cat([pool[idx] for pool in self._pools[group]], dim=1)  # [n, block bytes]
        else:
            rows = torch.zeros((len(blocks), MARKER_BYTES), dtype=torch.uint8)
        if rows.device.type != "cpu":
            rows = rows.cpu()
        nbytes = rows.numel()
        rows = rows.unbind(0)  # once: the writer knows a row by identity
        if getattr(store, "persistent", False):
            with self._lock:
                for key, row in zip(keys, rows):
                    self._pending[(store_id, key)] = row
            for key, row in zip(keys, rows):
                self._queue.put(("put", store_id, key, row))
        else:
            for key, row in zip(keys, rows):
                store.put(key, row)
        self.stored_bytes += nbytes
        self.store_seconds.append(time.perf_counter() - t0)

    def _load(self, store_id: int, group: int, blocks: list[int], keys: list[bytes]) -> list[bytes]:
        t0 = time.perf_counter()
        store = self.stores[store_id]
        nbytes = self.block_bytes[group]
        good_blocks, rows, failed = [], [], []
        # A store that can read other TP layouts' files (a TP change) copies what it read from
        # them into its own directory, so they can be trimmed later without losing the block.
        migrates = bool(getattr(store, "sources", None)) and getattr(store, "migrate", True)
        for block, key in zip(blocks, keys):
            with self._lock:
                data = self._pending.get((store_id, key))
                pending = data is not None
                staged = self._staged.pop((store_id, key), None)
                if staged is not None:
                    self._staged_bytes -= staged.numel()
            if data is None and staged is not None:
                data = staged
                self.prefetched_loads += 1
            if data is None:
                data = store.get(key)
            if data is None or data.numel() != nbytes:
                failed.append(key)
                continue
            if migrates and not pending and not store.has_own(key):
                with self._lock:
                    self._pending[(store_id, key)] = data
                self._queue.put(("put", store_id, key, data))
            good_blocks.append(block)
            rows.append(data)
        if rows:
            data = torch.stack(rows).to(self.device, non_blocking=True)
            idx = torch.tensor(good_blocks, device=self.device)
            offset = 0
            for pool in self._pools[group]:
                width = pool.shape[1]
                pool[idx] = data[:, offset:offset + width]
                offset += width
            self.loaded_bytes += data.numel()
        self.load_seconds.append(time.perf_counter() - t0)
        return failed

    def _drop(self, store_id: int, key: bytes) -> None:
        store = self.stores[store_id]
        if getattr(store, "persistent", False):
            with self._lock:
                self._pending.pop((store_id, key), None)
                staged = self._staged.pop((store_id, key), None)
                if staged is not None:
                    self._staged_bytes -= staged.numel()
            self._queue.put(("delete", store_id, key, None))
        else:
            store.delete(key)

    def _close_store(self, store_id: int) -> None:
        store = self.stores.get(store_id)
        if store is None:
            return
        self.flush(timeout=60)
        del self.stores[store_id]
        with self._lock:
            for k in [k for k in self._staged if k[0] == store_id]:
                self._staged_bytes -= self._staged.pop(k).numel()
        if hasattr(store, "close"):
            store.close()

    # -- the background writer -------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                kind, store_id, key, row = item
                store = self.stores.get(store_id)
                if kind == "flush":
                    key.set()
                elif store is None:  # closed ("close"): nothing more goes to it
                    continue
                elif kind == "delete":
                    store.delete(key)
                else:
                    with self._lock:
                        current = self._pending.get((store_id, key))
                    if current is not row:  # dropped (or stored again) since it was queued
                        continue
                    t0 = time.perf_counter()
                    try:
                        store.put(key, row)
                    except OSError as exc:
                        # A full disk: the block stays readable from memory until dropped.
                        self.write_errors += 1
                        log.warning("kv offload: cannot write a block to %s: %s", getattr(store, "dir", "?"), exc)
                        continue
                    self.store_seconds.append(time.perf_counter() - t0)
                    with self._lock:
                        if self._pending.get((store_id, key)) is row:
                            del self._pending[(store_id, key)]
            finally:
                self._queue.task_done()

    # -- the background reader (prefetch) -------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            item = self._reads.get()
            if item is None:
                return
            store_id, keys = item
            store = self.stores.get(store_id)
            if store is None:  # closed since
                continue
            for key in keys:
                with self._lock:
                    if (store_id, key) in self._staged or (store_id, key) in self._pending:
                        continue
                try:
                    data = store.get(key)  # checked (header, length, checksum) here, off the step
                except Exception as exc:  # a hint only: the load reads it again and reports
                    log.debug("kv offload: prefetch of a block failed: %s", exc)
                    data = None
                if data is None:
                    continue
                with self._lock:
                    # A key's bytes never change (the key hashes the whole prefix), so bytes read
                    # while a drop raced by are still right for a later load of that key.
                    self._staged[(store_id, key)] = data
                    self._staged_bytes += data.numel()
                    while self._staged_bytes > STAGED_MAX_BYTES and self._staged:
                        oldest = next(iter(self._staged))
                        self._staged_bytes -= self._staged.pop(oldest).numel()

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued write is on disk (or `timeout` passes)."""
        if self._queue is None:
            return True
        done = threading.Event()
        self._queue.put(("flush", 0, done, None))
        return done.wait(timeout)

    def close(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            self.flush(timeout=60)
            self._queue.put(None)
            self._writer.join(timeout=10)
        self._writer = None
        if self._reader is not None and self._reader.is_alive():
            self._reads.put(None)
            self._reader.join(timeout=10)
        self._reader = None
        for store in self.stores.values():
            if hasattr(store, "close"):
                store.close()

    def drain_timings(self) -> tuple[list[float], list[float]]:
        """(store, load) seconds observed since the previous call."""
        store, self.store_seconds = self.store_seconds, []
        load, self.load_seconds = self.load_seconds, []
        return store, load
