"""How much memory the router may spend on request bodies, sized to its container (pure).

The router keeps each request body whole while it handles it: it hashes the prompt to pick a pod,
and keeps the bytes to send again when a pod refuses before answering. Bodies of requests held for
a ready pod stay for as long as the hold lasts. Three budgets bound that:

  * one body: `max_request_body_bytes` (413 past it);
  * bodies of held requests together: `max_held_bytes` (503 + Retry-After past it);
  * every body in memory at once, held or being forwarded: `max_buffered_bytes` (503 too).

Each is checked from `Content-Length` before the body is read, and a body without one (chunked)
is counted as it streams. The defaults follow the container's memory limit (cgroup v2
`memory.max`, else v1 `memory.limit_in_bytes`): a quarter of it for held bodies, half for all
bodies, at most 8 MiB (and at most a sixteenth of it) for one; with no limit to read, those of a
512 MiB container (the operator's router pod). The prefix index is sized the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
ASSUMED_MEMORY = 512 * MIB  # the router pod's limit in operator/router.py
# cgroup v1 writes "no limit" as a page-rounded 2^63-1; anything this large is no limit either.
UNLIMITED_FROM = 1 << 60


def parse_memory_limit(text: str) -> int | None:
    """One cgroup memory-limit file's content: bytes, or None for "max" / no real limit."""
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < UNLIMITED_FROM else None


def container_memory_limit(files: tuple[str, ...] = CGROUP_FILES,
                           read: Callable[[str], str] = lambda p: Path(p).read_text()) -> int | None:
    for path in files:
        try:
            limit = parse_memory_limit(read(path))
        except OSError:
            continue
        if limit is not None:
            return limit
    return None


@dataclass(frozen=True)
class BodyLimits:
    max_request_body_bytes: int = 8 * MIB
    max_held_bytes: int = ASSUMED_MEMORY // 4
    max_buffered_bytes: int = ASSUMED_MEMORY // 2

    def __post_init__(self):
        for name in ("max_request_body_bytes", "max_held_bytes", "max_buffered_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes: must be >= 1, got {self.max_request_body_bytes}")

    @classmethod
    def for_memory(cls, memory_limit: int | None) -> BodyLimits:
        memory = memory_limit or ASSUMED_MEMORY
        return cls(max_request_body_bytes=max(64 << 10, min(8 * MIB, memory // 16)), max_held_bytes=memory // 4,
                   max_buffered_bytes=memory // 2)


# What one prefix-index entry costs (measured with tracemalloc on a full index: ~330 bytes a
# chunk hash with one pod), rounded up.
INDEX_ENTRY_BYTES = 400


def prefix_index_capacity(memory_limit: int | None, *, most: int = 200_000, least: int = 10_000) -> int:
    """Prefix chunks the router remembers: an eighth of the memory limit's worth, within
    [least, most] (200,000, about 65 MB, in a 512 MiB container)."""
    memory = memory_limit or ASSUMED_MEMORY
    return max(least, min(most, memory // 8 // INDEX_ENTRY_BYTES))


def max_connections_for_memory(memory_limit: int | None, *, least: int = 64) -> int:
    """Open client connections allowed: one per 64 KiB of the memory limit (an idle one costs
    about 5 KB; a streaming one its socket buffers too), 8192 in a 512 MiB container."""
    return max(least, (memory_limit or ASSUMED_MEMORY) // (64 << 10))


class ByteBudget:
    """Bytes taken against a limit; `take` says no rather than go over."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if n < 0:
            raise ValueError(f"cannot take {n} bytes")
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)
