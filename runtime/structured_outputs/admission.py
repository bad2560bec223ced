"""Which grammar compiles may wait, and which waiting one runs next. Pure, no xgrammar.

A client is whatever the server names it (the peer address); ``None`` is the in-process caller
(``LLM.generate``), which is trusted and never capped. One client may have at most
``max_per_client`` compiles waiting or running and run at most ``workers - 1`` of them, so a
client sending expensive schemas holds one worker at most (for at most the compile timeout) while
the others keep serving everyone else. Joining a compile that someone already started is free.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

Client = Hashable | None


class GrammarCompileBusy(Exception):
    """No room to start this compile now: the caller should retry later (HTTP 429)."""


@dataclass(frozen=True)
class CompileSettings:
    """How grammar compiles run: in killable worker processes, each bounded in time, shared fairly."""

    workers: int = 2
    timeout_s: float = 10.0
    max_per_client: int = 4
    max_queued: int = 64
    cache_entries: int = 256
    cache_bytes: int = 512 * 1024 * 1024
    # Memory one compile may take (the worker's resident growth while compiling it).
    max_compile_bytes: int = 2 * 1024 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("workers", "max_per_client", "max_queued", "cache_entries", "cache_bytes", "max_compile_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                or not 0 < self.timeout_s < float("inf")):
            raise ValueError(f"timeout_s: must be a positive number of seconds, got {self.timeout_s!r}")

    @property
    def max_running_per_client(self) -> int:
        return max(1, self.workers - 1)


def check_admission(client: Client, owned_by_client: int, queued: int, settings: CompileSettings) -> None:
    """Raises GrammarCompileBusy if ``client`` may not start one more compile now."""
    if client is None:
        return
    if owned_by_client >= settings.max_per_client:
        raise GrammarCompileBusy(f"this client already has {owned_by_client} grammar compiles waiting or running, "
                                 f"the server's limit (--structured-outputs-max-compiles-per-client); retry later")
    if queued >= settings.max_queued:
        raise GrammarCompileBusy(f"{queued} grammar compiles are already waiting, the server's limit "
                                 "(--structured-outputs-max-queued-compiles); retry later")


def pick_next(waiting: Sequence[Client], running: Mapping[Client, int], settings: CompileSettings) -> int | None:
    """The index (in arrival order) of the compile to start next: the oldest whose client runs
    fewer than its share; None if every waiting one's client is at its share."""
    for i, client in enumerate(waiting):
        if client is None or running.get(client, 0) < settings.max_running_per_client:
            return i
    return None
