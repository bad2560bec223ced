"""Content keys for automatic prefix caching: one hash chain over a sequence's full KV blocks.

Block i's key is SHA-256 over (key of block i-1, the block's token ids, an extra key such as a
cache salt), so equal keys mean equal whole prefixes, not just equal blocks. The encoding is
fixed-width and length-prefixed, and SHA-256 is collision resistant: two different prefixes
never share a key in practice, which is what lets a hit skip the tokens without re-checking them.

Pure functions (no torch); the block manager stores the keys, the scheduler extends them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"kvserve-prefix-v1"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes | None = None) -> BlockHash:
    h = hashlib.sha256()
    h.update(_ROOT if parent is None else parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    if extra:
        h.update(struct.pack("<I", len(extra)))
        h.update(extra)
    return h.digest()


def extra_key(cache_salt: str | None, lora_key: bytes | None = None) -> bytes | None:
    """The extra key mixed into the first block only (it then flows down the chain): the cache
    salt and the LoRA adapter (K/V computed under one adapter is not another's)."""
    salt = None if cache_salt is None else cache_salt.encode("utf-8")
    if lora_key is None:
        return salt
    # Length-prefixed, so no (salt, adapter) pair encodes like another.
    return struct.pack("<I", len(lora_key)) + lora_key + (salt or b"")


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], num_tokens: int,
                        block_size: int, extra: bytes | None = None) -> list[BlockHash]:
    """Appends (in place) the keys of every full block within the first `num_tokens` tokens."""
    for i in range(len(hashes), min(num_tokens, len(token_ids)) // block_size):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size],
                                 extra if i == 0 else None))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, extra: bytes | None = None) -> list[BlockHash]:
    return extend_block_hashes([], token_ids, len(token_ids), block_size, extra)
