"""What a LoRA adapter's KV blocks are keyed by: the same on every pod that loads the same adapter
(torch-free: the router computes it too).

K/V computed under an adapter belongs to that adapter's weights, so its prefix-cache blocks carry
an adapter key. A key made of a server's own numbering (its ``lora_int_id``, a load counter) would
keep adapters apart but give every pod different block hashes, so no router could find a pod's
adapter blocks, and a persistent offload tier could not tell a reloaded adapter from the one it
replaced under the same name. The key here is the adapter's name and a digest of its files:
two pods with the same adapter hash its prompts alike; new weights under an old name are a new key.

``adapter_id`` (63 bits of that digest, with the name) is what KV events publish as
``BlockStored.lora_id`` next to ``lora_name``; a subscriber that knows both rebuilds the key with
``cache_key`` and hashes an adapter request's prompt as the pods do.
"""

from __future__ import annotations

import hashlib
import os
import struct

_PREFIX = b"kvserve-lora-v1"
_CHUNK = 1 << 20


def _adapter_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    # The adapter's own files (config, weights): not whatever else shares its directory.
    names = sorted(n for n in os.listdir(path) if n.startswith("adapter_") and os.path.isfile(os.path.join(path, n)))
    return [os.path.join(path, n) for n in names]


def adapter_digest(path: str) -> bytes:
    """SHA-256 over the adapter's files (names, sizes, bytes), read in chunks."""
    h = hashlib.sha256(_PREFIX)
    for file in _adapter_files(path):
        name = os.path.basename(file).encode()
        h.update(struct.pack("<I", len(name)) + name + struct.pack("<Q", os.path.getsize(file)))
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.digest()


def adapter_id(name: str, digest: bytes) -> int:
    """A positive 63-bit id for (name, weights): what BlockStored.lora_id carries."""
    raw = name.encode("utf-8")
    h = hashlib.sha256(_PREFIX + struct.pack("<I", len(raw)) + raw + digest).digest()
    return int.from_bytes(h[:8], "big") >> 1


def cache_key(name: str, lora_id: int) -> bytes:
    """The adapter's prefix-cache key (runtime/engine/prefix_cache.py extra_key's lora_key)."""
    return f"lora:{lora_id:016x}:{name}".encode()
