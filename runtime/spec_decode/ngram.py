"""N-gram prompt lookup: the continuation of the latest earlier occurrence of the context's tail."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ngram_propose(token_ids: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to `k` tokens that followed the latest earlier match of the last n tokens (longest n
    from `max_n` down to `min_n` first); [] when nothing matches.

    Runs before every speculative step, on the host, so it stays a handful of vector operations
    whatever the context length: the candidates are the earlier positions holding the last token,
    and each extends its match backwards at most max_n - 1 times."""
    num = len(token_ids)
    top = min(max_n, num - 1)
    if k < 1 or num < 2 or top < min_n:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    # Where an earlier window could end: a position before the last one that holds the last token.
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    if ends.size == 0:
        return []
    length = np.ones(ends.size, dtype=np.int64)  # how many tokens each candidate matches, backwards
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, top):
        before = ends - j
        alive &= before >= 0
        alive[alive] = arr[before[alive]] == arr[num - 1 - j]
        if not alive.any():
            break
        length += alive
    n = min(int(length.max()), top)
    if n < min_n:
        return []
    start = int(ends[np.flatnonzero(length >= n)[-1]]) + 1  # the latest window of the longest n
    return arr[start:start + k].tolist()
