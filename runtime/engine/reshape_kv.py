"""KV across a live layout change without a configured tier: a transient file tier for the move.

A reshape (runtime/engine/data_parallel.py) takes every unfinished request out of the old
engines. Without a tier their KV would be recomputed by the new layout. Instead, the old engines
write the requests' whole blocks, each rank its own KV-head range, into a private directory in
RAM (the offload tier's FileStore: runtime/kv_offload/store.py), and the new layout's engines
start with that directory as their file tier: their ranks find the blocks by prefix-cache hash
and read them at the new TP degree (heads sliced or joined, runtime/kv_offload/heads.py). Once
every moved request has been admitted (its blocks are in the new pools), the tier is detached from
the engines and the directory deleted. Over budget, or if anything fails, a request is simply
recomputed as before.

The policy here is pure (where the directory goes, how many bytes, which requests fit); the rest
is the thin shell that reads the engines' block managers and removes the directory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

SHM = "/dev/shm"
PREFIX = "kvserve-reshape-kv-"
# A move may use at most this share of the host's available memory (MemAvailable), and never more
# than the filesystem's free space. /dev/shm and a tmpfs /tmp are RAM; a disk-backed temp dir
# mostly stays in the page cache for the second or so a move lasts.
RAM_FRACTION = 0.25
# Operators' overrides: the budget in bytes (0 turns the transient tier off: recompute), and the
# root directory (instead of /dev/shm or the temp dir).
BYTES_ENV = "KVSERVE_RESHAPE_KV_BYTES"
DIR_ENV = "KVSERVE_RESHAPE_KV_DIR"
# A moved request not admitted by then is recomputed: the tier does not outlive a stuck queue.
MOVE_MAX_SECONDS = 60.0


# -- policy (pure) ---------------------------------------------------------------------------------
def choose_root(need: int, *, shm_free: int | None, tmp_free: int, ram_available: int,
                fraction: float = RAM_FRACTION) -> tuple[str, int]:
    """(which root, its budget): /dev/shm when present and its budget holds `need`, else the
    temp dir. A budget is min(free space there, fraction x available RAM)."""
    ram = int(fraction * ram_available)
    if shm_free is not None and min(shm_free, ram) >= need:
        return "shm", min(shm_free, ram)
    return "tmp", min(tmp_free, ram)


def fit_requests(sizes: Sequence[int], budget: int) -> int:
    """How many requests (oldest first, each all or nothing) fit in `budget` bytes: the rest are
    recomputed. A request with nothing to move costs nothing and never stops the walk."""
    used, n = 0, 0
    for size in sizes:
        if used + size > budget:
            break
        used += size
        n += 1
    return n


# -- shell ------------------------------------------------------------------------------------------
def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def ram_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pick_root(need: int) -> tuple[str, int]:
    """The directory a move's files go under and the bytes it may use."""
    ram = ram_available()
    override = os.environ.get(BYTES_ENV)
    fraction = RAM_FRACTION
    root_override = os.environ.get(DIR_ENV)
    if root_override:
        budget = min(_free_bytes(root_override) or 0, int(fraction * ram))
        root = root_override
    else:
        shm = SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else None
        tmp = tempfile.gettempdir()
        which, budget = choose_root(need, shm_free=_free_bytes(shm) if shm else None,
                                    tmp_free=_free_bytes(tmp) or 0, ram_available=ram, fraction=fraction)
        root = shm if which == "shm" else tmp
    if override is not None:
        budget = min(budget, int(override))
    return root, budget


def without_transient(config: Any) -> Any:
    """The engine config with a move's transient tier taken out (what a spare preloaded for)."""
    if not getattr(config, "kv_offload_transient", False):
        return config
    return dataclasses.replace(config, kv_offload_bytes=0, kv_offload_dir=None, kv_offload_transient=False)


def eligible(config: Any) -> str | None:
    """Why a server cannot use the transient tier (None: it can)."""
    if config.kv_offload_dir:
        return "a file tier is configured: it carries the KV itself"
    if config.kv_offload_bytes or config.swap_space:
        return "a host-memory tier or swap space is configured"
    if not config.enable_prefix_caching:
        return "prefix caching is off (blocks are found by their prefix hashes)"
    return None


def _managers(engine: Any) -> list[Any]:
    bm = engine.core.block_manager
    return list(getattr(bm, "managers", None) or [bm])


def _group_bytes(engine: Any) -> list[int]:
    """Bytes of one block of each KV cache group, all ranks together."""
    worker = engine.executor.driver_worker
    groups = ([g.layers for g in worker.kv_groups] if worker.kv_groups is not None
              else [tuple(range(len(worker.kv_caches)))])
    tp = engine.config.tensor_parallel_size
    return [tp * sum(p[0].numel() * p.element_size() for layer in layers for p in worker.kv_caches[layer])
            for layers in groups]


def request_blocks(engine: Any, head: Any) -> list[tuple[int, int, bytes]]:
    """(group, pool block, prefix hash) of a detached request's whole blocks still cached in the
    pool (freed by the detach, not yet overwritten)."""
    found: dict[tuple[int, bytes], int] = {}
    for group, manager in enumerate(_managers(engine)):
        cached = manager.cached
        for s in head.samples:
            for h in getattr(s.seq, "block_hashes", None) or ():
                block = cached.get(h)
                if block is not None:
                    found[(group, h)] = block
    return [(g, b, h) for (g, h), b in found.items()]


class NoRoom(Exception):
    pass


class KVMove:
    """One reshape's transient tier: its directory, and what went through it (`record`, shown in
    the reshape's entry of GET /admin/parallelism)."""

    def __init__(self, root: str, budget: int) -> None:
        self.dir = tempfile.mkdtemp(prefix=PREFIX, dir=root)
        self.budget = budget
        self.used = 0
        self.started = time.monotonic()
        self.request_ids: set[str] = set()
        self.record: dict[str, Any] = {"transient_dir": self.dir, "budget_bytes": budget, "requests": 0,
                                       "written_blocks": 0, "read_blocks": 0, "read_tokens": 0, "recomputed": 0}
        self.detached = False  # the engines no longer use it
        self._quiet: dict[int, int] = {}
        self.removed = False

    @classmethod
    def open(cls, engines: Sequence[Any], detached: dict[int, list[Any]]) -> KVMove | None:
        """A move for the requests the old `engines` detached (engine index -> heads), or None
        when there is nothing to move or no room at all."""
        need = 0
        for i, heads in detached.items():
            sizes = _group_bytes(engines[i])
            need += sum(sizes[g] for head in heads for g, _, _ in request_blocks(engines[i], head))
        if need == 0:
            return None
        root, budget = pick_root(need)
        if budget <= 0:
            raise NoRoom(f"no room for a transient KV tier under {root} (budget 0)")
        return cls(root, budget)

    def save(self, engine: Any, heads: list[Any]) -> None:
        """Writes the whole blocks of `heads` (oldest first, while they fit) from the old `engine`
        (before it closes): rank 0 now, the other ranks as they shut down."""
        from kvserve.runtime.kv_offload.manager import tier_key
        from kvserve.runtime.kv_offload.offloader import TIER

        sizes = _group_bytes(engine)
        blocks = [request_blocks(engine, head) for head in heads]
        cost = [sum(sizes[g] for g, _, _ in b) for b in blocks]
        n = fit_requests(cost, self.budget - self.used)
        ops = [("save", TIER, g, block, tier_key(g, h)) for b in blocks[:n] for g, block, h in sorted(b)]
        self.record["recomputed"] += len(heads) - n
        if not ops:
            return
        written = engine.executor.write_transient_tier(ops, self.dir)
        self.used += sum(cost[:n])
        moved = [h for h, c in zip(heads[:n], cost) if c > 0]  # not those still before their prefill
        self.record["requests"] += len(moved)
        self.record["written_blocks"] += written
        self.request_ids.update(h.request_id for h in moved)

    @property
    def has_blocks(self) -> bool:
        return self.record["written_blocks"] > 0

    def engine_config(self, config: Any) -> Any:
        ranks = config.tensor_parallel_size
        return dataclasses.replace(config, kv_offload_bytes=max(1, self.budget // ranks),
                                   kv_offload_dir=self.dir, kv_offload_transient=True)

    def started_engine(self, engine: Any) -> None:
        """A new engine reads the tier but writes nothing to it (evicted blocks are not kept)."""
        for manager in _managers(engine):
            manager.on_evict = None

    # -- the end of the move ---------------------------------------------------------------------
    def admitted(self, engines: Iterable[Any]) -> bool:
        """Every moved request has had its blocks looked up (admitted once) or has ended."""
        for engine in engines:
            for rid, head in engine.core.requests.items():
                if rid in self.request_ids and not any(
                        s.seq.num_computed_tokens > 0 for s in head.samples if s not in head.unforked):
                    return False
        return True

    def detach(self, engines: Iterable[Any]) -> None:
        """The engines stop using the tier: hooks off, each rank closes its store."""
        from kvserve.runtime.kv_offload.offloader import TIER

        if self.detached:
            return
        self.detached = True
        for engine in engines:
            offload = engine.core.offload
            if offload is None or not getattr(engine.config, "kv_offload_transient", False):
                continue
            offload.flush()
            self.record["read_blocks"] += offload.stats.hit_blocks
            self.record["read_tokens"] += offload.stats.hit_tokens
            if offload.events is not None and offload.tier is not None:
                # KV events announced the tier's blocks (medium DISK) when the engine started:
                # a router's index must learn they are gone with it.
                offload.events.removed([k[1:] for k in offload.tier.keys() if k[0] == 0], medium=offload.medium)
            for manager in _managers(engine):
                manager.tier_lookup = None
                manager.on_evict = None
            engine.core.scheduler.offload = None
            engine.core.offload = None
            engine.offload = None
            try:
                engine.executor.kv_offload_apply([("close", TIER)])
            except Exception:  # best effort: the directory goes anyway
                log.exception("reshape: closing the transient KV tier")
        self.record["seconds"] = round(time.monotonic() - self.started, 3)

    def quiet(self, engines: Sequence[Any], stepped: set[int]) -> bool:
        """No rank can still read the directory: each engine's other ranks have no load waiting
        to be sent, and two steps have landed since (overlapped scheduling keeps one in flight)."""
        done = True
        for i, engine in enumerate(engines):
            pending = getattr(engine.executor, "_kv_ops", None) or []
            if any(op[0] in ("load", "prefetch") for op in pending):
                self._quiet[i] = 0
            elif i in stepped or not engine.has_unfinished_requests():
                self._quiet[i] = self._quiet.get(i, 0) + 1
            if not pending and getattr(engine.executor, "_kv_ops", None) is None:
                continue  # one rank: nothing is sent later
            done = done and self._quiet.get(i, 0) >= 2
        return done

    def remove(self) -> None:
        if not self.removed:
            self.removed = True
            shutil.rmtree(self.dir, ignore_errors=True)
            log.info("reshape: transient KV tier done: %s", {k: v for k, v in self.record.items()
                                                             if k != "transient_dir"})
