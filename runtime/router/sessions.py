"""Which conversations each pod carries: the router's estimate of a pod's KV working set.

Pure (no I/O, no clock of its own). A *session* is a chain of requests that each extend the one
before: turn n+1 of a chat sends turn n's messages, its answer and a new message, so its prefix
chunk hashes (policy.chunk_hashes) contain the last full chunk of turn n's. The table keeps, per
session, that last chunk hash (its *leaf*), the pod it was routed to and when; a request whose
chunks contain a leaf continues that session (and moves it, if it goes elsewhere).

Why the router counts them: in-flight requests say how busy a pod is *now*, not how much KV it
must keep. Between two turns of a chat (a user reading and typing) every pod looks idle, so with
in-flight load alone every new conversation that shares a system prompt went to the pod that held
that prompt, until that pod's pool could not hold all their histories and evicted them while the
other pods stayed empty (bench/router_events.py --think-seconds, docs/benchmarks.md). Counting
the sessions each pod carries lets new conversations spread by what the pods will have to keep.

Bounded: at most `capacity` sessions are remembered (the least recently seen go first), and a
session not continued within `ttl` seconds counts no more (the user left; its blocks are the
pod's to evict).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class SessionTable:
    def __init__(self, ttl: float = 300.0, capacity: int = 100_000):
        if not ttl > 0:
            raise ValueError(f"ttl: must be > 0, got {ttl!r}")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: must be an integer >= 1, got {capacity!r}")
        self.ttl, self.capacity = ttl, capacity
        # leaf chunk hash -> (pod, last seen), least recently seen first
        self._leaves: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._per_pod: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._leaves)

    def continued(self, hashes: Sequence[int]) -> int | None:
        """The leaf of the session this request continues (the longest one it extends), or None."""
        for h in reversed(hashes):
            if h in self._leaves:
                return h
        return None

    def record(self, hashes: Sequence[int], pod: str, now: float) -> None:
        """A request with these chunks went to `pod`: its session's leaf is now its last chunk."""
        if not hashes:
            return
        self._expire(now)
        previous = self.continued(hashes)
        if previous is not None:
            self._remove(previous)
        leaf = hashes[-1]
        if leaf in self._leaves:  # the same prompt again (one chunk long, or a retry)
            self._remove(leaf)
        self._leaves[leaf] = (pod, now)
        self._per_pod[pod] = self._per_pod.get(pod, 0) + 1
        while len(self._leaves) > self.capacity:
            self._remove(next(iter(self._leaves)))

    def counts(self, pods: Iterable[str], now: float, own: int | None = None) -> dict[str, int]:
        """pod -> live sessions it carries, not counting session `own` (the leaf `continued` gave
        for a request: it weighs the pods by the *other* conversations they keep)."""
        self._expire(now)
        out = {p: self._per_pod.get(p, 0) for p in pods}
        if own is not None and own in self._leaves:
            pod = self._leaves[own][0]
            if pod in out:
                out[pod] -= 1
        return out

    def forget(self, pod: str) -> None:
        """A pod that went away: its sessions start over wherever they go next."""
        for leaf in [k for k, (p, _) in self._leaves.items() if p == pod]:
            self._remove(leaf)

    def _expire(self, now: float) -> None:
        while self._leaves:
            leaf, (_, seen) = next(iter(self._leaves.items()))
            if now - seen <= self.ttl:
                return
            self._remove(leaf)

    def _remove(self, leaf: int) -> None:
        pod, _ = self._leaves.pop(leaf)
        left = self._per_pod[pod] - 1
        if left:
            self._per_pod[pod] = left
        else:
            del self._per_pod[pod]
