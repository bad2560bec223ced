"""The drain's time box, shared by the runtime's and the agent's POST /drain."""

from __future__ import annotations

import math


def effective_drain_timeout(raw: str | None, cap: float) -> float:
    """Seconds a drain may wait for in-flight work: the request's `?timeout=` when given, but never
    more than `cap` (the process's --drain-timeout). A caller may shorten a drain, never stretch it:
    a drain that waits for ever keeps a pod that takes no traffic, and nothing would restart it.

    Raises ValueError naming the field for anything but a finite number >= 0."""
    if raw is None:
        return cap
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"timeout: must be a number of seconds >= 0 (at most {cap:g} are used), got {raw!r}")
    return min(value, cap)
