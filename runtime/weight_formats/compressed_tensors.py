"""``compressed-tensors``: llm-compressor's checkpoints (pack-quantized W4A16/W8A16, FP8 W8A8).

config.json's quantization_config lists ``config_groups``, each with ``targets`` (``Linear``,
module names, or ``re:`` regexes), weight arguments and optional input-activation arguments, plus
an ``ignore`` list. Each group is parsed into a `SchemeGroup`; the runtime picks one per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.runtime.weight_formats.base import FormatConfig, WeightFormat, fp8_bytes, int4_bytes, int8_bytes


@dataclass(frozen=True)
class SchemeGroup:
    """One config group: "int" (pack-quantized, `bits`, `group_size` None for per-channel) or
    "fp8" (`per_channel` scales, `static_input` activation scale, `w8a8` activations in FP8)."""

    kind: str
    targets: tuple[str, ...]
    scheme: str
    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    actorder: bool = False
    per_channel: bool = False
    static_input: bool = False
    w8a8: bool = False


class CompressedTensorsFormat(FormatConfig):
    name = "compressed-tensors"
    in_checkpoints = True

    def __init__(self, groups: list[SchemeGroup], ignore: list[str], fmt: str):
        self.groups, self.ignore, self.format = groups, ignore, fmt

    @classmethod
    def from_config(cls, qc: Mapping[str, Any] | None):
        qc = dict(qc or {})
        if qc.get("sparsity_config"):
            raise ValueError("quantization_config.sparsity_config: sparse compressed-tensors checkpoints are not supported")
        groups = [parse_group(f"quantization_config.config_groups.{name}", group, group.get("format") or qc.get("format"))
                  for name, group in (qc.get("config_groups") or {}).items()]
        if not groups:
            raise ValueError("quantization_config.config_groups: a compressed-tensors checkpoint needs at least one group")
        if qc.get("kv_cache_scheme"):
            raise ValueError("quantization_config.kv_cache_scheme: KV cache quantization from the checkpoint is not "
                             "supported; use kv_cache_dtype")
        return cls(groups, list(qc.get("ignore") or []), str(qc.get("format", "")))

    @classmethod
    def for_planning(cls, qc: Mapping[str, Any] | None):
        if not qc:  # only the name is known: plan the common W4A16 with groups of 128
            return cls([SchemeGroup("int", ("Linear",), "W4A16", bits=4, group_size=128)], [], "pack-quantized")
        return cls.from_config(qc)

    def weight_format(self, dtype_size: int, row_length: int) -> WeightFormat:
        group = self.groups[0]  # checkpoints hold one scheme for their linear layers
        if group.kind == "fp8":
            linear = fp8_bytes(row_length)
        elif group.bits == 4:
            linear = int4_bytes(group.group_size or 0, dtype_size, row_length)
        else:
            linear = int8_bytes(group.group_size, dtype_size, row_length)
        return WeightFormat(self.name, linear, dtype_size)

    def describe(self) -> dict:
        return {"quantization": "compressed-tensors", "schemes": [g.scheme for g in self.groups]}


def parse_group(where: str, group: Mapping[str, Any], fmt: str | None) -> SchemeGroup:
    w = group.get("weights") or {}
    a = group.get("input_activations")
    targets = tuple(group.get("targets") or ())
    bits, kind = int(w.get("num_bits", 0)), str(w.get("type", "int"))
    strategy = str(w.get("strategy", "")).lower()
    if kind == "float" and bits == 8:
        if strategy not in ("channel", "tensor"):
            raise ValueError(f"{where}.weights.strategy: FP8 supports 'channel' and 'tensor', got {strategy!r}")
        static = False
        if a:
            if str(a.get("type")) != "float" or int(a.get("num_bits", 0)) != 8:
                raise ValueError(f"{where}.input_activations: only FP8 activations go with FP8 weights")
            static = not a.get("dynamic", False)
            if static and str(a.get("strategy", "tensor")) != "tensor":
                raise ValueError(f"{where}.input_activations.strategy: static activation scales must be per tensor")
        return SchemeGroup("fp8", targets, "W8A8-FP8" if a else "W8A16-FP8", per_channel=strategy == "channel",
                           static_input=static, w8a8=a is not None)
    if kind != "int" or bits not in (4, 8):
        raise ValueError(f"{where}.weights: supported schemes are int4/int8 weights (pack-quantized) and FP8; got "
                         f"{bits}-bit {kind}")
    if a:
        raise ValueError(f"{where}.input_activations: integer activation quantization (W8A8 int8) is not supported")
    if fmt not in ("pack-quantized", None):
        raise ValueError(f"{where}.format: integer weights are supported as 'pack-quantized', got {fmt!r}")
    if strategy not in ("group", "channel"):
        raise ValueError(f"{where}.weights.strategy: supported 'group' and 'channel', got {strategy!r}")
    symmetric = bool(w.get("symmetric", True))
    if bits == 8 and not symmetric:
        raise ValueError(f"{where}.weights.symmetric: 8-bit weights must be symmetric")
    group_size = int(w["group_size"]) if strategy == "group" else None
    actorder = w.get("actorder") not in (None, False, "static")
    return SchemeGroup("int", targets, f"W{bits}A16", bits=bits, group_size=group_size, symmetric=symmetric,
                       actorder=actorder)
