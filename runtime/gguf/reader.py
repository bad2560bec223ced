"""Reads a GGUF file's metadata and tensor table, and maps its tensor data without copying it.

GGUF (llama.cpp's single-file format): a little-endian header (magic, version, tensor and
key/value counts), typed key/value metadata, a table of tensors (name, dimensions fastest-moving
first, ggml type, offset), then the tensor data, aligned to ``general.alignment`` (32 by default).

The gguf package's GGUFReader parses every metadata string through a numpy memmap slice; on a
49k-token vocabulary that costs ~3.5 s of CPU per open (~15 s for a 128k-token vocabulary with its
merges), so the metadata is parsed here with ``struct`` from one mapped buffer (~0.1 s) and the
gguf package supplies the type tables and the dequantizers. tests/test_gguf.py checks this reader
against GGUFReader.
"""

from __future__ import annotations

import mmap
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value types: fixed-size scalars by struct format; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: (rows, columns) for a matrix
    ggml_type: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


@dataclass(frozen=True)
class SkippedStrings:
    """An array of strings left unread (a vocabulary or merges: the tokenizer reads those)."""

    count: int


class _Cursor:
    def __init__(self, buf: memoryview, path: pathlib.Path, string_arrays: bool):
        self.buf, self.pos, self.path, self.string_arrays = buf, 0, path, string_arrays

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"model: {self.path} is truncated (GGUF header ends early)")
        out = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        (n,) = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"model: {self.path} is truncated (GGUF header ends early)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        # Token strings of some vocabularies are not valid UTF-8 on their own (partial bytes);
        # transformers' GGUF tokenizer conversion replaces them the same way.
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("IQ")
            if item_kind in _NUMPY:  # numbers: one numpy view, copied out of the mapping
                dtype = np.dtype(_NUMPY[item_kind]).newbyteorder("<")
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ValueError(f"model: {self.path} is truncated (GGUF header ends early)")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos = end
                return arr
            if item_kind == _STRING and not self.string_arrays:
                try:
                    for _ in range(count):
                        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
                except struct.error:
                    self.pos = len(self.buf) + 1
                if self.pos > len(self.buf):
                    raise ValueError(f"model: {self.path} is truncated (GGUF header ends early)")
                return SkippedStrings(count)
            return [self.value(item_kind) for _ in range(count)]
        raise ValueError(f"model: {self.path} has a GGUF metadata value of unknown type {kind}")


class GGUFFile:
    """A GGUF file: ``metadata`` (key -> value; numeric arrays as numpy arrays, arrays of strings
    as SkippedStrings unless ``string_arrays``), ``tensors`` (name -> TensorInfo, in file order),
    and ``raw(name)``, the bytes of one tensor."""

    def __init__(self, path: str | pathlib.Path, *, string_arrays: bool = False):
        self.path = pathlib.Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
            raise ValueError(f"model: cannot read GGUF file {str(self.path)!r} ({exc})") from None
        buf = memoryview(self._map)
        cur = _Cursor(buf, self.path, string_arrays)
        if bytes(buf[:4]) != MAGIC:
            raise ValueError(f"model: {str(self.path)!r} is not a GGUF file (no GGUF magic)")
        cur.pos = 4
        (version,) = cur.unpack("I")
        if version not in _VERSIONS:
            raise ValueError(f"model: {self.path} is GGUF version {version} (or big-endian); "
                             f"supported: little-endian versions {list(_VERSIONS)}")
        tensor_count, kv_count = cur.unpack("QQ")
        self.version = version
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            (kind,) = cur.unpack("I")
            self.metadata[key] = cur.value(kind)
        entries = []
        for _ in range(tensor_count):
            name = cur.string()
            (n_dims,) = cur.unpack("I")
            dims = cur.unpack(f"{n_dims}Q")
            raw_type, offset = cur.unpack("IQ")
            entries.append((name, tuple(reversed(dims)), raw_type, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"model: {self.path} has general.alignment {alignment}, not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, raw_type, offset in entries:
            try:
                ggml_type = GGMLQuantizationType(raw_type)
                block, type_size = GGML_QUANT_SIZES[ggml_type]
            except (ValueError, KeyError):
                raise ValueError(f"model: tensor {name!r} in {self.path} has unknown ggml type {raw_type}") from None
            count = int(np.prod(shape)) if shape else 1
            if shape and shape[-1] % block:
                raise ValueError(f"model: tensor {name!r} ({ggml_type.name}) has rows of {shape[-1]} values, "
                                 f"not a multiple of its block of {block}")
            info = TensorInfo(name, shape, ggml_type, data_start + offset, count // block * type_size)
            if info.offset + info.nbytes > len(buf):
                raise ValueError(f"model: {self.path} is truncated: tensor {name!r} ends at byte "
                                 f"{info.offset + info.nbytes}, the file has {len(buf)}")
            self.tensors[name] = info

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"model: {self.path} has no general.architecture in its GGUF metadata")
        return arch

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes as a read-only uint8 array [rows..., bytes per row]
        (a view of the mapped file: nothing is copied)."""
        info = self.tensors[name]
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = info.shape[:-1] if len(info.shape) > 1 else ()
        return data.reshape(*rows, -1)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a numpy view still holds the mapping; it closes when that is freed
            pass

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_gguf_path(model: str | pathlib.Path) -> bool:
    """Whether `model` names a GGUF file (by its suffix; the magic is checked when it is read)."""
    return str(model).lower().endswith(".gguf")


def resolve_model_path(model: str) -> str:
    """`model` itself, or, for a directory holding one .gguf file and no config.json (how
    `kvserve agent fetch` lays out a GGUF model in the pod's volume), that file."""
    path = pathlib.Path(model)
    if not path.is_dir() or (path / "config.json").exists():
        return model
    files = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(files) > 1:
        raise ValueError(f"model: {model!r} holds several GGUF files ({', '.join(p.name for p in files)}); "
                         f"name one of them")
    return str(files[0]) if files else model
