"""``gptq``: AutoGPTQ / GPTQModel checkpoints, 4-bit any symmetry or symmetric 8-bit; LM head unquantized."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.runtime.weight_formats.base import FormatConfig, WeightFormat, int4_bytes, int8_bytes


class GPTQFormat(FormatConfig):
    name = "gptq"
    in_checkpoints = True

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, v2: bool):
        self.bits, self.group_size, self.desc_act, self.sym, self.v2 = bits, group_size, desc_act, sym, v2

    @classmethod
    def from_config(cls, qc: Mapping[str, Any] | None):
        qc = dict(qc or {})
        bits = int(qc.get("bits", 4))
        group = int(qc.get("group_size", 128))
        sym = bool(qc.get("sym", True))
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if bits not in (4, 8):
            raise ValueError(f"quantization_config.bits: gptq supports 4 and 8, got {bits}")
        if bits == 8 and not sym:
            raise ValueError("quantization_config.sym: 8-bit gptq must be symmetric")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format: gptq supports 'gptq' and 'gptq_v2', got {fmt!r}")
        if group != -1 and (group < 16 or group % 16):
            raise ValueError(f"quantization_config.group_size: gptq needs -1 or a multiple of 16, got {group}")
        if qc.get("lm_head"):
            raise ValueError("quantization_config.lm_head: a gptq-quantized LM head is not supported")
        return cls(bits, group, bool(qc.get("desc_act", False)), sym, fmt == "gptq_v2")

    def weight_format(self, dtype_size: int, row_length: int) -> WeightFormat:
        sized = int4_bytes if self.bits == 4 else int8_bytes
        return WeightFormat(self.name, sized(self.group_size, dtype_size, row_length), dtype_size)

    def describe(self) -> dict:
        return {"quantization": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act}
