"""bitsandbytes 4-bit dequant-GEMM (kernels/nf4.py): the torch twin's weights are bitsandbytes'
own dequantize_4bit, bit for bit; the Triton kernel (interpreted on the CPU) equals the twin, with
and without split-K, for NF4 and FP4, several block sizes and batch sizes, float32 and bfloat16;
and bitsandbytes layers route decode-sized batches to it under the Triton kernel mode."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import nf4

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("triton")


def _quantized(n: int, k: int, kind: str, block: int, seed: int = 0):
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    packed, state = quantize_4bit(w, blocksize=block, quant_type=kind, compress_statistics=False)
    codes = packed.reshape(n, k // 2)
    absmax = state.absmax.float().reshape(n, k // block)
    return codes, absmax, state.code.float(), dequantize_4bit(packed, state).float()


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_twin_dequantizes_as_bitsandbytes(kind):
    codes, absmax, codebook, want = _quantized(48, 256, kind, 64)
    assert torch.equal(nf4.dequantize_ref(codes, absmax, codebook, 64), want)


@pytest.mark.parametrize("kind, block, m, split", [("nf4", 64, 1, None), ("nf4", 64, 5, 1), ("fp4", 128, 33, None),
                                                    ("nf4", 32, 2, 4), ("nf4", 256, 17, None)])
def test_triton_kernel_matches_the_twin(monkeypatch, kind, block, m, split, device):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    codes, absmax, codebook, _ = _quantized(80, 512, kind, block, seed=block + m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    on_device = [t.to(device) for t in (codes, absmax, codebook)]
    got = nf4.nf4_matmul(x.to(device), *on_device, block, split_k=split).cpu()
    want = nf4.nf4_matmul_ref(x, codes, absmax, codebook, block)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # bfloat16 activations: the weight is rounded to bfloat16 as a dequantized layer's would be
    xb = x.to(torch.bfloat16)[:, None]  # a 3-D input keeps its leading dims
    got = nf4.nf4_matmul(xb.to(device), *on_device, block, split_k=split).cpu()
    assert got.shape == (m, 1, 80) and got.dtype == torch.bfloat16
    # float32 accumulation of the bfloat16-rounded operands, rounded once to bfloat16 at the end
    w = nf4.dequantize_ref(codes, absmax, codebook, block).to(torch.bfloat16).float()
    want = (xb.float() @ w.T).to(torch.bfloat16).float()
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)


def test_bad_shapes_name_what_is_wrong():
    codes, absmax, codebook, _ = _quantized(16, 128, "nf4", 64)
    with pytest.raises(ValueError, match="absmax"):
        nf4.nf4_matmul(torch.randn(1, 128), codes, absmax[:, :1], codebook, 64)
    with pytest.raises(ValueError, match="block 24 must be a multiple of 16"):
        nf4.nf4_matmul(torch.randn(1, 128), codes, torch.ones(16, 128 // 24), codebook, 24)


def test_packed_layers_use_the_kernel_for_decode_batches(monkeypatch):
    """Packed4bitWeight.matmul (the hold GPUs use) goes through the Triton kernel where the platform
    picks the dequant-GEMM for int4 (decode-sized batches under the Triton kernel mode)."""
    from kvserve.kernels import ops
    from kvserve.runtime.models.quantization import bnb4

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(bnb4, "native_enabled", lambda device: False)  # the torch-twin hold, as on a GPU
    codes, absmax, codebook, dense = _quantized(64, 256, "nf4", 64)
    weight = bnb4.Packed4bitWeight(codes, absmax, codebook, 64, torch.float32)
    calls = []
    real = nf4.nf4_matmul
    monkeypatch.setattr(nf4, "nf4_matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    with ops.kernel_mode("triton"):
        got = weight.matmul(x)
    assert calls
    torch.testing.assert_close(got, x @ dense.T, rtol=1e-5, atol=1e-4)
