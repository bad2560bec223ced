"""The KV offload tier: KV blocks that leave the pool are kept in host memory or in files and
found again by their prefix-cache hashes; preempted requests are swapped out instead of
recomputed when that is cheaper (issue 21, docs/kv-offload.md).

- ``namespace.py``: what makes stored blocks readable by an engine (model, weights, dtype, block
  size, TP layout); a different namespace never reads them.
- ``index.py``: pure policy: which keys each store holds (an LRU with a byte budget), and whether
  a preemption should swap or recompute (``preemption_choice``).
- ``store.py``: the bytes: a host-memory store and a file store (temp name, fsync, rename;
  header with namespace and checksum).
- ``offloader.py``: one rank's side: copies blocks between its pools and the stores, with a
  background writer so a step never waits for a file.
- ``manager.py``: the engine's side: the indexes, the keys, the hooks the block managers and the
  scheduler call, and the statistics.
"""
