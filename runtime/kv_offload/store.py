"""Where offloaded KV blocks live: host memory, or one file per block under a directory.

A store maps a key to one block's bytes (every layer of its group, each pool, on this rank) and
knows nothing of policy: the engine's index (index.py) decides what is added and dropped.

File format (one file per block, named by the key in hex): magic, the namespace digest, the key,
the payload length, a CRC-32 of the payload, then the payload. A file is written under a temporary
name, flushed (fsynced unless turned off) and renamed into place, so a crash mid-write leaves only
a temporary file; a file whose header, length or checksum is wrong (truncated, another namespace,
bit rot) is never returned and is deleted when found.

A directory may be shared (a ReadWriteMany PVC, NFS, CephFS): several servers, on several hosts,
write and read it at once. A temporary name carries a random tag per store and the writer's PID,
so two writers never share one (PIDs repeat across containers); a start deletes only temporary
files older than ``stale_tmp_seconds`` (a crashed writer's), never another server's write in
flight. Two writers of the same key write the same bytes (the key hashes the whole prefix in one
namespace), so the last rename wins and a reader sees one writer's whole file or the other's.

Another tensor-parallel layout: a namespace is one KV-head range (heads.py). A store given its
``HeadGeometry`` also reads the directories of the same model's other layouts: a block missing from
its own directory is built from the files of a layout whose ranges cover its heads (all present
and valid, or it is a miss), so a restart at another TP degree finds its prefixes again.

Disk hygiene: a tier's root outlives its namespaces (a new model revision or dtype starts a new
directory and nothing reads the old one). A store holds a shared ``flock`` on its
directory's lock file while it is open; at start, a store whose budget is given deletes other
namespaces' directories, least recently written first, until the root fits the budget, skipping
any directory a live store holds (the other ranks of a TP group, data-parallel engines, a second
server on a shared volume) and the ones named in ``keep`` (this layout's other ranks, which may
not have started yet). The same model's other head ranges (what a TP change reads) are counted
and trimmed like any other namespace: what is left of them after the trim is read.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import pathlib
import re
import shutil
import struct
import time
import uuid
import zlib
from collections.abc import Callable

import torch

from kvserve.runtime.kv_offload.heads import HeadGeometry, assemble, covers
from kvserve.runtime.kv_offload.namespace import Namespace

log = logging.getLogger(__name__)

MAGIC = b"KVSBLK\x01\x00"
_HEAD = struct.Struct("<8s32sH")  # magic, namespace digest, key length; then key, then _TAIL
_TAIL = struct.Struct("<QI")  # payload length, crc32
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
LOCK = ".lock"
# A temporary file this old is a crashed writer's: no write of one block takes that long, even on a
# slow network filesystem (and the margin covers clock skew between the hosts sharing it).
STALE_TMP_SECONDS = 15 * 60
_NAMESPACE_DIR = re.compile(r"[0-9a-f]{32}")


class HostStore:
    """Blocks in host memory (pinned on CUDA, so copies to and from the device run at full speed)."""

    medium = "CPU"
    persistent = False

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._blocks: dict[bytes, torch.Tensor] = {}

    def put(self, key: bytes, data: torch.Tensor) -> None:
        buf = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=self.pin_memory)
        buf.copy_(data.reshape(-1))
        self._blocks[key] = buf

    def get(self, key: bytes) -> torch.Tensor | None:
        return self._blocks.get(key)

    def delete(self, key: bytes) -> None:
        self._blocks.pop(key, None)

    def scan(self) -> list[tuple[bytes, int]]:
        return []

    def __len__(self) -> int:
        return len(self._blocks)


class FileStore:
    """Blocks as files under ``root/<namespace>/`` (local disk, a PVC, a shared filesystem)."""

    medium = "DISK"
    persistent = True

    def __init__(self, root: str | os.PathLike, namespace: Namespace, *, fsync: bool = True,
                 root_budget_bytes: int | None = None, keep: frozenset[str] = frozenset(),
                 stale_tmp_seconds: float = STALE_TMP_SECONDS, geometry: HeadGeometry | None = None) -> None:
        self.namespace = namespace
        self.digest = namespace.digest
        self.dir = pathlib.Path(root) / namespace.dirname
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.geometry = geometry
        # Other layouts' head ranges that together hold ours, whose directories exist: where a
        # block missing here is read from (a TP change), first complete one wins.
        self.sources: list[list[tuple[tuple[int, int], Namespace, pathlib.Path]]] = []
        # Unique across hosts and containers (where PIDs repeat); the PID tells a forked copy apart.
        self._tag = uuid.uuid4().hex[:16]
        self._tmp_ids = itertools.count()
        self._lock_fd = hold_lock(self.dir)
        if root_budget_bytes is not None:
            # Other layouts' directories of this model count like any namespace (least recently
            # written first, never one a live store holds): a TP degree that is gone for good
            # would otherwise hold its share of the volume forever.
            trim_root(self.dir.parent, root_budget_bytes, keep | {self.dir.name})
        if geometry is not None:
            root_dir = pathlib.Path(root)
            alternatives = covers(namespace.heads, geometry.num_kv_heads)
            if namespace.copy:  # the first copy of our heads, written by a layout with fewer ranks
                alternatives.insert(0, (namespace.heads,))
            for pieces in alternatives:
                source = [(r, namespace.for_heads(r), root_dir / namespace.for_heads(r).dirname) for r in pieces]
                if all(d.is_dir() for _, _, d in source):
                    self.sources.append(source)
        # What the directory holds, for whoever looks at a PVC (never read back).
        about = self.dir / "namespace.json"
        if not about.exists():
            tmp = self._tmp_path(about.name)
            tmp.write_text(namespace.describe() + "\n")
            os.replace(tmp, about)  # another server starting beside us may write it too
        sweep_stale_tmp(self.dir, stale_tmp_seconds)

    def _tmp_path(self, name: str) -> pathlib.Path:
        return self.dir / f".{name}.{self._tag}.{os.getpid()}.{next(self._tmp_ids)}{TMP_SUFFIX}"

    def path(self, key: bytes) -> pathlib.Path:
        return self.dir / (key.hex() + SUFFIX)

    def close(self) -> None:
        """Lets the directory go (another start may then trim it)."""
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)

    __del__ = close

    def put(self, key: bytes, data: torch.Tensor, _before_rename: Callable[[], None] | None = None) -> None:
        payload = memoryview(data.reshape(-1).numpy())
        header = _HEAD.pack(MAGIC, self.digest, len(key)) + key + _TAIL.pack(len(payload), zlib.crc32(payload))
        final = self.path(key)
        tmp = self._tmp_path(final.name)
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            if _before_rename is not None:  # fault injection (tests)
                _before_rename()
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get(self, key: bytes) -> torch.Tensor | None:
        """The block's bytes, or None when no file holds them whole (a file failing any check is
        deleted: it can never become valid). Read from this directory, else built from another
        layout's files of the same heads."""
        data = read_block(self.path(key), self.digest, key)
        if data is not None or not self.sources or not key or key[0] >= len(self.geometry.segments):
            return data
        for source in self.sources:
            pieces = []
            for heads, ns, directory in source:
                piece = read_block(directory / (key.hex() + SUFFIX), ns.digest, key)
                if piece is None:
                    break
                pieces.append((heads, piece))
            else:
                data = assemble(pieces, self.namespace.heads, self.geometry, key[0])
                if data is not None:
                    return data
        return None

    def has_own(self, key: bytes) -> bool:
        """Whether this directory has the key's file (not only another layout's)."""
        return self.path(key).exists()

    def delete(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)

    def scan(self) -> list[tuple[bytes, int]]:
        """(key, payload bytes) of every file whose header and size check out, least recently
        written first (a warm restart's LRU order), then those only other layouts hold whole
        (by name; headers are checked when read). The checksum is checked when a block is read."""
        found = []
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    header = _read_header(f, self.digest, None)
                    start = f.tell()
            except OSError:
                continue
            if header is None or st.st_size != start + header[1] or path.name != header[0].hex() + SUFFIX:
                _unlink_if_same(path, st.st_ino)
                continue
            found.append((st.st_mtime_ns, header[0], header[1]))
        own = {key for _, key, _ in found}
        for key, written in self._source_keys().items():
            if key not in own:
                found.append((written, key, self.geometry.block_bytes(key[0], self.namespace.heads)))
        found.sort()
        return [(key, n) for _, key, n in found]

    def _source_keys(self) -> dict[bytes, int]:
        """Keys (with the newest piece's mtime) every directory of some source layout lists."""
        out: dict[bytes, int] = {}
        for source in self.sources:
            common = None
            for _, _, directory in source:
                listed = _listing(directory)
                common = listed if common is None else {
                    k: max(t, listed[k]) for k, t in common.items() if k in listed}
            for key, written in (common or {}).items():
                if key and key[0] < len(self.geometry.segments):
                    out[key] = min(written, out.get(key, written))
        return out

    def readable_keys(self) -> set[bytes]:
        """Keys this store can read (by file name: own directory or a source layout's)."""
        return set(_listing(self.dir)) | set(self._source_keys())


