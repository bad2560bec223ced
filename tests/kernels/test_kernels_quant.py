"""The quantized matmul kernels (int4/int8 dequant-GEMM with split-K, FP8 scaled matmul) against
their torch twins under Triton's interpreter, and the twins against float64 arithmetic."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import quant  # noqa: E402
from kvserve.kernels import quant_reference as ref


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _int4(n, k, g, seed, dtype):
    gen = _gen(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).to(dtype)
    offset = (torch.randn(n, k // g, generator=gen) * 0.05).to(dtype)
    return q, packed, scale, offset


TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("m, n, k, g, split", [(1, 80, 128, 32, 1), (3, 64, 256, 64, 4), (17, 48, 128, 128, 2),
                                               (5, 64, 192, 64, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_dequant_gemm_matches_twin(m, n, k, g, split, dtype, device):
    q, packed, scale, offset = (t.to(device) for t in _int4(n, k, g, m * n + k, dtype))
    x = torch.randn(m, k, generator=_gen(m)).to(dtype).to(device)
    want = ref.int4_matmul_ref(x, packed, scale, offset, g)
    got = quant.int4_matmul(x, packed, scale, offset, g, split_k=split)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * 10, rtol=TOL[dtype])


@pytest.mark.parametrize("m, n, k, g, split", [(2, 64, 128, 128, 1), (4, 32, 256, 32, 8)])
def test_int8_dequant_gemm_matches_twin(m, n, k, g, split, device):
    gen = _gen(k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(device)
    scale = (torch.rand(n, k // g, generator=gen) * 0.01).to(device)
    x = torch.randn(m, k, generator=gen).to(device)
    want = ref.int8_matmul_ref(x, q, scale, g)
    torch.testing.assert_close(quant.int8_matmul(x, q, scale, g, split_k=split), want, atol=1e-4, rtol=1e-4)


def test_twins_match_float64():
    q, packed, scale, offset = _int4(32, 64, 32, 3, torch.float32)
    w = (q.double().view(32, 2, 32) * scale.double()[..., None] + offset.double()[..., None]).view(32, 64)
    assert torch.allclose(ref.dequantize_int4(packed, scale, offset, 32, torch.float64), w)
    x = torch.randn(4, 64, generator=_gen(1))
    torch.testing.assert_close(ref.int4_matmul_ref(x, packed, scale, offset, 32).double(), x.double() @ w.t(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_token, per_channel", [(True, True), (False, False), (True, False)])
def test_fp8_scaled_matmul_matches_twin(per_token, per_channel, device):
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9")
    gen = _gen(7)
    m, n, k = 5, 48, 96
    x = torch.randn(m, k, generator=gen).to(device)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(device)
    if per_token:
        xq, xs = ref.quantize_fp8_per_token(x)
    else:
        xs = (x.abs().max() / 448).reshape(1)
        xq = ref.quantize_fp8_static(x, xs)
    ws = (w.abs().amax(1) / 448) if per_channel else (w.abs().max() / 448).reshape(1)
    wq = (w / ws.reshape(-1, 1)).to(torch.float8_e4m3fn)
    want = ref.fp8_scaled_matmul_ref(xq, xs, wq, ws, torch.float32)
    got = quant.fp8_scaled_matmul(xq, xs, wq, ws, torch.float32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # and the twin is FP8 x FP8 in float64, scaled
    exact = (xq.double() * xs.double().reshape(-1, 1)) @ (wq.double() * ws.double().reshape(-1, 1)).t()
    torch.testing.assert_close(want.double(), exact, atol=1e-4, rtol=1e-4)


def test_split_k_choice_is_bounded():
    assert quant.default_split_k(1, 4096, 64, 64) > 1
    assert quant.default_split_k(64, 4096, 64, 64) == 1
    assert quant.default_split_k(1, 64, 2, 64) == 1
    assert quant.block_k_for(24) is None and quant.block_k_for(96) == 32


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m, k, dtype", [(1, 96, torch.float32), (7, 1500, torch.bfloat16), (3, 40, torch.float16)])
def test_fp8_activation_quantization_is_bit_identical_to_the_twin(static, m, k, dtype, device):
    gen = _gen(m * k)
    x = (torch.randn(m, k, generator=gen) * 4).to(dtype)
    x[0, :3] = torch.tensor([1e4, -1e4, 0.0]).to(dtype)  # saturates under a static scale
    if m > 1:
        x[1] = 0  # an all-zero row: the absmax floor, no division by zero
    x = x.to(device)
    scale = torch.tensor([0.02], device=device) if static else None
    q, s = quant.quantize_fp8(x, scale)
    want_q, want_s = (ref.quantize_fp8_static(x, scale), scale.reshape(1)) if static else ref.quantize_fp8_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(s, want_s.float(), atol=0, rtol=0)


def test_twins_divide_as_the_kernels_do_whatever_the_device(monkeypatch):
    """torch's CUDA division by a CPU scalar (a Python float, a CPU 0-dim tensor) multiplies by the
    rounded reciprocal, 1 ulp off a true division for about half of all values; its CPU division
    divides. The kernels divide IEEE-rounded (div_rn) everywhere, so the twins must not divide by a
    scalar: emulated here on the CPU, they still equal the interpreted kernels bit for bit."""
    from kvserve.kernels import reference

    real_div = torch.Tensor.__truediv__

    def cuda_like_div(a, b):
        scalar = isinstance(b, float) or (isinstance(b, torch.Tensor) and b.dim() == 0 and a.dim() > 0)
        return a * (1.0 / b) if scalar and a.is_floating_point() else real_div(a, b)

    monkeypatch.setattr(torch.Tensor, "__truediv__", cuda_like_div)
    x = torch.rand(64, 333, generator=_gen(5)) * 300
    q, s = quant.quantize_fp8(x)
    want_q, want_s = ref.quantize_fp8_per_token(x)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    scale = torch.tensor(0.37)
    q, _ = quant.quantize_fp8(x, scale)
    assert torch.equal(q.view(torch.uint8), ref.quantize_fp8_static(x, scale).view(torch.uint8))
    rows = torch.rand(40, 2, 16, generator=_gen(6)) * 100
    assert torch.equal(reference.quantize_kv_ref(rows, scale, torch.float8_e4m3fn).view(torch.uint8),
                       real_div(rows, torch.full_like(rows, 0.37)).clamp(-448, 448).to(torch.float8_e4m3fn)
                       .view(torch.uint8))


def test_w8a8_linear_through_the_kernels_matches_the_twin(device):
    """fp8_matmul with the Triton kernels (activation quantization and GEMM) against the twin."""
    from kvserve.runtime.models.quantization.fp8 import fp8_matmul, quantize_fp8_per_channel

    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9")
    gen = _gen(11)
    x = torch.randn(6, 64, generator=gen).to(device)
    w, ws = (t.to(device) for t in quantize_fp8_per_channel(torch.randn(32, 64, generator=gen)))
    for static in (None, torch.tensor([0.01], device=device)):
        got = fp8_matmul(x, w, ws, static, kernel="triton")
        want = fp8_matmul(x, w, ws, static, kernel="twin")
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
