"""What every weight format's config class is, without torch: its parsing and its bytes per weight.

The operator plans tensor parallelism from the same classes that the runtime loads checkpoints
with (the runtime's linear methods subclass them in `kvserve.runtime.models.quantization`), so a
checkpoint's quantization_config is read by one parser and sized by one rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WeightFormat:
    """Bytes one weight takes in a format, as the runtime holds it (values, scales, zeros/offsets).

    `linear_bytes`: per parameter of a quantized matmul; `vocab_bytes`: per parameter of the
    embedding table and LM head (the compute dtype's size unless the format covers them)."""

    name: str
    linear_bytes: float
    vocab_bytes: float


def int4_bytes(group_size: int, dtype_size: int, row_length: int) -> float:
    """A 4-bit value plus a scale and an offset per group in the compute dtype; a group size of
    0 or less is one group per row (per-channel)."""
    return 0.5 + 2 * dtype_size / (group_size if group_size > 0 else row_length)


def int8_bytes(group_size: int | None, dtype_size: int, row_length: int) -> float:
    """An 8-bit value plus a scale per group (None or <= 0: per channel)."""
    return 1 + dtype_size / (group_size if group_size and group_size > 0 else row_length)


def fp8_bytes(row_length: int) -> float:
    """An FP8 value plus a float32 scale per row."""
    return 1 + 4 / row_length


class FormatConfig:
    """A format's checkpoint-wide settings: parsed from config.json's quantization_config (or
    none, for formats that quantize at load) and sized per parameter.

    Subclasses set ``name`` (vLLM's name, what `quantization=` takes), ``in_checkpoints`` (a
    checkpoint can already be in it) and ``at_load`` (it can quantize a full-precision
    checkpoint while loading), and implement ``from_config`` and ``weight_format``.
    """

    name = "none"
    in_checkpoints = False
    at_load = False

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any] | None) -> FormatConfig:
        """Parses and checks the format's settings; ValueError naming the field when unsupported."""
        raise NotImplementedError

    @classmethod
    def for_planning(cls, quantization_config: Mapping[str, Any] | None) -> FormatConfig:
        """The settings to size weights with when the checkpoint's own config may be absent (the
        operator planning a spec that only names the format): the format's common defaults."""
        return cls.from_config(quantization_config)

    def weight_format(self, dtype_size: int, row_length: int) -> WeightFormat:
        """Bytes per weight with compute dtype size `dtype_size`; `row_length` stands in for the
        input features of a row where scales are per channel (the hidden size)."""
        raise NotImplementedError

    def quantizes_vocab(self) -> bool:
        """Whether the embedding table and LM head are in this format (else they stay full precision)."""
        return False

    def describe(self) -> dict[str, Any]:
        """Settings worth logging and exporting (group size, bits, scheme)."""
        return {"quantization": self.name}
