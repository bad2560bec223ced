"""``bitsandbytes``: checkpoints saved by transformers with a BitsAndBytesConfig (pre-quantized).

- 4-bit (``load_in_4bit``): NF4 or FP4 codes, one absmax per block of 64 (``bnb_4bit_quant_type``),
  the absmax values themselves 8-bit quantized in blocks of 256 with double quantization
  (``bnb_4bit_use_double_quant``). The codes index a 16-value codebook, not an affine grid, so
  no int4 kernel here takes them: the runtime holds them packed, two per byte, with one float32
  absmax per block (double quantization resolved at load), and dequantizes a slab of rows per
  matmul (exact: the codebook value times the block's absmax): 0.5 + 4 / 64 bytes per weight.
- 8-bit (``load_in_8bit``, LLM.int8 checkpoints): int8 codes with one absmax per output row
  (``SCB``), w = code * SCB / 127: the canonical per-channel int8 weight, kept quantized.
  (LLM.int8's outlier decomposition is a property of its matmul, not of the checkpoint; the
  runtime multiplies by the dequantized weight.)

The LM head, the embeddings and ``llm_int8_skip_modules`` stay in full precision, as
transformers leaves them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.runtime.weight_formats.base import FormatConfig, WeightFormat, int8_bytes

QUANT_TYPES = ("nf4", "fp4")
# bitsandbytes' 4-bit block size (transformers' BitsAndBytesConfig has no setting for it).
BLOCKSIZE = 64


class BitsAndBytesFormat(FormatConfig):
    name = "bitsandbytes"
    in_checkpoints = True

    def __init__(self, bits: int, quant_type: str = "nf4", double_quant: bool = False,
                 skip_modules: tuple[str, ...] = ()):
        self.bits, self.quant_type, self.double_quant = bits, quant_type, double_quant
        self.skip_modules = skip_modules

    @classmethod
    def from_config(cls, qc: Mapping[str, Any] | None):
        qc = dict(qc or {})
        four = bool(qc.get("load_in_4bit", qc.get("_load_in_4bit", False)))
        eight = bool(qc.get("load_in_8bit", qc.get("_load_in_8bit", False)))
        if four == eight:
            raise ValueError("quantization_config.load_in_4bit / load_in_8bit: a bitsandbytes checkpoint sets "
                             f"exactly one of them, got load_in_4bit={four}, load_in_8bit={eight}")
        skip = tuple(qc.get("llm_int8_skip_modules") or ())
        if eight:
            if qc.get("llm_int8_has_fp16_weight"):
                raise ValueError("quantization_config.llm_int8_has_fp16_weight: true keeps float16 weights for "
                                 "training; supported: false")
            return cls(8, skip_modules=skip)
        quant_type = str(qc.get("bnb_4bit_quant_type") or "fp4").lower()
        if quant_type not in QUANT_TYPES:
            raise ValueError(f"quantization_config.bnb_4bit_quant_type: {quant_type!r} is not supported; "
                             f"supported: {', '.join(QUANT_TYPES)}")
        storage = str(qc.get("bnb_4bit_quant_storage") or "uint8")
        if storage != "uint8":
            raise ValueError(f"quantization_config.bnb_4bit_quant_storage: {storage!r} is not supported; "
                             f"supported: 'uint8'")
        return cls(4, quant_type, bool(qc.get("bnb_4bit_use_double_quant", False)), skip)

    @classmethod
    def for_planning(cls, quantization_config: Mapping[str, Any] | None):
        if not quantization_config:  # the operator knows only the name: the common NF4 checkpoint
            return cls(4, "nf4", True)
        return cls.from_config(quantization_config)

    def weight_format(self, dtype_size: int, row_length: int) -> WeightFormat:
        if self.bits == 8:
            return WeightFormat(self.name, int8_bytes(None, dtype_size, row_length), dtype_size)
        # 4-bit: packed codes + a float32 absmax per block of BLOCKSIZE (see above)
        return WeightFormat(self.name, 0.5 + 4 / BLOCKSIZE, dtype_size)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quantization": self.name, "bits": self.bits}
        if self.bits == 4:
            out.update(quant_type=self.quant_type, double_quant=self.double_quant)
        return out
