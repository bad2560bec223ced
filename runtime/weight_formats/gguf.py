"""``gguf``: a GGUF file's per-tensor types (``quantization_config.tensor_types``, which the GGUF
reader puts in the config it builds from the file's metadata).

As the runtime holds a file: Q4_0, Q4_1 and Q4_K stay 4-bit with group 32; Q8_0 stays 8-bit
with group 32; every other type is dequantized into the compute dtype.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from kvserve.runtime.weight_formats.base import FormatConfig, WeightFormat, int4_bytes, int8_bytes

GROUP = 32
INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
INT8_TYPES = frozenset({"Q8_0"})


class GGUFFormat(FormatConfig):
    name = "gguf"
    in_checkpoints = True

    def __init__(self, tensor_types: Mapping[str, str]):
        self.tensor_types = dict(tensor_types)

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any] | None = None):
        types = (quantization_config or {}).get("tensor_types")
        if not isinstance(types, Mapping):
            raise ValueError("quantization: 'gguf' is the format of .gguf model files; pass model=FILE.gguf "
                             "(a Hugging Face directory is never GGUF)")
        return cls(types)

    @classmethod
    def for_planning(cls, quantization_config: Mapping[str, Any] | None):
        types = (quantization_config or {}).get("tensor_types")
        return cls(types if isinstance(types, Mapping) else {})  # unknown types: planned dequantized

    def weight_format(self, dtype_size: int, row_length: int) -> WeightFormat:
        def per_weight(ggml_type: str) -> float:
            if ggml_type in INT4_TYPES:
                return int4_bytes(GROUP, dtype_size, row_length)
            return int8_bytes(GROUP, dtype_size, row_length) if ggml_type in INT8_TYPES else dtype_size

        # Matmul tensors averaged by count (tensor_types carry no sizes): close when one type dominates.
        types = self.tensor_types
        linear = [per_weight(t) for n, t in types.items()
                  if ".layers." in n and n.endswith(".weight") and not n.endswith("norm.weight")]
        vocab = [per_weight(types[n]) for n in ("model.embed_tokens.weight", "lm_head.weight") if n in types]
        return WeightFormat(self.name, sum(linear) / len(linear) if linear else dtype_size,
                            max(vocab) if vocab else dtype_size)

    def quantizes_vocab(self) -> bool:
        return True  # the runtime decides from the table's own type

    def describe(self) -> dict[str, Any]:
        counts = Counter(t for name, t in self.tensor_types.items() if not name.endswith("norm.weight"))
        return {"quantization": "gguf", "tensor_types": dict(sorted(counts.items()))}
