"""``int4``: weight-only, group-wise asymmetric; quantized at load, vocabulary included.

128 input features per group by default; a layer whose input size 128 does not divide takes the
largest of 64 and 32 that does (SmolLM2's hidden size 576 = 9 x 64), so planning counts 128.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.runtime.weight_formats.base import FormatConfig, WeightFormat, int4_bytes

DEFAULT_GROUP_SIZE = 128
FALLBACK_GROUP_SIZES = (64, 32)


def group_size_for(input_size: int, preferred: int = DEFAULT_GROUP_SIZE) -> int | None:
    """The largest group size, starting at `preferred`, that divides `input_size` (None: none does)."""
    for g in (preferred, *(g for g in FALLBACK_GROUP_SIZES if g < preferred)):
        if input_size % g == 0:
            return g
    return None


class Int4Format(FormatConfig):
    name = "int4"
    at_load = True

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE):
        self.group_size = group_size

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any] | None = None) -> Int4Format:
        return cls()

    def weight_format(self, dtype_size: int, row_length: int) -> WeightFormat:
        per_weight = int4_bytes(self.group_size, dtype_size, row_length)
        return WeightFormat(self.name, per_weight, per_weight)

    def quantizes_vocab(self) -> bool:
        return True

    def describe(self) -> dict:
        return {"quantization": "int4", "bits": 4, "group_size": self.group_size}
