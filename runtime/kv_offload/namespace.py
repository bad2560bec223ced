"""What makes a stored KV block readable: the namespace every key of an engine lives in.

A block's bytes are only meaningful to an engine with the same model weights, dtype and KV cache
dtype, block size, layer grouping, and the same KV heads (a tensor-parallel rank holds a range of
them). All of that goes into one digest: the file tier keeps each namespace in its own directory
and repeats the digest in every file's header, so nothing stale (another model, a new revision) is
ever read back. The head range, not the TP degree, is the key: after a TP change a rank reads the
old layout's namespaces that hold its heads (heads.py) and slices or joins them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from dataclasses import asdict, dataclass

# Weight files whose content identifies a model revision.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
# Sampled regions per weight file: a different fine-tune differs everywhere, so a few spread-out
# chunks tell revisions apart without reading gigabytes at every start.
_SAMPLES = 16
_SAMPLE_BYTES = 4096


def weights_fingerprint(model: str) -> str:
    """A hex digest of a model directory (or a single .gguf file): config.json and every weight
    file's name, size and sampled content, plus a Hugging Face snapshot revision in the path."""
    path = pathlib.Path(model)
    h = hashlib.sha256()
    parts = path.resolve().parts
    if "snapshots" in parts[:-1]:  # a hub cache path: .../snapshots/<revision>/...
        h.update(parts[parts.index("snapshots") + 1].encode())
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json"))
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            if p.name == "config.json" or size <= _SAMPLES * _SAMPLE_BYTES:
                h.update(f.read())
                continue
            for i in range(_SAMPLES):
                f.seek(i * (size - _SAMPLE_BYTES) // (_SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


@dataclass(frozen=True)
class Namespace:
    """Everything a stored block's bytes depend on. ``layout`` is each KV cache group's window and
    layers, plus the per-layer pool shape with all KV heads; ``heads`` the KV heads [h0, h1) a
    block of this namespace holds (a TP rank's), ``copy`` which copy of them when more ranks than
    KV heads each hold one (heads.py)."""

    model_id: str
    weights: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    heads: tuple[int, int]
    layout: str
    copy: int = 0

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).digest()

    @property
    def dirname(self) -> str:
        """The namespace's directory under the tier's root (one per head range)."""
        return f"{self.digest.hex()[:32]}"

    def for_heads(self, heads: tuple[int, int], copy: int = 0) -> Namespace:
        return Namespace(**{**asdict(self), "heads": tuple(heads), "copy": copy})

    def describe(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def namespace_for(config, model_config, *, dtype: str, kv_cache_dtype: str, heads: tuple[int, int],
                  layout: str, copy: int = 0) -> Namespace:
    return Namespace(model_id=os.path.basename(os.path.normpath(str(config.model))) or str(config.model),
                     weights=weights_fingerprint(config.model), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                     block_size=config.block_size, heads=tuple(heads), layout=layout, copy=copy)
