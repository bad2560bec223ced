"""The two integer weight forms every integer format ends in, and the kernels that multiply them.

All integer formats are converted at load time into one of two canonical forms:

- **int4 affine, group-wise**: 4-bit values ``q`` in 0..15 with a float ``scale`` and ``offset`` per
  (output row, group of ``group_size`` input features): ``w = q * scale + offset``. AWQ and GPTQ
  (``(q - zero) * scale``), compressed-tensors W4A16, int4 load-time quantization and GGUF's
  Q4_0 (``(q - 8) * d``), Q4_1 (``q * d + m``) and Q4_K (per-32 scales and mins) all are this.
- **int8 symmetric**: ``w = q * scale`` with int8 ``q`` and one scale per (row, group); per-output
  channel when the group is the whole input (int8 load-time quantization, compressed-tensors
  W8A16), group 32 for GGUF's Q8_0.

Kernels, by device (`Int4Weight.matmul` / `Int8Weight.matmul` pick):

- CPU with kvserve's native kernels loaded (x86-64 with AVX2 + FMA and gcc; see
  `kvserve.kernels.cpu.native.status()`): the weight is repacked once at load into panels of 16
  output rows interleaved along the input (`native.Int8Panels`: 16 bytes per input step;
  `native.Int4Panels`: 8 bytes, two rows per byte), with float32 scales (and offsets) per
  (panel, group). Activations are float32 (other dtypes are cast to float32 and back) and so is
  the accumulation: inside a group x * q is summed in registers, then the group is folded in with
  ``scale * dot (+ offset * sum of x over the group)``. Batch 1 streams the weight bytes at memory
  speed; larger batches dequantize each panel once into float32 and reuse it for every row. Any
  group size (int4: even), any row count, per-channel or grouped.
- CPU otherwise (``KVSERVE_CPU_KERNELS=0``, no AVX2, no compiler, or ``set_cpu_native(False)``):
  torch's packed weight-only kernels (``aten._weight_int4pack_mm_for_cpu`` for int4 with groups
  of 32/64/128/256 and rows a multiple of 16; ``aten._weight_int8pack_mm`` for per-channel int8).
  They are fast only with bfloat16 inputs, so activations enter them in bfloat16 (fp32
  accumulation) and the result is cast back to the compute dtype. Anything else (grouped int8,
  small groups, odd row counts) dequantizes then multiplies.
- CUDA: the Triton dequant-GEMM kernels of `kvserve.kernels.quant` (split-K for small batches)
  up to 64 activation rows; above, the weight is dequantized to the compute dtype and multiplied
  by cuBLAS (the platform chooses: runtime/executor/platform.py's ``int_matmul_kernel``).
- Everywhere, the pure-torch twins of those kernels (`kvserve.kernels.reference`) are the oracle,
  and ``set_cpu_packed(False)`` / ``KVSERVE_QUANT_CPU_PACKED=0`` makes the CPU use them (exact
  dequantize-then-matmul in the compute dtype) instead of the native or packed kernels.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from kvserve.kernels import quant_reference as ref
from kvserve.runtime.executor.platform import platform_for

log = logging.getLogger(__name__)

CPU_INT4_GROUPS = (32, 64, 128, 256)
_ENV = "KVSERVE_QUANT_CPU_PACKED"
_cpu_packed_override: bool | None = None


def set_cpu_packed(enabled: bool | None) -> None:
    """True/False forces torch's packed CPU kernels on/off; None goes back to the environment."""
    global _cpu_packed_override
    _cpu_packed_override = enabled


def cpu_packed_enabled() -> bool:
    if _cpu_packed_override is not None:
        return _cpu_packed_override
    return os.environ.get(_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


_native_override: bool | None = None


def set_cpu_native(enabled: bool | None) -> None:
    """False makes new CPU weights skip the native kernels (torch's packed kernels or the twins
    then, as `set_cpu_packed` says); None goes back to the default (native when loaded)."""
    global _native_override
    _native_override = enabled


def native_enabled(device: torch.device) -> bool:
    """Whether weights on `device` go to kvserve's native AVX2 integer kernels: the CPU, the
    library loaded (see `kvserve.kernels.cpu.native.status()`; ``KVSERVE_CPU_KERNELS=0`` turns it
    off) and the packed CPU path not switched off."""
    if not cpu_packed_enabled() or _native_override is False:
        return False
    return platform_for(device).native_int_weights()


def _native_matmul(panels, x: torch.Tensor) -> torch.Tensor:
    out = panels.matmul(x if x.dtype == torch.float32 else x.float())
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _cpu_int4_group(group_size: int, k: int) -> int | None:
    """A group size torch's CPU int4 kernel takes that represents `group_size` exactly (a group
    larger than 256 is the same scale repeated over several kernel groups), or None."""
    if group_size in CPU_INT4_GROUPS:
        return group_size
    for g in reversed(CPU_INT4_GROUPS):
        if group_size % g == 0 and k % g == 0:
            return g
    return None


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """The Triton dequant-GEMM where the platform picks it (CUDA, decode-sized batches), else
    dequantize-then-matmul (cuBLAS for a GPU's prefill; the torch twin elsewhere)."""
    if platform_for(x.device).int_matmul_kernel(x, group_size) == "triton":
        from kvserve.kernels import quant

        return quant.int4_matmul(x, packed, scale, offset, group_size)
    return ref.int4_matmul_ref(x, packed, scale, offset, group_size)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    if platform_for(x.device).int_matmul_kernel(x, group_size) == "triton":
        from kvserve.kernels import quant

        return quant.int8_matmul(x, q, scale, group_size)
    return ref.int8_matmul_ref(x, q, scale, group_size)


# ------------------------------------------------------------------------------------------- int4


def pack_int4_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] uint8, even k in the low nibble (the Triton/twin layout)."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4_nibbles(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


