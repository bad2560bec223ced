"""Stop-string matching whose cost follows the new text, not the number or length of the stops.

Searching every stop string in the recent text after every token costs (stops x longest stop)
per token, and finding the tail to hold back (the longest suffix that could still grow into a
stop) costs that again in Python: a request with thousands of stops slowed every other request
of the engine thread by an order of magnitude. An Aho-Corasick automaton over the stops reads
each new character once (amortized), and its state *is* the tail to hold back: the longest suffix
of the text that is a prefix of some stop.

The automaton is immutable and shared per tuple of stops while in use, so the n samples of a
request share one, and the server builds it off the event loop before the engine sees the request.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque

# One dict for all edges, keyed by node << _SHIFT | code point: far smaller than a dict per node
# for the long single-child chains that long stop strings make.
_SHIFT = 21


class StopAutomaton:
    """Aho-Corasick over a list of stop strings (non-empty; duplicates allowed)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.max_len = max((len(s) for s in stops), default=0)
        edges: dict[int, int] = {}
        depth = [0]
        # Per node: the longest stop that ends here (itself or through failure links), as
        # (length, order); order is the stop's first index in the list, which breaks ties.
        longest: list[tuple[int, int] | None] = [None]
        for order, stop in enumerate(stops):
            node = 0
            for ch in stop:
                key = node << _SHIFT | ord(ch)
                nxt = edges.get(key)
                if nxt is None:
                    nxt = len(depth)
                    edges[key] = nxt
                    depth.append(depth[node] + 1)
                    longest.append(None)
                node = nxt
            if longest[node] is None:  # a duplicate keeps its first index
                longest[node] = (len(stop), order)
        children: list[list[tuple[int, int]]] = [[] for _ in depth]
        for key, child in edges.items():
            children[key >> _SHIFT].append((key & ((1 << _SHIFT) - 1), child))
        fail = [0] * len(depth)
        queue = deque(child for _, child in children[0])
        while queue:
            node = queue.popleft()
            for code, child in children[node]:
                f = fail[node]
                while f and (f << _SHIFT | code) not in edges:
                    f = fail[f]
                target = edges.get(f << _SHIFT | code, 0)
                fail[child] = target if target != child else 0
                if longest[child] is None:
                    longest[child] = longest[fail[child]]
                queue.append(child)
        self._edges = edges
        self._fail = fail
        self._longest = longest
        self.depth = depth

    def step(self, node: int, ch: str) -> int:
        code = ord(ch)
        edges, fail = self._edges, self._fail
        while True:
            nxt = edges.get(node << _SHIFT | code)
            if nxt is not None:
                return nxt
            if node == 0:
                return 0
            node = fail[node]

    def scan(self, node: int, text: str, offset: int) -> tuple[int, tuple[int, str] | None]:
        """Feeds `text` (which starts at position `offset` of the whole text) from state `node`.

        Returns the new state and the earliest-starting stop that ends inside `text`, as
        (start position, stop string); among stops starting at the same place, the first listed.
        Stops ending in earlier text are assumed to have been reported already."""
        best: tuple[int, int] | None = None  # (start, order)
        longest = self._longest
        for i, ch in enumerate(text):
            node = self.step(node, ch)
            hit = longest[node]
            if hit is not None:
                length, order = hit
                candidate = (offset + i + 1 - length, order)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return node, None
        return node, (best[0], self.stops[best[1]])


_live: weakref.WeakValueDictionary[tuple[str, ...], StopAutomaton] = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


def compile_stops(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton for these stops: the one some live request already holds, else a new one.
    Shared while anything holds it (the server's plan of a request holds it until the request
    ends, so the engine thread never builds one), and gone with its last holder: no cache to
    evict from or to grow."""
    with _live_lock:
        automaton = _live.get(stops)
    if automaton is None:
        built = StopAutomaton(stops)
        with _live_lock:
            automaton = _live.setdefault(stops, built)
    return automaton
