"""Which kernel multiplies quantized weights, asked of the Platform (runtime/executor/platform.py):
on a GPU, int4/int8 prefills of more than 64 rows dequantize and call cuBLAS, decode-sized
batches take the Triton dequant-GEMM, and W8A8 FP8 takes torch._scaled_mm with rowwise scales
where it applies. The choices are pure functions checked as tables; torch._scaled_mm itself runs
on the CPU too, so its call (scales, layouts) is checked against the float32 twin here."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import ops
from kvserve.runtime.executor.platform import (
    CPU,
    DEQUANT_GEMM_MIN_ROWS,
    fp8_matmul_choice,
    int_matmul_choice,
    scaled_mm_rowwise_ok,
)
from kvserve.runtime.models.quantization.fp8 import fp8_matmul, quantize_fp8_per_channel


@pytest.mark.parametrize("rows,triton,group_ok,dequant_min_rows,want", [
    (1, True, True, DEQUANT_GEMM_MIN_ROWS, "triton"),        # decode on a GPU
    (64, True, True, DEQUANT_GEMM_MIN_ROWS, "triton"),
    (65, True, True, DEQUANT_GEMM_MIN_ROWS, "dequant"),      # a prefill: cuBLAS on the dequantized weight
    (4096, True, False, DEQUANT_GEMM_MIN_ROWS, "dequant"),   # a group the kernel lacks does not matter there
    (8, True, False, DEQUANT_GEMM_MIN_ROWS, "twin"),
    (4096, True, True, None, "triton"),                      # the interpreter, forced (CPU platform)
    (4096, False, True, None, "twin"),                       # the CPU
])
def test_int_matmul_choice(rows, triton, group_ok, dequant_min_rows, want):
    assert int_matmul_choice(rows, triton=triton, group_ok=group_ok, dequant_min_rows=dequant_min_rows) == want


@pytest.mark.parametrize("dtype,n,k,cap,want", [
    (torch.bfloat16, 4096, 4096, (9, 0), True),   # H100 / H200
    (torch.bfloat16, 4096, 4096, (10, 0), True),
    (torch.bfloat16, 4096, 4096, (8, 9), False),  # Ada: the Triton kernel
    (torch.float16, 4096, 4096, (9, 0), False),   # rowwise scales want a bfloat16 output
    (torch.bfloat16, 4100, 4096, (9, 0), False),
    (torch.bfloat16, 4096, 4096, None, False),
])
def test_scaled_mm_where_rowwise_scales_apply(dtype, n, k, cap, want):
    assert scaled_mm_rowwise_ok(dtype, n, k, cap) is want
    assert fp8_matmul_choice(scaled_mm=want, triton=True) == ("scaled_mm" if want else "triton")
    assert fp8_matmul_choice(scaled_mm=False, triton=False) == "twin"


def test_the_cpu_platform_picks_twins_unless_triton_is_forced():
    x = torch.randn(300, 64)
    w = torch.randn(32, 64)
    assert CPU.int_matmul_kernel(x, 32) == "twin" and CPU.fp8_matmul_kernel(x, w) == "twin"
    pytest.importorskip("triton")
    with ops.kernel_mode("triton"):
        assert CPU.int_matmul_kernel(x, 32) == "triton"  # no cuBLAS detour off the GPU


@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_rowwise_matches_the_twin(static):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    w, w_scale = quantize_fp8_per_channel(torch.randn(48, 64, generator=g))
    input_scale = torch.tensor([0.02]) if static else None
    got = fp8_matmul(x, w, w_scale, input_scale, kernel="scaled_mm")
    want = fp8_matmul(x, w, w_scale, input_scale, kernel="twin")
    assert got.dtype == torch.bfloat16 and got.shape == (37, 48)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    # ...and both are FP8 products of the activations, not of something else.
    exact = x.float() @ (w.float() * w_scale[:, None]).t()
    assert (got.float() - exact).abs().max() < 0.1 * exact.abs().max()
