"""When the operator retries a Kubernetes API call, and how long it waits: pure.

An API server under load or restarting answers 429, 500, 502, 503 or 504, and a connection can
drop; the call is retried with capped exponential backoff and full jitter (many operators
retrying in step would hit the server again together), waits at least what the server asked for
in `Retry-After` (capped, so a bad header cannot stall a reconcile), and gives up after a bounded
number of attempts or seconds, whichever comes first. A 409 on a write is a conflict that a fresh
attempt resolves; a 409 on create means "already exists", which only the caller can judge.

The shell (kube.py) asks `next_delay` after each failure and sleeps what it says, or raises.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

# Statuses worth another try: throttled, or the server (or a proxy in front of it) failing.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8                 # tries in all, the first included
    base_seconds: float = 0.05        # the first backoff's ceiling; doubles per failure
    max_backoff_seconds: float = 2.0  # the ceiling stops doubling here
    max_retry_after_seconds: float = 10.0
    deadline_seconds: float = 30.0    # no new attempt starts later than this after the first

    def __post_init__(self):
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        for name in ("base_seconds", "max_backoff_seconds", "max_retry_after_seconds", "deadline_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def retryable(status: int | None, method: str) -> bool:
    """Whether an answer (None: no answer, the connection failed) is worth another attempt."""
    if status is None:
        return True
    if status == 409:
        # create: "already exists", the caller's business; a conflicting write: try it again.
        return method.upper() != "POST"
    return status in RETRY_STATUSES


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), None if absent or bad."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def backoff_ceiling(policy: RetryPolicy, failures: int) -> float:
    """The jitter's upper bound after `failures` failed attempts (1 for the first failure)."""
    exponent = min(max(failures - 1, 0), 60)  # 2**60 s is beyond any cap; avoids float overflow
    return min(policy.max_backoff_seconds, policy.base_seconds * 2.0 ** exponent)


def next_delay(policy: RetryPolicy, *, failures: int, elapsed: float, retry_after: float | None = None,
               rng: Callable[[], float] = random.random) -> float | None:
    """Seconds to wait before the next attempt, or None to give up.

    `failures`: attempts that failed so far (>= 1); `elapsed`: seconds since the first attempt
    started; `retry_after`: what the server asked for, if anything; `rng`: uniform in [0, 1).
    """
    if failures >= policy.attempts:
        return None
    delay = rng() * backoff_ceiling(policy, failures)
    if retry_after is not None:
        delay = max(delay, min(retry_after, policy.max_retry_after_seconds))
    if elapsed + delay > policy.deadline_seconds:
        return None
    return delay


def handler_delay(retry: int, *, first: float = 1.0, cap: float = 30.0) -> float:
    """A failed reconcile's wait before kopf runs it again: 1, 2, 4, ... seconds up to `cap`.

    Each API call has already retried its transient errors; what reaches a handler lasted for
    many seconds, so the handler backs off further, in seconds (kopf's default is a minute)."""
    return min(cap, first * 2.0 ** min(max(retry, 0), 30))
