"""Triton layer kernels (RMSNorm, fused add + RMSNorm, rotary, SiLU-and-mul) against their torch
twins under the interpreter, and the kernel-mode dispatch in kvserve.kernels.ops."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import layers, ops, reference  # noqa: E402

# float32/float16 match to rounding; the interpreter truncates bfloat16 casts (the GPU rounds).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


def _cos_sin_cache(max_pos, rotary_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 80, 96])
def test_rms_norm_and_fused_add(dtype, hidden, device):
    g = _gen(hidden)
    x = (torch.randn(2, 3, hidden, generator=g) * 3).to(dtype).to(device)
    residual = torch.randn(2, 3, hidden, generator=g).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    x_before, residual_before = x.clone(), residual.clone()
    _close(layers.rms_norm(x, weight, 1e-6), reference.rms_norm_ref(x, weight, 1e-6), dtype)
    normed, summed = layers.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = reference.fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    _close(normed, ref_normed, dtype)
    _close(summed, ref_summed, dtype)
    # the inputs are left alone: the twins never write them either
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_float32_weight_on_half_input_promotes_like_torch(device):
    g = _gen(1)
    x = torch.randn(4, 64, generator=g).half().to(device)
    weight = torch.randn(64, generator=g).to(device)
    _close(layers.rms_norm(x, weight, 1e-6), reference.rms_norm_ref(x, weight, 1e-6), torch.float32)


@pytest.mark.parametrize(
    "dtype,head_dim,rotary_dim",
    [(torch.float32, 64, 64), (torch.float16, 80, 80), (torch.bfloat16, 96, 96),
     (torch.float16, 128, 64), (torch.float32, 256, 256)],
)
def test_rotary_on_strided_qkv_views(dtype, head_dim, rotary_dim, device):
    g = _gen(head_dim + rotary_dim)
    tokens, heads, kv_heads = 5, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 17, 63, 5], device=device)
    # a llama3-style scaled table is just another float32 table: use an unusual base
    cache = _cos_sin_cache(64, rotary_dim, base=500000.0 if head_dim == 128 else 10000.0).to(device)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = layers.rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = reference.rotary_embedding_ref(positions, q, k, cache)
    _close(q_out, q_ref, dtype)
    _close(k_out, k_ref, dtype)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    if rotary_dim < head_dim:  # the pass-through dims are copied unchanged
        assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, device):
    g = _gen(7)
    x = (torch.randn(3, 2, 2 * 88, generator=g) * 4).to(dtype).to(device)  # non-power-of-2 width
    _close(layers.silu_and_mul(x), reference.silu_and_mul_ref(x), dtype)


def test_empty_inputs_give_empty_outputs():
    x = torch.empty(0, 64)
    assert layers.rms_norm(x, torch.ones(64), 1e-6).shape == (0, 64)
    assert layers.silu_and_mul(torch.empty(0, 32)).shape == (0, 16)
    q = torch.empty(0, 2, 64)
    assert layers.rotary_embedding(torch.empty(0, dtype=torch.long), q, q, _cos_sin_cache(4, 64))[0].shape == (0, 2, 64)


# ------------------------------------------------------------------------------------ dispatch


@pytest.fixture
def clean_mode(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    ops.set_kernel_mode(None)
    yield monkeypatch
    ops.set_kernel_mode(None)


def test_auto_mode_on_cpu_uses_the_native_kernels_for_float32_and_the_twins_otherwise(clean_mode):
    from kvserve.kernels.cpu import native

    x = torch.randn(3, 64)
    assert ops.get_kernel_mode() == "auto" and not ops.use_triton(x)
    assert ops.use_native(x) == native.available()
    xb, wb = x.bfloat16(), torch.randn(64).bfloat16()
    assert not ops.use_native(xb)
    assert torch.equal(ops.rms_norm(xb, wb, 1e-6), reference.rms_norm_ref(xb, wb, 1e-6))
    w = torch.randn(64)
    with ops.kernel_mode("torch"):
        assert not ops.use_native(x)
        assert torch.equal(ops.rms_norm(x, w, 1e-6), reference.rms_norm_ref(x, w, 1e-6))


def test_triton_mode_runs_the_kernels_through_ops(clean_mode, device):
    calls = []
    original = layers.silu_and_mul
    clean_mode.setattr(layers, "silu_and_mul", lambda x: calls.append(x.shape) or original(x))
    x = torch.randn(2, 64).to(device)
    with ops.kernel_mode("triton"):
        assert ops.use_triton(x)
        out = ops.silu_and_mul(x)
        q = torch.randn(3, 2, 64).to(device)
        cache = _cos_sin_cache(8, 64).to(device)
        pos = torch.tensor([0, 3, 7], device=device)
        for got, want in zip(ops.rotary_embedding(pos, q, q, cache), reference.rotary_embedding_ref(pos, q, q, cache)):
            _close(got, want, torch.float32)
        w = torch.randn(64).to(device)
        for got, want in zip(ops.fused_add_rms_norm(x, x, w, 1e-6), reference.fused_add_rms_norm_ref(x, x, w, 1e-6)):
            _close(got, want, torch.float32)
    assert calls == [(2, 64)]
    _close(out, reference.silu_and_mul_ref(x), torch.float32)
    assert ops.get_kernel_mode() == "auto"


def test_env_var_selects_mode_and_bad_values_are_named(clean_mode):
    clean_mode.setenv(ops.ENV_VAR, "torch")
    assert ops.get_kernel_mode() == "torch"
    clean_mode.setenv(ops.ENV_VAR, "triton")
    assert ops.use_triton(torch.zeros(1))
    ops.set_kernel_mode("torch")  # the call wins over the variable
    assert not ops.use_triton(torch.zeros(1))
    ops.set_kernel_mode(None)
    clean_mode.setenv(ops.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="KVSERVE_KERNELS: unknown kernel mode 'cuda'"):
        ops.get_kernel_mode()
    with pytest.raises(ValueError, match="set_kernel_mode: unknown kernel mode 'fast'"):
        ops.set_kernel_mode("fast")


def test_triton_on_cpu_without_the_interpreter_says_how_to_fix_it(clean_mode):
    clean_mode.setenv("TRITON_INTERPRET", "0")
    with ops.kernel_mode("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.silu_and_mul(torch.randn(2, 8))


def test_twins_are_the_hf_formulas():
    """The torch path stays Hugging Face's arithmetic (what the model parity tests rely on)."""
    g = _gen(3)
    x = torch.randn(4, 32, generator=g).bfloat16()
    w = torch.randn(32, generator=g).bfloat16()
    variance = x.float().pow(2).mean(-1, keepdim=True)
    hf = w * (x.float() * torch.rsqrt(variance + 1e-6)).bfloat16()
    assert torch.equal(ops.rms_norm(x, w, 1e-6), hf)
    assert math.isclose(float(ops.silu_and_mul(torch.tensor([[1.0, 2.0]]))), 2 * 1 / (1 + math.exp(-1)), rel_tol=1e-6)
