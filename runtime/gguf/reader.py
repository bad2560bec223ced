"""Reads a GGUF file's metadata and tensor table, and maps its tensor data without copying it.

GGUF (llama.cpp's single-file format): a little-endian header (magic, version, tensor and
key/value counts), typed key/value metadata, a table of tensors (name, dimensions fastest-moving
first, ggml type, offset), then the tensor data, aligned to ``general.alignment`` (32 by default).

The gguf package's GGUFReader parses every metadata string through a numpy memmap slice; on a
49k-token vocabulary that costs ~3.5 s of CPU per open (~15 s for a 128k-token vocabulary with its
merges), so the metadata is parsed here with ``struct`` from one mapped buffer (~0.1 s) and the
gguf package supplies the type tables and the dequantizers. tests/test_gguf.py checks this reader
against GGUFReader.

A model file is untrusted input (``kvserve agent fetch`` takes it from any hub repository), so
every count, length and dimension is checked against the bytes the file really has before anything
is allocated for it: memory stays within the file's size whatever the header claims, nesting is
bounded, and every defect is a ``GGUFError`` (a ValueError) naming the file and the field.
"""

from __future__ import annotations

import contextlib
import math
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
# ggml's GGML_MAX_DIMS: llama.cpp refuses tensors with more dimensions.
MAX_DIMS = 4
# Arrays of arrays: llama.cpp reads none at all and no model metadata uses them; the spec allows
# them, so they are walked (and skipped) up to this depth instead of refused outright.
MAX_ARRAY_DEPTH = 8
# ggml counts elements and bytes in int64.
_MAX_TENSOR_ELEMENTS = 2**63 - 1
# The tokenizer is converted by transformers through the gguf package's reader, which keeps
# about 1.6 KB per metadata array element and 3.7 KB per key (a 24 MB file of 3M empty strings
# took it 4.9 GB and 3.5 minutes). This reader runs first (ModelConfig), so these caps bound that
# too. Real files: a few dozen keys; at most ~1M array elements (a 262k-token vocabulary with its
# scores and types, or 128k tokens and 280k merges); a few thousand tensors (per-expert MoE
# tensors: tens of thousands).
MAX_METADATA_KEYS = 16384
MAX_ARRAY_ELEMENTS = 2**21
MAX_TENSORS = 2**16
# Arrays of arrays cost the gguf package even more (2M empty ones: 2.6 GB) and no model uses them.
MAX_NESTED_ARRAY_ELEMENTS = 2**16

# Metadata value types: fixed-size scalars by struct format; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_SIZES = {kind: struct.calcsize("<" + fmt) for kind, fmt in _SCALARS.items()}
_NUMPY = {kind: np.dtype(t).newbyteorder("<") for kind, t in
          {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
           7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}.items()}
# One shared read-only empty array per type: a million keys of empty arrays then cost a dict
# entry each, not a numpy object each.
_EMPTY = {kind: np.empty(0, dtype) for kind, dtype in _NUMPY.items()}
for _array in _EMPTY.values():
    _array.flags.writeable = False
_STRING, _ARRAY = 8, 9
# The fewest bytes each kind of record can take, to refuse an impossible count before looping.
_MIN_STRING = 8  # its length
_MIN_ARRAY = 12  # item type + count
_MIN_KV = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_U64 = struct.Struct("<Q")
_ARRAY_HEADER = struct.Struct("<IQ")


class GGUFError(ValueError):
    """A GGUF file that cannot be read: names the file, the field (a header count, a metadata
    key or a tensor) and what is wrong with it."""

    def __init__(self, path: pathlib.Path, field: str, problem: str):
        super().__init__(f"model: {path}: {field}: {problem}")
        self.path, self.field, self.problem = path, field, problem


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


@dataclass(frozen=True)
class SkippedArrays:
    """An array of arrays: checked for structure, left unread (nothing kvserve reads uses one)."""

    count: int


