"""``int8``: weight-only, per output channel, symmetric; quantized at load, vocabulary included."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.runtime.weight_formats.base import FormatConfig, WeightFormat, int8_bytes


class Int8Format(FormatConfig):
    name = "int8"
    at_load = True

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any] | None = None) -> Int8Format:
        return cls()

    def weight_format(self, dtype_size: int, row_length: int) -> WeightFormat:
        per_weight = int8_bytes(None, dtype_size, row_length)
        return WeightFormat(self.name, per_weight, per_weight)

    def quantizes_vocab(self) -> bool:
        return True

    def describe(self) -> dict:
        return {"quantization": "int8", "bits": 8, "group_size": "per-channel"}
