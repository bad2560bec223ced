"""``fp8``: an FP8 checkpoint (AutoFP8 / vLLM layout) or FP8 quantization at load; LM head unquantized."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.runtime.weight_formats.base import FormatConfig, WeightFormat, fp8_bytes


class Fp8Format(FormatConfig):
    name = "fp8"
    in_checkpoints = True
    at_load = True

    def __init__(self, *, from_checkpoint: bool, static_input: bool = False, ignored: tuple[str, ...] = ()):
        self.from_checkpoint, self.static_input, self.ignored = from_checkpoint, static_input, ignored
        # A checkpoint quantized W8A8 keeps its activation quantization; load-time FP8 decides
        # per device (the runtime's check_supported).
        self.w8a8 = from_checkpoint

    @classmethod
    def from_config(cls, qc: Mapping[str, Any] | None):
        if qc is None:
            return cls(from_checkpoint=False)
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization_config.activation_scheme: fp8 supports 'dynamic' and 'static', got {scheme!r}")
        if qc.get("weight_block_size"):
            raise ValueError("quantization_config.weight_block_size: block-wise FP8 checkpoints are not supported; "
                             "per-tensor and per-channel scales are")
        return cls(from_checkpoint=True, static_input=scheme == "static",
                   ignored=tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()))

    def weight_format(self, dtype_size: int, row_length: int) -> WeightFormat:
        return WeightFormat(self.name, fp8_bytes(row_length), dtype_size)

    def describe(self) -> dict:
        return {"quantization": "fp8", "activations": "fp8" if self.w8a8 else "weight-only"}