def _listing(directory: pathlib.Path) -> dict[bytes, int]:
    """Block keys a directory's file names give, with their mtimes."""
    out = {}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return out
    for entry in entries:
        if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
            try:
                out[bytes.fromhex(entry.name[:-len(SUFFIX)])] = entry.stat().st_mtime_ns
            except (ValueError, OSError):
                continue
    return out


def _read_header(f, digest: bytes, key: bytes | None) -> tuple[bytes, int, int] | None:
    head = f.read(_HEAD.size)
    if len(head) != _HEAD.size:
        return None
    magic, stored_digest, key_len = _HEAD.unpack(head)
    if magic != MAGIC or stored_digest != digest:
        return None
    stored_key = f.read(key_len)
    tail = f.read(_TAIL.size)
    if len(stored_key) != key_len or len(tail) != _TAIL.size or (key is not None and stored_key != key):
        return None
    length, crc = _TAIL.unpack(tail)
    return stored_key, length, crc


def read_block(path: pathlib.Path, digest: bytes, key: bytes) -> torch.Tensor | None:
    """One block file's payload, or None when it is missing or fails any check (then it is
    deleted: it can never become valid)."""
    try:
        with open(path, "rb") as f:
            header = _read_header(f, digest, key)
            if header is not None:
                _, length, crc = header
                payload = bytearray(length)
                n = f.readinto(payload)
                extra = f.read(1)
                if n == length and not extra and zlib.crc32(payload) == crc:
                    return torch.frombuffer(payload, dtype=torch.uint8)
            inode = os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("kv offload: cannot read %s: %s", path, exc)
        return None
    _unlink_if_same(path, inode)
    return None


