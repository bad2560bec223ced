"""Requests held while the service has no ready pod (scaled to zero, or all pods restarting).

A bounded FIFO: a request that finds no pod waits here, up to a timeout, and the router's demand
endpoint reports how many wait, which is what wakes a service that was scaled to zero. When pods
are ready again the requests leave in arrival order, one at a time: each is let go only once the
one before it has been sent to a pod (or has given up), so the pod receives them in the order
the router did. Requests that arrive while others still wait queue behind them.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Callable


class HoldFull(Exception):
    """More requests are held than the router allows."""


class HoldTimeout(Exception):
    """No pod became ready within the hold timeout."""


@dataclass(eq=False)
class Ticket:
    """One held request: `released` is set when it may go; it sets `sent` once it went."""

    arrived: float
    released: asyncio.Event = field(default_factory=asyncio.Event)
    sent: asyncio.Event = field(default_factory=asyncio.Event)
    abandoned: bool = False


class HoldQueue:
    def __init__(self, *, max_held: int, timeout: float, clock: Callable[[], float] = time.monotonic,
                 send_grace: float = 2.0):
        self.max_held, self.timeout, self.clock = max_held, timeout, clock
        # How long the release of the next request waits for the previous one to be sent: a
        # request whose pod hangs must not keep the others waiting.
        self.send_grace = send_grace
        self._queue: collections.deque[Ticket] = collections.deque()
        self._available = asyncio.Event()
        self._releaser: asyncio.Task | None = None
        self.held_total = 0
        self.timeouts_total = 0
        self.rejected_total = 0

    def __len__(self) -> int:
        return sum(1 for t in self._queue if not t.abandoned)

    def oldest_age(self) -> float:
        waiting = [t.arrived for t in self._queue if not t.abandoned]
        return self.clock() - min(waiting) if waiting else 0.0

    def must_hold(self) -> bool:
        """A new request waits when no pod is ready, or when earlier requests still wait."""
        return not self._available.is_set() or len(self) > 0

    def set_available(self, available: bool) -> None:
        if available:
            self._available.set()
            if self._queue and (self._releaser is None or self._releaser.done()):
                self._releaser = asyncio.get_running_loop().create_task(self._release_in_order())
        else:
            self._available.clear()

    async def _release_in_order(self) -> None:
        while self._queue and self._available.is_set():
            ticket = self._queue.popleft()
            if ticket.abandoned:
                continue
            ticket.released.set()
            try:
                await asyncio.wait_for(ticket.sent.wait(), self.send_grace)
            except asyncio.TimeoutError:
                pass

    async def wait(self) -> tuple[Ticket, float]:
        """Waits for a pod; returns the ticket (set its `sent` once the request went) and the
        seconds held. Raises HoldFull at once, HoldTimeout after the timeout."""
        if len(self) >= self.max_held:
            self.rejected_total += 1
            raise HoldFull(f"{len(self)} requests are already waiting for a ready pod")
        ticket = Ticket(arrived=self.clock())
        self._queue.append(ticket)
        self.held_total += 1
        self.set_available(self._available.is_set())  # pods may be ready with a queue to drain
        try:
            await asyncio.wait_for(ticket.released.wait(), self.timeout)
        except asyncio.TimeoutError:
            ticket.abandoned = True
            self.timeouts_total += 1
            raise HoldTimeout(f"no ready pod within {self.timeout:g}s") from None
        except BaseException:  # the client went away while waiting
            ticket.abandoned = True
            ticket.sent.set()
            raise
        return ticket, self.clock() - ticket.arrived
