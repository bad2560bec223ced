"""The single-process executor: one rank, the engine's own process (tensor_parallel_size 1)."""

from __future__ import annotations

from kvserve.runtime.executor.base import Executor


class UniProcExecutor(Executor):
    """Rank 0 is the only rank: every hook of the base class is already right for it."""
