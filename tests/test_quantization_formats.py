"""Checkpoint formats: compressed-tensors and GPTQ checkpoints made by the real quantizers
(tests/fixtures/quant, scripts/make_quant_fixtures.py) against the quantizer's own model; AWQ,
GPTQ layouts and FP8 checkpoints written here with the formats' reference packing, against
dequantize-then-matmul in float64; layout mismatches and unsupported requests named."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.attention import TorchAttentionBackend
from kvserve.runtime.models import load_model
from kvserve.runtime.models.quantization.awq import AWQ_ORDER, pack_cols, unpack_cols
from kvserve.runtime.models.quantization.gptq import pack_cols_seq, pack_rows, unpack_cols_seq, unpack_rows
from kvserve.runtime.models.quantization.packed import set_cpu_packed

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "quant"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.fixture
def exact():
    """The exact dequantize-then-matmul path (the packed CPU kernels take bf16 activations)."""
    set_cpu_packed(False)
    yield
    set_cpu_packed(None)


def _greedy(model_dir, prompts, n=12, **kw):
    with LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=32, **kw) as llm:
        outs = llm.generate([list(p) for p in prompts], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.engine.quantization


def _last_logits(model_dir, prompt):
    from test_models import PagedCache

    model = load_model(model_dir, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
    return PagedCache(model, num_blocks=16).step(model, [(0, list(prompt))])[-1]


# --------------------------------------------------------------- fixtures from the real quantizers


REAL = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.pt").is_file()) if FIXTURES.is_dir() else []


@pytest.mark.parametrize("name", REAL)
def test_real_quantizer_checkpoint_matches_the_quantizers_model(name, exact):
    """Greedy tokens equal the quantizing library's own model (transformers + compressed-tensors,
    or GPTQModel), and last-position logits agree closely."""
    expected = torch.load(FIXTURES / name / "expected.pt")
    config = json.loads((FIXTURES / name / "config.json").read_text())
    fmt = config["quantization_config"]["quant_method"]
    greedy, quantization = _greedy(FIXTURES / name, expected["prompts"])
    assert quantization == fmt.replace("_", "-")
    assert greedy == expected["greedy"]
    # GPTQModel saves and runs the model in bfloat16 (its scales are float16): bf16-sized differences.
    atol = 2e-3 if config.get("dtype", config.get("torch_dtype")) == "float32" else 5e-2
    for prompt, want in zip(expected["prompts"], expected["last_logits"]):
        torch.testing.assert_close(_last_logits(FIXTURES / name, prompt), want, atol=atol, rtol=0)


@pytest.mark.parametrize("name", [n for n in REAL if "w4a16-g32" == n.removeprefix("ct-")])
def test_packed_cpu_kernel_stays_close_on_real_checkpoint(name):
    """The default CPU path (torch's packed int4 kernel, bf16 activations) stays within bf16
    rounding of the quantizer's logits."""
    expected = torch.load(FIXTURES / name / "expected.pt")
    got = _last_logits(FIXTURES / name, expected["prompts"][0])
    want = expected["last_logits"][0]
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item() + 0.02


# ------------------------------------------------------------ reference packing: AWQ, GPTQ, FP8


def _quantize_affine(w: torch.Tensor, g: int, sym: bool):
    """[N, K] float -> (q 0..15 [N, K], zero 0..15 [N, K/g], scale [N, K/g]) like the quantizers."""
    n, k = w.shape
    grp = w.double().view(n, k // g, g)
    if sym:
        scale = grp.abs().amax(-1) / 7.5
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = grp.amin(-1).clamp(max=0), grp.amax(-1).clamp(min=0)
        scale = (hi - lo) / 15
        zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(grp / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.view(n, k).long(), zero.long(), scale.float()


def _dequant(q, zero, scale, g):
    n, k = q.shape
    return ((q.double().view(n, k // g, g) - zero.double()[..., None]) * scale.double()[..., None]).view(n, k)


def _write_quantized(src: pathlib.Path, dst: pathlib.Path, quant_config: dict, convert) -> dict[str, torch.Tensor]:
    """Copies a tiny model, replacing each linear weight by `convert(name, w)` tensors; returns the
    float64 dequantized weights to build the oracle from."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    deq = {}
    for key in list(tensors):
        base = key.removesuffix(".weight")
        if key.endswith(".weight") and base.split("layers.")[-1].split(".", 1)[-1] in LINEARS:
            w = tensors.pop(key)
            new, deq[key] = convert(base, w)
            tensors.update(new)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config))
    return deq


def _oracle_logits(src: pathlib.Path, deq: dict[str, torch.Tensor], prompt):
    from test_models import _hf, _hf_logits

    hf = _hf(src)
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for key, w in deq.items():
            params[key].copy_(w.float())
    return hf, _hf_logits(hf, prompt)


def test_unpack_helpers_invert_packers():
    g = torch.Generator().manual_seed(0)
    v = torch.randint(0, 16, (16, 64), generator=g)
    assert torch.equal(unpack_cols(pack_cols(v)), v)
    assert torch.equal(unpack_rows(pack_rows(v, 4), 4), v)
    assert torch.equal(unpack_cols_seq(pack_cols_seq(v, 4), 4), v)
    v8 = torch.randint(0, 256, (8, 32), generator=g)
    assert torch.equal(unpack_rows(pack_rows(v8, 8), 8), v8)
    # AWQ's order: nibble i of a word is column AWQ_ORDER[i] of its eight
    word = pack_cols(torch.arange(8).view(1, 8))
    assert [(int(word) >> (4 * i)) & 0xF for i in range(8)] == list(AWQ_ORDER)


def _awq_convert(g):
    def convert(base, w):
        q, zero, scale = _quantize_affine(w, g, sym=False)
        return ({f"{base}.qweight": pack_cols(q.t().contiguous()), f"{base}.qzeros": pack_cols(zero.t().contiguous()),
                 f"{base}.scales": scale.t().contiguous().half()}, _dequant(q, zero, scale.half().float(), g))
    return convert


def _gptq_convert(g, desc_act, v2=False):
    def convert(base, w):
        n, k = w.shape
        # Layers that share an input (q|k|v, gate|up) get the same act-order, as GPTQ gives them.
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if desc_act else torch.arange(k)
        # act-order: input feature perm[j] goes to group j // g
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // g).int()
        q_p, zero, scale = _quantize_affine(w[:, perm], g, sym=True)
        q = torch.empty_like(q_p)
        q[:, perm] = q_p
        stored_zero = zero if v2 else zero - 1
        tensors = {f"{base}.qweight": pack_rows(q.t().contiguous(), 4),
                   f"{base}.qzeros": pack_cols_seq(stored_zero.t().contiguous(), 4),
                   f"{base}.scales": scale.t().contiguous().half(), f"{base}.g_idx": g_idx}
        deq = (q.double() - zero.double()[:, g_idx.long()]) * scale.half().double()[:, g_idx.long()]
        return tensors, deq
    return convert


FORMATS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
            _awq_convert(32)),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
             _gptq_convert(32, False)),
    "gptq-actorder": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True},
                      _gptq_convert(32, True)),
    "gptq-v2": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
                 "checkpoint_format": "gptq_v2"}, _gptq_convert(32, False, v2=True)),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reference_packed_checkpoint_matches_dequantized_float64(tiny_model_factory, tmp_path, fmt, exact):
    src = tiny_model_factory("qwen2", hidden_size=64, intermediate_size=128)
    qc, convert = FORMATS[fmt]
    deq = _write_quantized(src, tmp_path / fmt, qc, convert)
    prompt = [5, 17, 200, 3, 99, 42, 7]
    _, want = _oracle_logits(src, deq, prompt)
    got = _last_logits(tmp_path / fmt, prompt)
    torch.testing.assert_close(got, want[-1], atol=2e-4, rtol=0)


def test_fp8_checkpoint_per_tensor_static_and_load_time_fp8(tiny_model_factory, tmp_path):
    """A per-tensor FP8 checkpoint with static input scales (W8A8, run exactly on CPU by the
    kernel's twin) against the same arithmetic in float64; load-time FP8 is weight-only on CPU."""
    src = tiny_model_factory("llama")
    x_scale = 0.02

    def convert(base, w):
        s = w.abs().max() / 448.0
        wq = (w / s).to(torch.float8_e4m3fn)
        return ({f"{base}.weight": wq, f"{base}.weight_scale": s.reshape(()).float(),
                 f"{base}.input_scale": torch.tensor(x_scale)}, wq.double() * s.double())

    deq = _write_quantized(src, tmp_path / "fp8", {"quant_method": "fp8", "activation_scheme": "static"}, convert)
    model = load_model(tmp_path / "fp8", dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
    layer = model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.spec.in_features)
    xq = (x / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * x_scale
    want = xq @ deq["model.layers.0.mlp.down_proj.weight"].t()
    torch.testing.assert_close(layer.quant_method.apply(layer, x).double(), want, atol=1e-4, rtol=1e-4)
    # fused q|k|v with three different per-tensor scales
    qkv = model.layers[1].self_attn.qkv_proj
    x = torch.randn(2, 64)
    xq = (x / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * x_scale
    w = torch.cat([deq[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(qkv.quant_method.apply(qkv, x).double(), xq @ w.t(), atol=1e-4, rtol=1e-4)

    online = load_model(src, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend(),
                        quantization="fp8")
    lin = online.layers[0].mlp.gate_up_proj
    assert lin.fp8_weight.dtype == torch.float8_e4m3fn and not lin.quant_method.w8a8
    x = torch.randn(2, 64)
    w = lin.fp8_weight.double() * lin.fp8_scale.double()[:, None]
    torch.testing.assert_close(lin.quant_method.apply(lin, x).double(), x.double() @ w.t(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ bad input


def test_layout_that_does_not_match_the_format_is_named(tiny_model_factory, tmp_path):
    src = tiny_model_factory("llama")
    qc, convert = FORMATS["awq"]
    _write_quantized(src, tmp_path / "awq", qc, convert)
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "gptq"  # AWQ tensors declared as GPTQ
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight model\.layers\.0\.\S+\.qweight: checkpoint shape "
                                         r"\(\d+, 8\) does not match the layout"):
        load_model(tmp_path / "awq", dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
    with pytest.raises(ValueError, match=r"quantization: 'awq' was requested but the checkpoint is quantized as "
                                         r"'gptq'"):
        load_model(tmp_path / "awq", dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend(),
                   quantization="awq")


@pytest.mark.parametrize("change, match", [
    ({"bits": 3}, "quantization_config.bits: gptq supports 4 and 8, got 3"),
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format: gptq supports"),
    ({"lm_head": True}, "quantization_config.lm_head"),
])
def test_unsupported_gptq_settings_are_named(change, match):
    from kvserve.runtime.models.quantization.gptq import GPTQConfig

    with pytest.raises(ValueError, match=match):
        GPTQConfig.from_config({"quant_method": "gptq", "bits": 4, "group_size": 128, **change})


def test_gptq_act_order_refuses_a_row_parallel_split():
    from torch import nn

    from kvserve.runtime.models.quantization.base import LinearSpec
    from kvserve.runtime.models.quantization.gptq import GPTQConfig

    spec = LinearSpec(input_size=256, output_sizes=(64,), output_slices=((0, 64),), input_slice=(128, 128),
                      prefixes=("model.layers.0.mlp.down_proj",), tp_rank=1, tp_size=2)
    method = GPTQConfig.from_config({"bits": 4, "group_size": 32, "desc_act": True}).get_linear_method(spec)
    with pytest.raises(ValueError, match="tensor_parallel_size 2: gptq act-order"):
        method.create_weights(nn.Module(), spec)


def test_cli_refuses_a_mismatched_quantization_in_one_line(tiny_model_factory):
    import subprocess
    import sys

    model_dir = FIXTURES / "ct-w8a16"
    proc = subprocess.run([sys.executable, "-m", "kvserve.runtime.cli", "serve", str(model_dir), "--quantization",
                           "awq", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["kvserve serve: quantization: 'awq' was requested but the checkpoint is quantized as "
                     "'compressed-tensors' (config.json quantization_config); leave quantization unset or use "
                     "'compressed-tensors'"]