@functools.lru_cache(maxsize=1)
def _torch_int4_block() -> int:
    """Rows per block of torch's CPU int4 packing: 64 where torch runs its AVX-512 kernels, 32 with
    AVX2. Found by packing a probe rather than from the CPU flags, because torch's choice also
    depends on its build and on ATEN_CPU_CAPABILITY."""
    q = (torch.arange(64 * 64, dtype=torch.int32).view(64, 64) * 7 + 3) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    for block in (64, 32):
        if torch.equal(_unpack_rows(packed, torch.arange(64), 64, 64, block), q):
            return block
    return 32  # unknown: Int4Weight's load-time check then keeps the dequantizing path


def _cpu_pack_rows(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Rows `ids` (values 0..15, [len(ids), K]) read back out of torch's CPU int4 packing."""
    return _unpack_rows(packed, ids, n, k, _torch_int4_block())


def _unpack_rows(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """torch packs blocks of `block` rows as byte k*(block/2) + row%(block/2) (nibble row%block //
    (block/2)), and the last n%block rows, t of them, as byte k*(t/2) + row//2 (nibble row%2).
    `Int4Weight` checks this against the source values when it packs, so a torch release that
    packs differently is caught at load."""
    flat = packed.reshape(-1)
    half = block // 2
    full = (n // block) * block
    tail_rows = n - full
    ids = ids.long()
    kk = torch.arange(k, device=packed.device)
    in_full = ids < full
    blocks = torch.where(in_full, ids // block, 0)
    byte_full = blocks[:, None] * (block * k // 2) + kk[None, :] * half + (ids % half)[:, None]
    shift_full = ((ids % block) // half * 4)[:, None]
    tail = (ids - full).clamp(min=0)
    byte_tail = full * k // 2 + kk[None, :] * (tail_rows // 2) + (tail // 2)[:, None]
    shift_tail = (tail % 2 * 4)[:, None]
    byte = torch.where(in_full[:, None], byte_full, byte_tail)
    shift = torch.where(in_full[:, None], shift_full, shift_tail)
    return (flat[byte].to(torch.int32) >> shift) & 0xF


class Int4Weight:
    """An int4 affine group-wise weight [N, K] ready for the device's kernel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int,
                 dtype: torch.dtype, *, what: str = "layer"):
        n, k = q.shape
        if k % group_size or scale.shape != (n, k // group_size) or offset.shape != scale.shape:
            raise ValueError(f"{what}: int4 weight [{n}, {k}] with group {group_size} needs scale/offset of "
                             f"shape ({n}, {k // group_size}), got {tuple(scale.shape)}/{tuple(offset.shape)}")
        self.n, self.k, self.group_size, self.dtype = n, k, group_size, dtype
        self.device = q.device
        self.native = None
        if group_size % 2 == 0 and native_enabled(q.device):
            from kvserve.kernels.cpu import native

            self.native = native.Int4Panels(q, scale, offset, group_size)
        torch_packed = platform_for(q.device).torch_packed_int_weights()
        self.cpu_group = _cpu_int4_group(group_size, k) if torch_packed and self.native is None else None
        self.cpu_packed = None
        if self.cpu_group is not None and n % 16 == 0 and cpu_packed_enabled():
            rep = group_size // self.cpu_group
            s = scale.float().repeat_interleave(rep, dim=1)
            o = offset.float().repeat_interleave(rep, dim=1)
            # torch's kernel computes (q - 8) * s + z: z = offset + 8 * scale.
            sz = torch.stack([s.t(), (o + 8 * s).t()], dim=-1).to(torch.bfloat16).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            probe = torch.unique(torch.tensor([0, n - 1, n // 2, min(n - 1, 17), max(0, n - 9)]))
            if torch.equal(_cpu_pack_rows(packed, probe, n, k), q[probe].to(torch.int32)):
                self.cpu_packed, self.cpu_scales_zeros = packed, sz
            else:
                log.warning("%s: torch's CPU int4 packing is not the layout this version expects; "
                            "using dequantize-then-matmul", what)
        if self.native is None and self.cpu_packed is None:
            self.packed = pack_int4_nibbles(q)
            self.scale, self.offset = scale.to(dtype).contiguous(), offset.to(dtype).contiguous()

    def tensors(self) -> dict[str, torch.Tensor]:
        """What the layer keeps (registered as its parameters, so memory is counted)."""
        if self.native is not None:
            return self.native.tensors()
        if self.cpu_packed is not None:
            return {"int4_cpu_packed": self.cpu_packed, "int4_scales_zeros": self.cpu_scales_zeros}
        return {"int4_packed": self.packed, "int4_scale": self.scale, "int4_offset": self.offset}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return _native_matmul(self.native, x)
        if self.cpu_packed is not None and x.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.cpu_packed, self.cpu_group, self.cpu_scales_zeros)
            return out.to(x.dtype)
        return int4_matmul(x, self.packed, self.scale, self.offset, self.group_size)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` ([T, K] in the compute dtype): embedding lookups."""
        t = len(ids)
        if self.native is not None:
            return self.native.rows(ids).to(self.dtype)
        if self.cpu_packed is not None:  # the kernel's own numbers: (q - 8) * s + z, bf16 s and z
            g = self.cpu_group
            q = _cpu_pack_rows(self.cpu_packed, ids, self.n, self.k).view(t, self.k // g, g)
            sz = self.cpu_scales_zeros[:, ids].transpose(0, 1).float()  # [T, K/g, 2]
            w = (q - 8).float() * sz[..., 0:1] + sz[..., 1:2]
            return w.view(t, self.k).to(self.dtype)
        g = self.group_size
        q = unpack_int4_nibbles(self.packed[ids]).view(t, self.k // g, g)
        w = q.to(self.dtype) * self.scale[ids][..., None] + self.offset[ids][..., None]
        return w.view(t, self.k)


# ------------------------------------------------------------------------------------------- int8


class Int8Weight:
    """An int8 symmetric weight [N, K] with one scale per (row, group); group == K is per-channel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype, *,
                 what: str = "layer"):
        n, k = q.shape
        if k % group_size or scale.shape != (n, k // group_size):
            raise ValueError(f"{what}: int8 weight [{n}, {k}] with group {group_size} needs a scale of "
                             f"shape ({n}, {k // group_size}), got {tuple(scale.shape)}")
        self.n, self.k, self.group_size, self.dtype = n, k, group_size, dtype
        self.per_channel = group_size == k
        self.native = None
        if native_enabled(q.device):
            from kvserve.kernels.cpu import native

            self.native = native.Int8Panels(q, scale, group_size)
            self.use_cpu_packed, self.scale_bf16 = False, None
            return
        self.q = q.to(torch.int8).contiguous()
        self.scale = scale.to(dtype).contiguous()
        self.use_cpu_packed = (self.per_channel and platform_for(q.device).torch_packed_int_weights()
                               and cpu_packed_enabled())
        self.scale_bf16 = self.scale[:, 0].to(torch.bfloat16).contiguous() if self.use_cpu_packed else None

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.native is not None:
            return self.native.tensors()
        out = {"int8_weight": self.q, "int8_scale": self.scale}
        if self.scale_bf16 is not None:
            out["int8_scale_bf16"] = self.scale_bf16
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return _native_matmul(self.native, x)
        if self.use_cpu_packed and x.device.type == "cpu":
            return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale_bf16).to(x.dtype)
        return int8_matmul(x, self.q, self.scale, self.group_size)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.rows(ids).to(self.dtype)
        g = self.group_size
        q = self.q[ids].view(len(ids), self.k // g, g).to(self.dtype)
        return (q * self.scale[ids][..., None]).view(len(ids), self.k)


# ------------------------------------------------------------------------------- load-time quantizers


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 of a float [N, K] weight: (q 0..15 uint8, scale, offset) per group."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    lo = g.amin(-1).clamp(max=0)
    hi = g.amax(-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.view(n, k).to(torch.uint8), scale, -zero * scale


def quantize_int8(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 of a float [N, K] weight: (q int8 in -127..127, scale) per group."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    scale = g.abs().amax(-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g / scale[..., None]).clamp(-127, 127)
    return q.view(n, k).to(torch.int8), scale