_STRUCTS: dict[str, struct.Struct] = {}


class _Cursor:
    def __init__(self, buf: memoryview, path: pathlib.Path, string_arrays: bool):
        self.buf, self.pos, self.path, self.string_arrays = buf, 0, path, string_arrays
        self.elements = 0  # array elements so far, nested ones included (MAX_ARRAY_ELEMENTS)
        self.nested_elements = 0  # of those, in arrays of arrays (MAX_NESTED_ARRAY_ELEMENTS)
        # (what, name) of the field being read; formatted only when something is wrong with it,
        # which keeps a file of a million keys from costing a million f-strings.
        self.where: tuple[str, object] = ("header", None)

    @property
    def field(self) -> str:
        what, name = self.where
        if name is None:
            return what
        return f"{what} #{name}" if isinstance(name, int) else f"{what} {name!r}"

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(self.path, self.field, problem)

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > len(self.buf) - self.pos:
            raise self.fail(f"{what} needs {nbytes} bytes at byte {self.pos}, but the file has "
                            f"{len(self.buf)} bytes (truncated or corrupt)")

    def unpack(self, fmt: str, what: str) -> tuple:
        st = _STRUCTS.get(fmt)
        if st is None:
            st = _STRUCTS[fmt] = struct.Struct("<" + fmt)
        if self.pos + st.size > len(self.buf):
            self.need(st.size, what)
        out = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return out

    def count(self, what: str, min_item_bytes: int) -> int:
        """A record count, refused at once when even the smallest records would not fit."""
        (n,) = self.unpack("Q", what)
        if n * min_item_bytes > len(self.buf) - self.pos:
            raise self.fail(f"{what} {n} cannot fit in the {len(self.buf) - self.pos} bytes left of the file "
                            f"(truncated or corrupt)")
        return n

    def array_length(self, min_item_bytes: int) -> int:
        n = self.count("array length", min_item_bytes)
        self.add_elements(n)
        return n

    def add_elements(self, n: int) -> None:
        self.elements += n
        if self.elements > MAX_ARRAY_ELEMENTS:
            raise self.fail(f"metadata arrays hold more than {MAX_ARRAY_ELEMENTS} elements in all (the largest "
                            f"vocabularies need about 1M); refused")

    def add_nested(self, n: int) -> None:
        """Counted before a level is walked, so an oversized one is refused without the walk."""
        self.nested_elements += n
        if self.nested_elements > MAX_NESTED_ARRAY_ELEMENTS:
            raise self.fail(f"arrays of arrays hold more than {MAX_NESTED_ARRAY_ELEMENTS} elements in all "
                            f"(no model uses them); refused")

    def string(self, what: str = "string") -> str:
        (n,) = self.unpack("Q", "string length")
        if self.pos + n > len(self.buf):
            self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        # Token strings of some vocabularies are not valid UTF-8 on their own (partial bytes);
        # transformers' GGUF tokenizer conversion replaces them the same way.
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        buf, end, pos = self.buf, len(self.buf), self.pos
        for _ in range(count):  # the hot loop of a 49k-token vocabulary: kept minimal
            if pos + 8 > end:
                break
            pos += 8 + _U64.unpack_from(buf, pos)[0]
        else:
            if pos <= end:
                self.pos = pos
                return
        raise self.fail(f"array of {count} strings runs past the end of the file ({end} bytes)")

    def skip_array(self, depth: int) -> None:
        """Walks one array value without keeping it; bounded recursion (MAX_ARRAY_DEPTH)."""
        (item_kind,) = self.unpack("I", "array item type")
        if item_kind in _SCALAR_SIZES:
            n = self.array_length(_SCALAR_SIZES[item_kind])
            self.pos += n * _SCALAR_SIZES[item_kind]
        elif item_kind == _STRING:
            self.skip_strings(self.array_length(_MIN_STRING))
        elif item_kind == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
            self.skip_array_items(self.array_length(_MIN_ARRAY), depth + 1)
        else:
            raise self.fail(f"array item type {item_kind} is not a GGUF value type")

    def skip_array_items(self, count: int, depth: int) -> None:
        """`count` arrays at `depth`. Arrays of numbers are stepped over inline (a million small
        ones is the cheapest way to make a small file expensive); anything else recurses."""
        self.add_nested(count)
        buf, end, pos = self.buf, len(self.buf), self.pos
        header, sizes = _ARRAY_HEADER.unpack_from, _SCALAR_SIZES
        inline = 0
        for _ in range(count):
            if pos + 12 > end:
                break
            kind, n = header(buf, pos)
            size = sizes.get(kind)
            if size is None or pos + 12 + n * size > end:
                self.pos = pos
                self.skip_array(depth)  # raises for what does not fit; recurses into the rest
                pos = self.pos
            else:
                pos += 12 + n * size
                inline += n
        else:
            self.pos = pos
            self.add_elements(inline)
            self.add_nested(inline)
            return
        self.pos = pos
        self.need(12, "array header")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind], "value")[0]
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise self.fail(f"value type {kind} is not a GGUF value type")
        (item_kind,) = self.unpack("I", "array item type")
        if item_kind in _NUMPY:  # numbers: one numpy view, copied out of the mapping
            dtype = _NUMPY[item_kind]
            count = self.array_length(dtype.itemsize)
            if not count:
                return _EMPTY[item_kind]
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr
        if item_kind == _STRING:
            count = self.array_length(_MIN_STRING)
            if self.string_arrays:
                return [self.string() for _ in range(count)]
            self.skip_strings(count)
            return SkippedStrings(count)
        if item_kind == _ARRAY:
            count = self.array_length(_MIN_ARRAY)
            self.skip_array_items(count, depth=2)
            return SkippedArrays(count)
        raise self.fail(f"array item type {item_kind} is not a GGUF value type")


