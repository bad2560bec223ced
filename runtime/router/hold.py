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
from collections.abc import Callable
from dataclasses import dataclass, field


class HoldFull(Exception):
    """More requests are held than the router allows."""


class HoldTimeout(Exception):
    """No pod became ready within the hold timeout."""


@dataclass(eq=False)
class Ticket:
    """One held request: `released` is set when it may go; it sets `sent` once it went. It holds
    a place in the queue's count and its body's bytes from admission until it leaves."""

    arrived: float
    nbytes: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)
    sent: asyncio.Event = field(default_factory=asyncio.Event)
    abandoned: bool = False
    left: bool = False


class HoldQueue:
    def __init__(self, *, max_held: int, timeout: float, clock: Callable[[], float] = time.monotonic,
                 send_grace: float = 2.0, max_held_bytes: int | None = None):
        self.max_held, self.timeout, self.clock = max_held, timeout, clock
        self.max_held_bytes = max_held_bytes
        # How long the release of the next request waits for the previous one to be sent: a
        # request whose pod hangs must not keep the others waiting.
        self.send_grace = send_grace
        self._queue: collections.deque[Ticket] = collections.deque()
        # Admitted and not yet left (reading their body, or queued), in arrival order.
        self._admitted: dict[Ticket, None] = {}
        self.held_bytes = 0
        self._available = asyncio.Event()
        self._releaser: asyncio.Task | None = None
        self.held_total = 0
        self.timeouts_total = 0
        self.rejected_total = 0

    def __len__(self) -> int:
        return len(self._admitted)

    def oldest_age(self) -> float:
        oldest = next(iter(self._admitted), None)
        return self.clock() - oldest.arrived if oldest is not None else 0.0

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
            except TimeoutError:
                pass

    def room_for(self, nbytes: int) -> str | None:
        """Why one more request of `nbytes` would not be admitted now, or None."""
        if len(self) >= self.max_held:
            return f"{len(self)} requests are already waiting for a ready pod (--max-held {self.max_held})"
        if self.max_held_bytes is not None and self.held_bytes + nbytes > self.max_held_bytes:
            return (f"held request bodies would take {self.held_bytes + nbytes} bytes "
                    f"(--max-held-bytes {self.max_held_bytes})")
        return None

    def admit(self, nbytes: int = 0) -> Ticket:
        """A place for one more request whose body has `nbytes` (what Content-Length says, 0 when
        it does not): taken before the body is read, so a full queue costs nothing. HoldFull when
        the count or the bytes would go over."""
        problem = self.room_for(nbytes)
        if problem:
            self.rejected_total += 1
            raise HoldFull(problem)
        ticket = Ticket(arrived=self.clock(), nbytes=nbytes)
        self._admitted[ticket] = None
        # Queued at admission, not once its body is read: a small body read fast must not overtake
        # a large one that arrived first. A ticket released while its body is still arriving goes
        # as soon as the body is in (the releaser waits `send_grace` for it).
        self._queue.append(ticket)
        self.held_bytes += nbytes
        self.held_total += 1
        return ticket

    def grow(self, ticket: Ticket, nbytes: int) -> None:
        """More of a held request's body arrived than it was admitted with (a chunked body)."""
        self._check_bytes(nbytes)
        ticket.nbytes += nbytes
        self.held_bytes += nbytes

    def _check_bytes(self, nbytes: int) -> None:
        if self.max_held_bytes is not None and self.held_bytes + nbytes > self.max_held_bytes:
            self.rejected_total += 1
            raise HoldFull(f"held request bodies would take {self.held_bytes + nbytes} bytes "
                           f"(--max-held-bytes {self.max_held_bytes})")

    def leave(self, ticket: Ticket) -> None:
        """The request no longer waits (released, timed out, refused, or its client left): its
        place and bytes are free at once, whether or not a pod ever came back."""
        if ticket.left:
            return
        ticket.left = True
        self._admitted.pop(ticket, None)
        self.held_bytes -= ticket.nbytes
        if not ticket.released.is_set():
            ticket.abandoned = True
            try:
                self._queue.remove(ticket)
            except ValueError:
                pass

    async def wait(self, ticket: Ticket | None = None) -> tuple[Ticket, float]:
        """Waits for a pod; returns the ticket (set its `sent` once the request went) and the
        seconds held. Takes an admitted ticket, or admits one with no bytes. Raises HoldFull at
        once, HoldTimeout after the timeout; the ticket has left the queue either way."""
        if ticket is None:
            ticket = self.admit()
        self.set_available(self._available.is_set())  # pods may be ready with a queue to drain
        try:
            await asyncio.wait_for(ticket.released.wait(), self.timeout)
        except TimeoutError:
            self.timeouts_total += 1
            raise HoldTimeout(f"no ready pod within {self.timeout:g}s") from None
        except BaseException:  # the client went away while waiting
            ticket.sent.set()
            raise
        finally:
            self.leave(ticket)
        return ticket, self.clock() - ticket.arrived
