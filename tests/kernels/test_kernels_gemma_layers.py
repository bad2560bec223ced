"""Gemma's layer ops: the (1 + weight) RMSNorm (plain and fused with the residual add) and the
GELU(tanh)-and-mul MLP activation, Triton kernels (interpreter) against their torch twins, and the
twins against transformers' own modules."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import layers, ops, reference  # noqa: E402

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
DTYPES = list(TOL)


def _close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_kernels_match_twins(dtype, device):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 80, generator=g) * 3).to(dtype).to(device)
    residual = torch.randn(5, 80, generator=g).to(dtype).to(device)
    weight = (0.1 * torch.randn(80, generator=g)).to(dtype).to(device)  # Gemma's gains sit around 0
    _close(layers.gemma_rms_norm(x, weight, 1e-6), reference.gemma_rms_norm_ref(x, weight, 1e-6), dtype)
    normed, summed = layers.gemma_fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_summed = reference.gemma_fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    _close(normed, ref_normed, dtype)
    _close(summed, ref_summed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_kernel_matches_twin(dtype, device):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 2, 2 * 96, generator=g) * 4).to(dtype).to(device)  # large |x|: tanh saturates
    _close(layers.gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul_ref(x), dtype)
    with pytest.raises(ValueError, match="even last dimension"):
        layers.gelu_tanh_and_mul(x[..., :5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twins_equal_transformers_modules_bit_for_bit(dtype):
    from transformers.activations import ACT2FN
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=g).to(dtype)
    norm = Gemma2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(0.1 * torch.randn(64, generator=g))
        assert torch.equal(reference.gemma_rms_norm_ref(x, norm.weight, 1e-6), norm(x))
        gate_up = torch.randn(7, 128, generator=g).to(dtype)
        act = ACT2FN["gelu_pytorch_tanh"]
        assert torch.equal(reference.gelu_tanh_and_mul_ref(gate_up), act(gate_up[:, :64]) * gate_up[:, 64:])


def test_ops_dispatch_to_kernels_in_triton_mode(device):
    x = torch.randn(2, 64).to(device)
    w = torch.zeros(64, device=device)
    with ops.kernel_mode("triton"):
        _close(ops.gemma_rms_norm(x, w, 1e-6), reference.gemma_rms_norm_ref(x, w, 1e-6), torch.float32)
        _close(ops.gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul_ref(x), torch.float32)
