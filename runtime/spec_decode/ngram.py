"""N-gram prompt lookup: the continuation of the latest earlier occurrence of the context's tail."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(token_ids: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to `k` tokens that followed the latest earlier match of the last n tokens (longest n
    from `max_n` down to `min_n` first); [] when nothing matches."""
    num = len(token_ids)
    if k < 1 or num < 2:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        # Windows starting at 0..num-1-n: every occurrence that has at least one token after it.
        windows = sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[num - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []
