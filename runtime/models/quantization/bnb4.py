"""A bitsandbytes 4-bit weight (NF4 or FP4) kept packed: two codes per byte plus one float32
absmax per block of codes, dequantized per matmul.

The codes index a 16-value codebook, not an affine grid, so the int4 kernels (scale and offset
per group) cannot take them. The held form is this rank's rows and columns of the checkpoint's
codes, [N, K / 2] bytes (the first code of a pair in the high nibble, as bitsandbytes packs
them), with absmax [N, K / block] (double quantization resolved once at load, exactly as
`dequantize_4bit` does) and the codebook: 0.5 + 4 / block bytes per weight instead of the
compute dtype's size.

A matmul dequantizes a slab of output rows at a time (`_ROWS_PER_SLAB` rows: a few hundred KiB
of float32, reused for every slab) and multiplies by it, so neither the layer nor the model is
ever held in float32. Every dequantized value is codebook[code] * absmax in float32, the same
product `dequantize_4bit` (and bitsandbytes' own dequantizer) computes, so the weights the
matmul sees are bit for bit the checkpoint's.

On a CPU with kvserve's native kernels (`packed.native_enabled`) the codes are repacked once at
load into the int4 panel layout (`kvserve.kernels.cpu.native.CodebookPanels`, the same bytes per
weight) and the matmul is the native kernel: a decode step (one row) looks each code up in a
16-entry in-register codebook and multiplies by x without writing any float weight, a longer
batch dequantizes one 16-row panel at a time into the float kernel's layout (the same product,
codebook value x absmax). The slab path above is the torch twin and the path everywhere else.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kvserve.runtime.models.quantization.packed import _native_matmul, native_enabled

# Output rows dequantized per slab: 256 rows of a 4096-wide layer are 4 MiB of float32.
_ROWS_PER_SLAB = 256


def _triton_kernel(x: torch.Tensor, block: int, k: int) -> bool:
    """Whether kernels/nf4.py's dequant-GEMM multiplies `x`: where the platform picks Triton's
    dequant-GEMM for int4 weights (decode-sized batches on CUDA, or the interpreter when forced);
    a large batch dequantizes a slab at a time for cuBLAS instead."""
    from kvserve.kernels import nf4
    from kvserve.runtime.executor.platform import platform_for

    return nf4.supports(block, k) and platform_for(x.device).int_matmul_kernel(x, block) == "triton"


class Packed4bitWeight:
    """codes uint8 [N, K / 2], absmax float32 [N, K / block], quant_map float32 [16]."""

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor, block: int,
                 dtype: torch.dtype, *, what: str = "layer"):
        n, half = codes.shape
        k = 2 * half
        if codes.dtype != torch.uint8 or k % block or absmax.shape != (n, k // block) or quant_map.numel() != 16:
            raise ValueError(f"{what}: a packed 4-bit weight [{n}, {k}] in blocks of {block} needs uint8 codes "
                             f"[{n}, {half}], absmax ({n}, {k // block}) and 16 codebook values; got "
                             f"{codes.dtype} codes, absmax {tuple(absmax.shape)}, {quant_map.numel()} values")
        self.n, self.k, self.block, self.dtype = n, k, block, dtype
        self.quant_map = quant_map.to(torch.float32).reshape(16).contiguous()
        self.native = None
        if block % 2 == 0 and native_enabled(codes.device):
            from kvserve.kernels.cpu import native

            self.native = native.CodebookPanels(codes, absmax, self.quant_map, block)
            return  # the panels replace the codes: nothing else is held
        self.codes = codes.contiguous()
        self.absmax = absmax.to(torch.float32).contiguous()
        # byte -> its two values (high nibble first): one gather per byte instead of shifts, masks
        # and a gather per code; the values are the codebook's, so the products are unchanged.
        byte = torch.arange(256, device=codes.device)
        self._pairs = torch.stack((self.quant_map[byte >> 4], self.quant_map[byte & 0xF]), dim=1).contiguous()

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.native is not None:
            return self.native.tensors()
        return {"bnb4_codes": self.codes, "bnb4_absmax": self.absmax, "bnb4_quant_map": self.quant_map}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """float32 rows [start, end) of the weight."""
        end = self.n if end is None else end
        if self.native is not None:
            return self.native.rows(torch.arange(start, end))
        packed = self.codes[start:end].reshape(-1).to(torch.int32)
        values = self._pairs.index_select(0, packed).view(end - start, self.k // self.block, self.block)
        return (values * self.absmax[start:end, :, None]).view(end - start, self.k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W.T in x's dtype, one slab of dequantized rows at a time."""
        if self.native is not None:
            return _native_matmul(self.native, x)
        if _triton_kernel(x, self.block, self.k):
            from kvserve.kernels import nf4

            return nf4.nf4_matmul(x, self.codes, self.absmax, self.quant_map, self.block)
        shape = x.shape
        rows = x.reshape(-1, self.k)
        out = torch.empty(rows.shape[0], self.n, dtype=x.dtype, device=x.device)
        for start in range(0, self.n, _ROWS_PER_SLAB):
            end = min(self.n, start + _ROWS_PER_SLAB)
            w = self.dequantize(start, end)
            out[:, start:end] = F.linear(rows, w if x.dtype == torch.float32 else w.to(x.dtype))
        return out.view(*shape[:-1], self.n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.rows(ids).to(self.dtype)
        return torch.cat([self.dequantize(int(i), int(i) + 1) for i in ids.reshape(-1)]).to(self.dtype)
