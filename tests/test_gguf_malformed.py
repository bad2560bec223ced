"""Malformed and hostile GGUF files: every one is a ValueError naming the file and the field,
found before anything is allocated for what the header claims (memory stays within the file's
size), and a hypothesis fuzz test (random bytes, generated structures, mutations of a valid file
written by the gguf package) that only ever sees ValueError."""

from __future__ import annotations

import os
import pathlib
import struct
import tempfile
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.runtime.agent.fetch import FetchError, check_model_dir, fetch
from kvserve.runtime.gguf import model_config
from kvserve.runtime.gguf.reader import (
    _MIN_KV,
    MAX_ARRAY_DEPTH,
    MAX_ARRAY_ELEMENTS,
    MAX_METADATA_KEYS,
    MAX_NESTED_ARRAY_ELEMENTS,
    MAX_TENSORS,
    GGUFFile,
    SkippedArrays,
)

U8, I32, F32, STRING, ARRAY, U64 = 0, 5, 6, 8, 9, 10
T_F32, T_Q8_0 = 0, 8


# ------------------------------------------------------------- a byte-level GGUF writer
# Hand-rolled, because the gguf package refuses to write most of what these tests need.


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", kind) + payload


def array(item_kind: int, count: int, items: bytes = b"") -> bytes:
    return struct.pack("<IQ", item_kind, count) + items


def tinfo(name: str, dims: tuple[int, ...], ggml_type: int = T_F32, offset: int = 0) -> bytes:
    return s(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) + struct.pack("<IQ", ggml_type, offset)


def gguf(kvs: list[bytes] = (), tensors: list[bytes] = (), data: bytes = b"", *, counts=None,
         alignment: int = 32) -> bytes:
    n_tensors, n_kvs = counts or (len(tensors), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kvs) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % alignment) + data


def write(tmp: pathlib.Path, content: bytes, name: str = "m.gguf") -> pathlib.Path:
    path = tmp / name
    path.write_bytes(content)
    return path


def nested(depth: int) -> bytes:
    """An array of arrays `depth` levels deep, the innermost one empty (12 bytes a level)."""
    return b"".join(struct.pack("<IQ", ARRAY, 1) for _ in range(depth - 1)) + array(U8, 0)


# ------------------------------------------------------------------------- the attacks


def test_deeply_nested_arrays_are_a_value_error_not_a_recursion_error(tmp_path):
    path = write(tmp_path, gguf([kv("evil.nest", ARRAY, nested(100_000))]))
    with pytest.raises(ValueError, match=rf"m\.gguf: metadata key 'evil\.nest': arrays nested more than "
                                         rf"{MAX_ARRAY_DEPTH} deep"):
        GGUFFile(path)
    ok = write(tmp_path, gguf([kv("fine.nest", ARRAY, nested(MAX_ARRAY_DEPTH))]), "ok.gguf")
    assert GGUFFile(ok).metadata["fine.nest"] == SkippedArrays(1)


def test_many_empty_arrays_keep_no_object_per_element(tmp_path):
    """The 24 MB case (2M empty arrays in one value: 618 MB and 10+ s before) is refused from its
    count; below the cap, arrays of arrays keep no object per element."""
    n = MAX_NESTED_ARRAY_ELEMENTS
    ok = write(tmp_path, gguf([kv("evil.empties", ARRAY, array(ARRAY, n, array(U8, 0) * n))]), "ok.gguf")
    assert GGUFFile(ok).metadata["evil.empties"] == SkippedArrays(n)
    n = 200_000
    path = write(tmp_path, gguf([kv("evil.empties", ARRAY, array(ARRAY, n, array(U8, 0) * n))]))
    with pytest.raises(ValueError, match=rf"m\.gguf: metadata key 'evil\.empties': arrays of arrays hold more "
                                         rf"than {MAX_NESTED_ARRAY_ELEMENTS} elements"):
        GGUFFile(path)


