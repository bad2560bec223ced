"""``fp8``: float8_e4m3fn weights with per-tensor or per-output-channel scales.

Two sources: an FP8 checkpoint (``quant_method: fp8``, as AutoFP8 and vLLM write them: ``weight``
in float8_e4m3fn, a per-tensor ``weight_scale``, and with ``activation_scheme: static`` an
``input_scale``), or a full-precision checkpoint quantized at load (per-output-channel absmax).

Activations: W8A8 (activations quantized to FP8 per token, or with the checkpoint's static input
scale; FP8 x FP8 products with float32 accumulation) runs where FP8 matmuls exist, CUDA devices
of compute capability 8.9 and newer: through ``torch._scaled_mm`` with rowwise scales (cuBLASLt)
where the platform says it takes the GEMM (Hopper, bfloat16 output, dimensions multiples of
16), else `kvserve.kernels.quant.fp8_scaled_matmul` (Triton). Load-time
FP8 elsewhere is weight-only: the weight is dequantized into the compute dtype for each matmul
(memory is what it saves). A checkpoint that was quantized W8A8 keeps its activation quantization
on CPU through the kernel's torch twin (exact numerics, slow: for testing), and is refused on a
GPU without FP8.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import quant_reference as ref
from kvserve.kernels.triton_utils import triton_available
from kvserve.runtime.executor.platform import platform_for
from kvserve.runtime.models.quantization.base import (
    LinearMethod,
    LinearSpec,
    QuantizationConfig,
    replace_param,
    sharded_param,
)
from kvserve.runtime.models.quantization.unquantized import UNQUANTIZED, UnquantizedLinearMethod
from kvserve.runtime.weight_formats.fp8 import Fp8Format

FP8 = torch.float8_e4m3fn


def device_has_fp8(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor | None,
               kernel: str | None = None) -> torch.Tensor:
    """W8A8: x quantized per token (or with a static per-tensor scale) times the FP8 weight.
    `kernel` (tests): "scaled_mm", "triton" or "twin" instead of the platform's choice."""
    kernel = kernel or platform_for(x.device).fp8_matmul_kernel(x, w)
    if kernel == "triton" or (kernel == "scaled_mm" and x.is_cuda and triton_available()):
        from kvserve.kernels import quant

        xq, xs = quant.quantize_fp8(x, input_scale)  # one kernel, the twin's bytes
    elif input_scale is None:
        xq, xs = ref.quantize_fp8_per_token(x)
    else:
        xq, xs = ref.quantize_fp8_static(x, input_scale), input_scale.float().reshape(1)
    if kernel == "scaled_mm":
        return scaled_mm_rowwise(xq, xs, w, w_scale, x.dtype)
    if kernel == "triton":
        from kvserve.kernels import quant

        return quant.fp8_scaled_matmul(xq, xs, w, w_scale, x.dtype)
    return ref.fp8_scaled_matmul_ref(xq, xs, w, w_scale, x.dtype)


def scaled_mm_rowwise(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with one float32 scale per activation row ([M, 1]; a static per-tensor
    scale repeated) and one per weight row ([1, N]). The weight [N, K] transposed is the
    column-major second operand the FP8 GEMM wants, without a copy."""
    m = xq.shape[0]
    scale_a = xs.float().reshape(-1, 1).expand(m, 1).contiguous()
    scale_b = w_scale.float().reshape(1, -1)
    return torch._scaled_mm(xq, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1) / ref.FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale[:, None]).clamp(-ref.FP8_MAX, ref.FP8_MAX).to(FP8), scale


class Fp8LinearMethod(LinearMethod):
    """FP8 weights with a per-channel float32 scale once loaded.

    `from_checkpoint`: the checkpoint holds ``weight`` (FP8) and ``weight_scale`` (per tensor:
    one per fused part, or per channel); `static_input`: it holds ``input_scale`` too.
    `w8a8`: quantize activations (else weight-only)."""

    name = "fp8"

    def __init__(self, *, from_checkpoint: bool, per_channel: bool, static_input: bool, w8a8: bool):
        self.from_checkpoint, self.per_channel = from_checkpoint, per_channel
        self.static_input, self.w8a8 = static_input, w8a8

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        if not self.from_checkpoint:
            UnquantizedLinearMethod().create_weights(layer, spec)
            return
        n, k = spec.out_features, spec.in_features
        sharded_param(layer, "weight", spec, (n, k), FP8, out_dim=0, in_dim=1, fill=None)
        if self.per_channel:
            sharded_param(layer, "weight_scale", spec, (n, 1), torch.float32, out_dim=0, fill=1.0)
        else:
            sharded_param(layer, "weight_scale", spec, (len(spec.output_slices),), torch.float32, per_part=True,
                          fill=1.0)
        if self.static_input:
            sharded_param(layer, "input_scale", spec, (len(spec.output_slices),), torch.float32, per_part=True,
                          fill=0.0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        spec: LinearSpec = layer.spec
        if not self.from_checkpoint:
            w, scale = quantize_fp8_per_channel(layer.weight.data)
        else:
            w = layer.weight.data
            if self.per_channel:
                scale = layer.weight_scale.data.reshape(-1).float()
            else:  # one scale per fused part -> one per output row
                sizes = [size for _, size in spec.output_slices]
                scale = torch.repeat_interleave(layer.weight_scale.data.float(),
                                                torch.tensor(sizes, device=w.device))
                if spec.output_padding:
                    scale = torch.cat([scale, scale.new_ones(spec.output_padding)])
        input_scale = None
        if self.static_input:
            # One activation scale for the fused matmul: the largest of its parts' (as vLLM does).
            input_scale = layer.input_scale.data.max().reshape(1)
            replace_param(layer, "input_scale", None)
        replace_param(layer, "weight", None)
        replace_param(layer, "weight_scale", None)
        replace_param(layer, "fp8_weight", w.contiguous())
        replace_param(layer, "fp8_scale", scale.contiguous())
        if input_scale is not None:
            replace_param(layer, "fp8_input_scale", input_scale)
        layer.fp8_input_scale_ = input_scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.w8a8:
            out = fp8_matmul(x, layer.fp8_weight, layer.fp8_scale, layer.fp8_input_scale_)
        else:
            w = layer.fp8_weight.to(x.dtype) * layer.fp8_scale.to(x.dtype)[:, None]
            out = x @ w.t()
        return out + bias if bias is not None else out


class Fp8Config(Fp8Format, QuantizationConfig):
    def check_supported(self, device: torch.device, dtype: torch.dtype) -> None:
        if self.from_checkpoint:
            if device.type == "cuda" and not device_has_fp8(device):
                cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
                raise ValueError(f"quantization: this FP8 checkpoint quantizes activations (W8A8), which needs a GPU "
                                 f"with FP8 matmuls (compute capability >= 8.9); {device} is {cap}. Use a newer GPU, "
                                 "or device='cpu' (exact, slow)")
        else:
            self.w8a8 = device_has_fp8(device)

    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        if spec.role == "lm_head" or any(i in p for p in spec.prefixes for i in self.ignored):
            return UNQUANTIZED
        return Fp8LinearMethod(from_checkpoint=self.from_checkpoint, per_channel=False,
                               static_input=self.static_input, w8a8=self.w8a8)
