"""``awq``: AutoAWQ's GEMM checkpoints, 4-bit group-wise with zero points; vocabulary unquantized."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.runtime.weight_formats.base import FormatConfig, WeightFormat, int4_bytes


class AWQFormat(FormatConfig):
    name = "awq"
    in_checkpoints = True

    def __init__(self, group_size: int, modules_to_not_convert: tuple[str, ...] = ()):
        self.group_size = group_size
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, qc: Mapping[str, Any] | None):
        qc = dict(qc or {})
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"quantization_config.bits: awq supports 4, got {bits}")
        if not qc.get("zero_point", True):
            raise ValueError("quantization_config.zero_point: awq without zero points is not supported")
        if version != "gemm":
            raise ValueError(f"quantization_config.version: awq supports the 'gemm' layout, got {version!r}")
        if group < 32 or group % 16:
            raise ValueError(f"quantization_config.group_size: awq needs a group size that is a multiple of 16 "
                             f"and >= 32, got {group}")
        return cls(group, tuple(qc.get("modules_to_not_convert") or ()))

    def weight_format(self, dtype_size: int, row_length: int) -> WeightFormat:
        return WeightFormat(self.name, int4_bytes(self.group_size, dtype_size, row_length), dtype_size)

    def describe(self) -> dict:
        return {"quantization": "awq", "bits": 4, "group_size": self.group_size}