class GGUFFile:
    """A GGUF file: ``metadata`` (key -> value; numeric arrays as numpy arrays, arrays of strings
    as SkippedStrings unless ``string_arrays``, arrays of arrays as SkippedArrays), ``tensors``
    (name -> TensorInfo, in file order), and ``raw(name)``, the bytes of one tensor.
    Raises GGUFError (a ValueError) for anything malformed."""

    def __init__(self, path: str | pathlib.Path, *, string_arrays: bool = False):
        self.path = pathlib.Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
            raise GGUFError(self.path, "file", f"cannot read it as a GGUF file ({exc})") from None
        buf = memoryview(self._map)
        try:
            self._parse(buf, string_arrays)
        except BaseException:
            # The traceback keeps the parser's frames (and their views of the mapping) alive.
            with contextlib.suppress(BufferError):
                buf.release()
            self.close()
            raise

    def _parse(self, buf: memoryview, string_arrays: bool) -> None:
        cur = _Cursor(buf, self.path, string_arrays)
        if bytes(buf[:4]) != MAGIC:
            raise cur.fail("not a GGUF file (no GGUF magic)")
        cur.pos = 4
        (version,) = cur.unpack("I", "version")
        if version not in _VERSIONS:
            raise cur.fail(f"GGUF version {version} (or big-endian); supported: little-endian versions "
                           f"{list(_VERSIONS)}")
        self.version = version
        cur.where = ("tensor_count", None)
        tensor_count = cur.count("tensor count", _MIN_TENSOR)
        cur.where = ("kv_count", None)
        kv_count = cur.count("metadata key count", _MIN_KV)
        caps = (("tensor_count", tensor_count, MAX_TENSORS), ("kv_count", kv_count, MAX_METADATA_KEYS))
        for field, count, cap in caps:
            if count > cap:
                cur.where = (field, None)
                raise cur.fail(f"{count} is more than {cap}; refused (real files have far fewer)")
        if tensor_count * _MIN_TENSOR + kv_count * _MIN_KV > len(buf) - cur.pos:
            raise cur.fail(f"{kv_count} metadata keys and {tensor_count} tensors cannot fit in the "
                           f"{len(buf) - cur.pos} bytes left of the file (truncated or corrupt)")
        self.metadata: dict[str, Any] = {}
        for i in range(kv_count):
            cur.where = ("metadata key", i)
            key = cur.string("key")
            cur.where = ("metadata key", key)
            if key in self.metadata:
                raise cur.fail("appears twice")
            (kind,) = cur.unpack("I", "value type")
            self.metadata[key] = cur.value(kind)
        entries = []
        names: set[str] = set()
        for i in range(tensor_count):
            cur.where = ("tensor", i)
            name = cur.string("name")
            cur.where = ("tensor", name)
            if name in names:
                raise cur.fail("appears twice")
            names.add(name)
            (n_dims,) = cur.unpack("I", "dimension count")
            if n_dims > MAX_DIMS:
                raise cur.fail(f"has {n_dims} dimensions; at most {MAX_DIMS} are allowed")
            dims = cur.unpack(f"{n_dims}Q", "dimensions")
            raw_type, offset = cur.unpack("IQ", "type and offset")
            entries.append((name, tuple(reversed(dims)), raw_type, offset))
        alignment = self._alignment()
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, raw_type, offset in entries:
            info = tensor_info(self.path, len(buf), data_start, alignment, name, shape, raw_type, offset)
            self.tensors[name] = info
        _check_no_overlap(self.path, self.tensors.values())

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        power_of_two = isinstance(alignment, int) and alignment >= 1 and not alignment & (alignment - 1)
        if isinstance(alignment, bool) or not power_of_two:
            raise GGUFError(self.path, "metadata key 'general.alignment'",
                            f"{alignment!r} is not a power of two")
        return alignment

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(self.path, "metadata key 'general.architecture'", "missing (or not a string)")
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

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensor_info(path: pathlib.Path, file_size: int, data_start: int, alignment: int, name: str,
                shape: tuple[int, ...], raw_type: int, offset: int) -> TensorInfo:
    """One tensor's table entry checked against the file: a known type, a whole number of blocks
    per row, an element count that fits int64 (Python's exact product: a numpy product of
    uint64 dimensions wraps around to a small number), aligned data that lies inside the file."""
    field = f"tensor {name!r}"
    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise GGUFError(path, field, f"unknown ggml type {raw_type}") from None
    if 0 in shape:  # an empty weight is of no use, and has no rows to view it by
        raise GGUFError(path, field, f"dimensions {list(reversed(shape))} include a 0")
    count = math.prod(shape)
    if count > _MAX_TENSOR_ELEMENTS:
        raise GGUFError(path, field, f"dimensions {list(reversed(shape))} overflow: {count} elements is more "
                                     f"than 2**63 - 1")
    rows_of = shape[-1] if shape else 1
    if rows_of % block:
        raise GGUFError(path, field, f"({ggml_type.name}) has rows of {rows_of} values, not a multiple of its "
                                     f"block of {block}")
    if offset % alignment:
        raise GGUFError(path, field, f"data offset {offset} is not a multiple of general.alignment {alignment}")
    start = data_start + offset
    nbytes = count // block * type_size
    if start + nbytes > file_size:
        raise GGUFError(path, field, f"truncated: its data ends at byte {start + nbytes}, the file has "
                                     f"{file_size} bytes")
    return TensorInfo(name, shape, ggml_type, start, nbytes)


def _check_no_overlap(path: pathlib.Path, infos) -> None:
    end, previous = 0, None
    for info in sorted((i for i in infos if i.nbytes), key=lambda i: i.offset):
        if info.offset < end:
            raise GGUFError(path, f"tensor {info.name!r}", f"its data overlaps tensor {previous!r}")
        end, previous = info.offset + info.nbytes, info.name


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