@pytest.mark.parametrize("dims", [(2**32, 2**32), (2**63, 2), (2**64 - 1, 2**64 - 1, 3, 5)])
def test_dimensions_whose_product_overflows_are_refused(tmp_path, dims):
    """numpy's product of these wraps to 0 (or a small number): a 190-byte file then passed as a
    complete model with a tensor of 2**64 floats."""
    path = write(tmp_path, gguf([kv("general.architecture", STRING, s("llama"))], [tinfo("blk.0.x", dims)]))
    assert path.stat().st_size < 200
    with pytest.raises(ValueError, match=r"m\.gguf: tensor 'blk\.0\.x': dimensions .* overflow"):
        GGUFFile(path)
    assert any("overflow" in p for p in check_model_dir(tmp_path))
    with pytest.raises(FetchError, match="overflow"):
        fetch(str(path), str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").iterdir())


def test_a_huge_tensor_in_a_small_file_is_truncation(tmp_path):
    path = write(tmp_path, gguf([], [tinfo("w", (2**20, 2**20))]))
    with pytest.raises(ValueError, match=r"tensor 'w': truncated: its data ends at byte \d+, the file has \d+"):
        GGUFFile(path)


ONE_KB = b"\0" * 1024


@pytest.mark.parametrize("content, field, words", [
    # Counts claiming far more records than the file holds: refused at once, nothing allocated.
    (gguf(counts=(0, 10**12), kvs=[ONE_KB]), "kv_count", "cannot fit"),
    (gguf(counts=(10**12, 0), kvs=[ONE_KB]), "tensor_count", "cannot fit"),
    (gguf(counts=(2**64 - 1, 2**64 - 1)), "tensor_count", "cannot fit"),
    (gguf([kv("a.numbers", ARRAY, array(F32, 10**12)) + ONE_KB]), "metadata key 'a.numbers'", "cannot fit"),
    (gguf([kv("a.strings", ARRAY, array(STRING, 10**12)) + ONE_KB]), "metadata key 'a.strings'", "cannot fit"),
    (gguf([kv("a.arrays", ARRAY, array(ARRAY, 10**12)) + ONE_KB]), "metadata key 'a.arrays'", "cannot fit"),
    (gguf([kv("a.string", STRING, struct.pack("<Q", 2**63)) + ONE_KB]), "metadata key 'a.string'",
     "truncated"),
    (gguf([s(b"\xff" * 10**3)[:100]]), "metadata key #0", "truncated"),
    # Strings that each claim a length past the end of the file.
    (gguf([kv("a.strings", ARRAY, array(STRING, 3, s("ok") + struct.pack("<Q", 2**40)))]) + ONE_KB,
     "metadata key 'a.strings'", "past the end"),
    (gguf([kv("a.kind", 13, b"")]) + ONE_KB, "metadata key 'a.kind'", "value type 13"),
    (gguf([kv("a.kind", ARRAY, array(77, 0))]) + ONE_KB, "metadata key 'a.kind'", "item type 77"),
    (gguf([kv("dup", U8, b"\1"), kv("dup", U8, b"\2")]), "metadata key 'dup'", "appears twice"),
    (gguf([kv("general.alignment", STRING, s("abc"))]), "metadata key 'general.alignment'", "power of two"),
    (gguf([kv("general.alignment", F32, struct.pack("<f", float("inf")))]), "metadata key 'general.alignment'",
     "power of two"),
    (gguf([kv("general.alignment", I32, struct.pack("<i", 48))]), "metadata key 'general.alignment'",
     "power of two"),
    (gguf([kv("general.alignment", ARRAY, array(U8, 1, b"\4"))]), "metadata key 'general.alignment'",
     "power of two"),
    (gguf([], [tinfo("t", (1, 1, 1, 1, 1))], b"\0" * 64), "tensor 't'", "5 dimensions"),
    (gguf([], [tinfo("t", (0, 0))], b"\0" * 64), "tensor 't'", "include a 0"),
    (gguf([], [tinfo("t", (4,)), tinfo("t", (4,), offset=32)], b"\0" * 64), "tensor 't'", "appears twice"),
    (gguf([], [tinfo("t", (4,), ggml_type=99)], b"\0" * 64), "tensor 't'", "unknown ggml type 99"),
    (gguf([], [tinfo("t", (33,), ggml_type=T_Q8_0)], b"\0" * 64), "tensor 't'", "block of 32"),
    (gguf([], [tinfo("t", (4,), offset=3)], b"\0" * 64), "tensor 't'", "not a multiple of general.alignment"),
    (gguf([], [tinfo("a", (16,)), tinfo("b", (16,), offset=32)], b"\0" * 128), "tensor 'b'", "overlaps tensor 'a'"),
    (gguf([], [tinfo("a", (16,), offset=32), tinfo("b", (16,))], b"\0" * 128), "tensor 'a'", "overlaps tensor 'b'"),
])
def test_malformed_headers_name_the_file_and_field(tmp_path, content, field, words):
    path = write(tmp_path, content)
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        GGUFFile(path)
    assert time.perf_counter() - start < 5  # "at once": no loop over a claimed 10**12 records
    assert str(path) in str(err.value) and f": {field}: " in str(err.value) and words in str(err.value), err.value


def test_caps_that_also_bound_the_tokenizer_readers_memory(tmp_path):
    """transformers converts the tokenizer through the gguf package's reader, which keeps ~1.6 KB
    per array element and ~3.7 KB per key: this reader runs first and refuses more than any real
    model has (at once, from the counts)."""
    keys = write(tmp_path, gguf(counts=(0, MAX_METADATA_KEYS + 1), kvs=[b"\0" * _MIN_KV * (MAX_METADATA_KEYS + 1)]))
    with pytest.raises(ValueError, match=rf": kv_count: {MAX_METADATA_KEYS + 1} is more than {MAX_METADATA_KEYS}"):
        GGUFFile(keys)
    tensors = write(tmp_path, gguf(counts=(MAX_TENSORS + 1, 0), kvs=[b"\0" * 24 * (MAX_TENSORS + 1)]), "t.gguf")
    with pytest.raises(ValueError, match=rf": tensor_count: {MAX_TENSORS + 1} is more than {MAX_TENSORS}"):
        GGUFFile(tensors)
    half = MAX_ARRAY_ELEMENTS // 2
    elements = write(tmp_path, gguf([kv("a.tokens", ARRAY, array(U8, half, b"\0" * half)),
                                     kv("b.scores", ARRAY, array(U8, half + 1, b"\0" * (half + 1)))]), "e.gguf")
    with pytest.raises(ValueError, match=rf"metadata key 'b\.scores': metadata arrays hold more than "
                                         rf"{MAX_ARRAY_ELEMENTS} elements"):
        GGUFFile(elements)
    exactly = write(tmp_path, gguf([kv("a.tokens", ARRAY, array(U8, half, b"\0" * half)),
                                    kv("b.scores", ARRAY, array(U8, half, b"\0" * half))]), "x.gguf")
    assert len(GGUFFile(exactly).metadata["b.scores"]) == half


def test_the_gguf_package_and_this_reader_agree_on_a_valid_file(valid_gguf):
    """The mutation seed is itself valid: every kind of value, a nested array, three types."""
    import gguf

    ours, ref = GGUFFile(valid_gguf, string_arrays=True), gguf.GGUFReader(valid_gguf)
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    assert ours.metadata["test.nested"] == SkippedArrays(2)
    assert ours.metadata["test.strings"] == ["a", "bc", ""]
    for t in ref.tensors:
        assert ours.tensors[t.name].offset == t.data_offset and ours.tensors[t.name].nbytes == t.n_bytes


# ------------------------------------------------------------------------------- fuzzing


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> pathlib.Path:
    """A small valid file written by the gguf package: the seed of the mutation fuzzer."""
    import gguf

    path = tmp_path_factory.mktemp("seed") / "seed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_uint32("llama.embedding_length", 8)
    w.add_uint32("llama.attention.head_count", 2)
    w.add_uint32("llama.feed_forward_length", 16)
    w.add_array("test.strings", ["a", "bc", ""])
    w.add_array("test.numbers", [1, 2, 3])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_float32("test.float", 0.5)
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float16))
    q8 = np.zeros((2, 34), dtype=np.uint8)  # two rows of one Q8_0 block (32 values in 34 bytes)
    w.add_tensor("output.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _only_value_errors(content: bytes) -> None:
    """Parses `content` as a file the way the runtime and the fetch check do: whatever the
    bytes, the only exception is ValueError."""
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "fuzz.gguf"
        path.write_bytes(content)
        try:
            with GGUFFile(path) as gf:
                for name in gf.tensors:
                    gf.raw(name)
        except ValueError as exc:
            assert "fuzz.gguf" in str(exc), exc
        try:
            model_config(path)
        except ValueError as exc:
            assert "fuzz.gguf" in str(exc), exc
        assert isinstance(check_model_dir(d), list)


_INTERESTING_U64 = st.sampled_from([0, 1, 3, 31, 32, 2**31, 2**32, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1])
_U64S = st.one_of(st.integers(0, 2**64 - 1), _INTERESTING_U64, st.integers(0, 300))


@st.composite
def _values(draw, depth=0):
    kind = draw(st.integers(0, 13))
    if kind in (0, 1, 7):
        return struct.pack("<I", kind) + draw(st.binary(min_size=1, max_size=1))
    if kind in (2, 3):
        return struct.pack("<I", kind) + draw(st.binary(min_size=2, max_size=2))
    if kind in (4, 5, 6):
        return struct.pack("<I", kind) + draw(st.binary(min_size=4, max_size=4))
    if kind in (10, 11, 12):
        return struct.pack("<I", kind) + draw(st.binary(min_size=8, max_size=8))
    if kind == STRING:
        return struct.pack("<I", kind) + struct.pack("<Q", draw(_U64S)) + draw(st.binary(max_size=8))
    if kind == ARRAY and depth < 4:
        items = draw(st.lists(_values(depth + 1), max_size=3))
        item_kind = draw(st.sampled_from([0, 4, 6, STRING, ARRAY, 13]))
        body = b"".join(i[4:] for i in items)  # drop each item's own type: array items share one
        return struct.pack("<I", kind) + struct.pack("<IQ", item_kind, draw(_U64S)) + body
    return struct.pack("<I", kind)


@st.composite
def _structured(draw) -> bytes:
    """Well-framed GGUF whose counts, lengths, kinds, dimensions and offsets are arbitrary."""
    kvs = [s(draw(st.sampled_from(["general.alignment", "general.architecture", "llama.block_count", "k"])))
           + draw(_values()) for _ in range(draw(st.integers(0, 4)))]
    tensors = []
    for _ in range(draw(st.integers(0, 3))):
        dims = draw(st.lists(_U64S, max_size=5))
        tensors.append(s(draw(st.sampled_from(["token_embd.weight", "output.weight", "t"])))
                       + struct.pack(f"<I{len(dims)}Q", draw(st.sampled_from([len(dims), 2**32 - 1])), *dims)
                       + struct.pack("<IQ", draw(st.integers(0, 40)), draw(_U64S)))
    counts = draw(st.one_of(st.none(), st.tuples(_U64S, _U64S)))
    return gguf(kvs, tensors, draw(st.binary(max_size=256)), counts=counts)


@st.composite
def _mutated(draw, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data) - 1))
        how = draw(st.sampled_from(["byte", "u64", "u32", "cut", "dup"]))
        if how == "byte":
            data[at] = draw(st.integers(0, 255))
        elif how == "u64":
            data[at:at + 8] = struct.pack("<Q", draw(_U64S))
        elif how == "u32":
            data[at:at + 4] = struct.pack("<I", draw(st.integers(0, 2**32 - 1)))
        elif how == "cut":
            del data[at:]
            if not data:
                break
        else:
            data[at:at] = data[at:at + draw(st.integers(1, 64))]
    return bytes(data)