def _unlink_if_same(path: pathlib.Path, inode: int) -> None:
    """Deletes a damaged file unless another writer has renamed a good one into its place since."""
    try:
        if os.stat(path).st_ino != inode:
            return
        path.unlink()
    except FileNotFoundError:
        return
    log.warning("kv offload: %s is truncated, corrupt or of another namespace; deleted", path.name)


def sweep_stale_tmp(directory: pathlib.Path, older_than_s: float) -> int:
    """Deletes temporary files not modified for `older_than_s` seconds (crashed writers'); a
    younger one may be another server's write in flight. Returns how many went."""
    cutoff = time.time() - older_than_s
    n = 0
    for tmp in directory.glob(f".*{TMP_SUFFIX}"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
                n += 1
        except FileNotFoundError:  # its writer renamed or removed it meanwhile
            continue
    return n


# flock errors of a filesystem without locks (some FUSE and network mounts).
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def hold_lock(directory: pathlib.Path) -> int | None:
    """A shared lock on `directory`'s lock file, held until the descriptor is closed: a trim never
    deletes a directory a live store holds. Retries when a trim deleted the file meanwhile (the
    lock would be on an unlinked inode that no later trim sees). None on a filesystem without
    locks (a trim then never deletes anything there: it cannot tell a live directory)."""
    while True:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_LOCKS:
                raise
            log.warning("kv offload: %s has no file locks (%s): other namespaces there are never trimmed",
                        directory.parent, exc)
            return None
        try:
            if os.stat(directory / LOCK).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _dir_usage(directory: pathlib.Path) -> tuple[int, int]:
    """(bytes of its files, when it was last written: the newest file's or its own mtime)."""
    total, newest = 0, 0
    try:
        newest = directory.stat().st_mtime_ns
        for entry in os.scandir(directory):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += st.st_size
            newest = max(newest, st.st_mtime_ns)
    except OSError:
        pass
    return total, newest


def trim_root(root: pathlib.Path, budget_bytes: int, keep: frozenset[str] | set[str]) -> list[str]:
    """Deletes namespace directories under `root` (other than `keep`, and none a live store holds),
    least recently written first, until the namespaces' files fit `budget_bytes`; returns the
    deleted directories' names. Only directories that look like a namespace (a 32-hex name with a
    namespace.json) are counted or touched: nothing else on a shared volume is the tier's."""
    dirs = []
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False) and _NAMESPACE_DIR.fullmatch(entry.name) \
                and os.path.exists(os.path.join(entry.path, "namespace.json")):
            size, written = _dir_usage(pathlib.Path(entry.path))
            dirs.append((written, entry.name, size))
    total = sum(size for _, _, size in dirs)
    deleted = []
    for _, name, size in sorted(dirs):
        if total <= budget_bytes:
            break
        if name in keep:
            continue
        path = root / name
        try:
            fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live store uses it (or no locks here: nothing proves it unused)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        total -= size
        deleted.append(name)
        log.info("kv offload: deleted namespace %s (%.1f MiB, not used since the tier's last start) to fit "
                 "the tier's budget", name, size / 2**20)
    return deleted