# KVSERVE_FUZZ_EXAMPLES=5000 for a longer hunt than CI's.
_FUZZ = settings(max_examples=int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "150")), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(content=st.one_of(st.binary(max_size=512), st.binary(max_size=512).map(lambda b: b"GGUF\3\0\0\0" + b)))
def test_fuzz_random_bytes_only_value_errors(content):
    _only_value_errors(content)


@_FUZZ
@given(content=_structured())
def test_fuzz_generated_structures_only_value_errors(content):
    _only_value_errors(content)


@_FUZZ
@given(data=st.data())
def test_fuzz_mutations_of_a_valid_file_only_value_errors(valid_gguf, data):
    _only_value_errors(data.draw(_mutated(valid_gguf.read_bytes())))


_CONFIG_KEYS = ["llama.block_count", "llama.embedding_length", "llama.attention.head_count",
                "llama.attention.head_count_kv", "llama.feed_forward_length", "llama.context_length",
                "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base", "llama.attention.key_length",
                "llama.rope.dimension_count", "llama.rope.scaling.type", "llama.rope.scaling.factor",
                "llama.rope.scale_linear", "llama.rope.scaling.original_context_length",
                "llama.rope.scaling.yarn_beta_fast",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"]
_CONFIG_VALUES = st.one_of(st.sampled_from([0, 1, 2, 3, 8, 2**31, 2**40, "yarn", "linear", "none", True]),
                           st.integers(-2**40, 2**40), st.floats(allow_nan=True, allow_infinity=True, width=32),
                           st.text(max_size=3), st.lists(st.integers(0, 9), max_size=2), st.lists(st.text(max_size=2),
                                                                                                 max_size=2))


@_FUZZ
@given(overrides=st.dictionaries(st.sampled_from(_CONFIG_KEYS), _CONFIG_VALUES, min_size=1, max_size=4))
def test_fuzz_config_metadata_values_only_value_errors(overrides):
    """A well-formed file whose config values have any type and range: model_config (the
    GGUF -> ModelConfig translation) says which key is wrong instead of a TypeError,
    ZeroDivisionError, OverflowError or a MemoryError from a block count of 2**40."""
    import gguf

    md = {"llama.block_count": 1, "llama.embedding_length": 8, "llama.attention.head_count": 2,
          "llama.feed_forward_length": 16, **overrides}
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "cfg.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        for key, value in md.items():
            if isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, int):
                (w.add_uint32 if 0 <= value < 2**32 else w.add_int64)(key, value)
            elif isinstance(value, float):
                w.add_float32(key, value)
            elif isinstance(value, str):
                w.add_string(key, value)
            elif value:
                w.add_array(key, value)
        w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
        w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        try:
            model_config(path)
        except ValueError as exc:
            assert "cfg.gguf" in str(exc) or "model config" in str(exc), exc
