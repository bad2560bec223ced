"""Weight formats through the linear-method interface: format resolution, the canonical int4/int8
weights and their CPU kernels against float64 dequantize-then-matmul, load-time int8/int4 models
against transformers running the same (dequantized) weights, and the tensor-parallel group rule."""

from __future__ import annotations

import re

import pytest
import torch

from kvserve.runtime.attention import TorchAttentionBackend
from kvserve.runtime.models import load_model
from kvserve.runtime.models.quantization import resolve_quantization
from kvserve.runtime.models.quantization.base import LinearSpec
from kvserve.runtime.models.quantization.int4 import Int4Config, check_group, group_size_for
from kvserve.runtime.models.quantization.packed import (
    Int4Weight,
    Int8Weight,
    _cpu_pack_rows,
    quantize_int4,
    quantize_int8,
    set_cpu_native,
    set_cpu_packed,
)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ format resolution


@pytest.mark.parametrize("requested, config, match", [
    ("int3", {}, "quantization: unknown format 'int3'; supported: int8, int4, awq"),
    ("awq", {}, "quantization: 'awq' needs a checkpoint quantized with it"),
    ("gptq", {"quantization_config": {"quant_method": "awq"}}, "'gptq' was requested but the checkpoint is "
                                                              "quantized as 'awq'"),
    ("int8", {"quantization_config": {"quant_method": "awq"}}, "checkpoint is quantized as 'awq'"),
    (None, {"quantization_config": {"quant_method": "hqq"}}, "quant_method 'hqq' is not supported"),
    # A .gguf file has no config.json: its tensor types are its format, so the messages say so.
    ("int8", {"quantization_config": {"quant_method": "gguf"}}, "quantization: 'int8' was requested but the model "
                                                              "is a GGUF file (its tensor types are its format); "
                                                              "leave quantization unset or use 'gguf'"),
    ("gguf", {}, "quantization: 'gguf' needs a .gguf file as the model; this checkpoint is not one"),
])
def test_bad_quantization_requests_name_the_field(requested, config, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        resolve_quantization(requested, config)


def test_resolution_follows_the_checkpoint():
    assert resolve_quantization(None, {}) is None
    assert resolve_quantization("INT4", {}).name == "int4"
    assert resolve_quantization("int8", {}).name == "int8"


def test_engine_config_refuses_unknown_quantization(tiny_llama):
    from kvserve.runtime.config import EngineConfig

    with pytest.raises(ValueError, match=r"^quantization: must be one of \['int8', 'int4'"):
        EngineConfig(model=str(tiny_llama), quantization="q4_0")
    assert EngineConfig(model=str(tiny_llama), quantization="compressed_tensors").quantization == "compressed-tensors"


# ------------------------------------------------------------------------------ canonical weights


def _native_loaded() -> bool:
    from kvserve.kernels.cpu import native

    return native.available()


@pytest.fixture(params=["native", "torch-packed", "dequant-twin"])
def cpu_packed(request):
    """Which CPU kernel new weights get: kvserve's native AVX2 kernels, torch's packed bf16 ones,
    or the exact dequantize-then-matmul twin. Yields whether torch's bf16 kernels are in play."""
    if request.param == "native" and not _native_loaded():
        pytest.skip("native CPU kernels not loaded on this machine")
    set_cpu_packed(request.param != "dequant-twin")
    set_cpu_native(request.param == "native")
    yield request.param == "torch-packed"
    set_cpu_packed(None)
    set_cpu_native(None)


def _dequant_int4(q, scale, offset, g):
    n, k = q.shape
    return (q.double().view(n, k // g, g) * scale.double()[..., None] + offset.double()[..., None]).view(n, k)


@pytest.mark.parametrize("n, k, g", [(64, 128, 32), (48, 192, 64), (32, 512, 512), (40, 96, 32), (96, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_weight_matches_float64_dequantized(cpu_packed, n, k, g, dtype):
    gen = _gen(n + k + g)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // g, generator=gen) * 0.02 + 0.001
    offset = torch.randn(n, k // g, generator=gen) * 0.05
    weight = Int4Weight(q, scale, offset, g, dtype)
    x = torch.randn(5, k, generator=gen).to(dtype)
    want = x.double() @ _dequant_int4(q, scale, offset, g).t()
    got = weight.matmul(x)
    assert got.dtype == dtype and got.shape == (5, n)
    # The packed CPU kernel takes bf16 inputs and bf16 scales: bf16 rounding, relative to |x||w|.
    bf16_path = cpu_packed or dtype == torch.bfloat16
    tol = 2e-2 if bf16_path else 1e-5
    scale_of = (x.double().abs() @ _dequant_int4(q, scale, offset, g).abs().t()).max().item()
    assert (got.double() - want).abs().max().item() <= tol * scale_of
    ids = torch.tensor([0, n - 1, n // 2, 3])
    rows_tol = 1e-2 if bf16_path else 1e-6
    torch.testing.assert_close(weight.rows(ids).double(), _dequant_int4(q, scale, offset, g)[ids],
                               atol=rows_tol, rtol=rows_tol)


@pytest.mark.parametrize("n", [32, 48, 96, 112])
def test_cpu_int4_pack_rows_reads_torch_layout(n):
    k = 64
    q = torch.randint(0, 16, (n, k), generator=_gen(n), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    ids = torch.arange(n)
    assert torch.equal(_cpu_pack_rows(packed, ids, n, k), q)


@pytest.mark.parametrize("n, k, g", [(64, 96, 96), (48, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_matches_float64_dequantized(cpu_packed, n, k, g, dtype):
    gen = _gen(n * k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // g, generator=gen) * 0.01 + 1e-4
    weight = Int8Weight(q, scale, g, dtype)
    x = torch.randn(3, k, generator=gen).to(dtype)
    w = (q.double().view(n, k // g, g) * scale.double()[..., None]).view(n, k)
    got = weight.matmul(x)
    bf16_path = (cpu_packed and g == k) or dtype == torch.bfloat16
    tol = 2e-2 if bf16_path else 1e-5
    assert (got.double() - x.double() @ w.t()).abs().max().item() <= tol * (x.double().abs() @ w.abs().t()).max()
    ids = torch.tensor([1, n - 1])
    torch.testing.assert_close(weight.rows(ids).double(), w[ids], atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               rtol=1e-2)


# ------------------------------------------------------------- native AVX2 integer kernels


def _shapes():
    # (m, n, k, group): batch 1 (the streaming kernel) and larger batches (dequantized panels),
    # row counts that leave a partial last panel, groups of 32/64/128 and the whole row.
    for m in (1, 2, 5, 6, 13, 70):
        for n, k, g in ((16, 64, 32), (37, 128, 64), (50, 256, 128), (81, 96, 96), (200, 576, 576), (33, 576, 32)):
            yield m, n, k, g


@pytest.mark.parametrize("m, n, k, g", list(_shapes()))
def test_native_integer_kernels_match_the_reference_dequant_matmul(m, n, k, g):
    if not _native_loaded():
        pytest.skip("native CPU kernels not loaded on this machine")
    from kvserve.kernels import quant_reference as ref
    from kvserve.kernels.cpu import native
    from kvserve.runtime.models.quantization.packed import pack_int4_nibbles

    gen = _gen(m * 1000 + n + k + g)
    x = torch.randn(m, k, generator=gen)
    q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    s8 = torch.rand(n, k // g, generator=gen) * 0.01 + 1e-4
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    s4 = torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3
    o4 = torch.randn(n, k // g, generator=gen) * 0.05
    cases = [
        (native.Int8Panels(q8, s8, g), ref.int8_matmul_ref(x.double(), q8, s8.double(), g),
         (q8.double().view(n, -1, g) * s8.double()[..., None]).view(n, k)),
        (native.Int4Panels(q4, s4, o4, g), ref.int4_matmul_ref(x.double(), pack_int4_nibbles(q4), s4.double(),
                                                               o4.double(), g),
         _dequant_int4(q4, s4, o4, g)),
    ]
    for panels, want, w in cases:
        got = panels.matmul(x)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        # float32 accumulation in another order than float64's: the worst case of k float32
        # roundings, relative to sum |x| |w| (a layout bug is off by O(1)).
        bound = 1.2e-7 * (k + 4) * (x.double().abs() @ w.abs().t())
        assert ((got.double() - want).abs() <= bound + 1e-12).all()
        ids = torch.tensor([0, n - 1, n // 2, min(15, n - 1)])
        torch.testing.assert_close(panels.rows(ids).double(), w[ids], atol=1e-6, rtol=1e-6)


def test_native_integer_kernels_refuse_bad_input():
    if not _native_loaded():
        pytest.skip("native CPU kernels not loaded on this machine")
    from kvserve.kernels.cpu import native

    q = torch.zeros(16, 64, dtype=torch.int8)
    panels = native.Int8Panels(q, torch.ones(16, 2), 32)
    with pytest.raises(ValueError, match="last dimension 32 != the weight's in_features 64"):
        panels.matmul(torch.zeros(1, 32))
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        panels.matmul(torch.zeros(1, 64, dtype=torch.float64))
    with pytest.raises(IndexError, match=r"row ids must be in \[0, 16\)"):
        panels.rows(torch.tensor([16]))
    with pytest.raises(ValueError, match="even group"):
        native.Int4Panels(q.to(torch.uint8), torch.ones(16, 64), torch.ones(16, 64), 1)


def test_integer_weights_fall_back_to_torch_without_the_native_kernels():
    """KVSERVE_CPU_KERNELS=0 (as on a CPU without AVX2 or a machine without gcc): the same weight
    objects run torch's packed kernels / the twins, with the same results up to bf16 rounding."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from kvserve.kernels.cpu import native\n"
        "from kvserve.runtime.models.quantization.packed import Int8Weight, Int4Weight, quantize_int8, quantize_int4\n"
        "w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))\n"
        "x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))\n"
        "w8 = Int8Weight(*quantize_int8(w, 128), 128, torch.float32)\n"
        "w4 = Int4Weight(*quantize_int4(w, 64), 64, torch.float32)\n"
        "assert w8.native is None and w4.native is None, native.status()\n"
        "assert w8.use_cpu_packed and w4.cpu_packed is not None\n"
        "ref = x @ w.t()\n"
        "for got in (w8.matmul(x), w4.matmul(x)):\n"
        "    assert (got - ref).abs().max() < 0.2 * ref.abs().max(), (got - ref).abs().max()\n"
        "print(native.status())\n"
    )
    env = {**__import__("os").environ, "KVSERVE_CPU_KERNELS": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "disabled by KVSERVE_CPU_KERNELS=0"


def test_load_time_quantizers_round_trip_within_half_a_step():
    w = torch.randn(32, 256, generator=_gen(3)) * 0.1
    q, scale, offset = quantize_int4(w, 128)
    deq = _dequant_int4(q, scale, offset, 128)
    step = scale.double().repeat_interleave(128, dim=1)
    assert ((deq - w.double()).abs() <= step / 2 + 1e-7).all()
    q8, s8 = quantize_int8(w, 256)
    assert ((q8.double() * s8.double() - w.double()).abs() <= s8.double() / 2 + 1e-7).all()


# --------------------------------------------------------------- load-time int8/int4 whole models


def _fake_quantized_hf(model_dir, quantization, g_for):
    """transformers' model with every linear (and the vocabulary) replaced by its dequantized
    int8/int4 weights: what our quantized model must compute."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() != 2:
                continue
            w = p.data
            if quantization == "int8":
                q, s = quantize_int8(w, w.shape[1])
                p.copy_(q.float() * s)
            else:
                g = g_for(w.shape[1])
                q, s, o = quantize_int4(w, g)
                p.copy_(_dequant_int4(q, s, o, g).float())
    return hf


@pytest.mark.parametrize("kernel", ["native", "dequant-twin"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_load_time_quantized_model_matches_transformers_on_dequantized_weights(tiny_model_factory, quantization,
                                                                               kernel):
    """The float32 kernels only: the native ones (float32 activations and accumulation) and the
    exact twin; torch's packed kernels take bf16 inputs (checked per weight above)."""
    from test_models import PagedCache, _hf_logits, _prompts

    if kernel == "native" and not _native_loaded():
        pytest.skip("native CPU kernels not loaded on this machine")
    model_dir = tiny_model_factory("qwen2", tie_word_embeddings=True, hidden_size=64, intermediate_size=192)
    hf = _fake_quantized_hf(model_dir, quantization, group_size_for)
    set_cpu_packed(kernel == "native")
    try:
        model = load_model(model_dir, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend(),
                           quantization=quantization)
    finally:
        set_cpu_packed(None)
    weight = model.layers[0].mlp.down_proj
    assert (getattr(weight, quantization).native is not None) == (kernel == "native")
    assert model.embed_tokens.quant_method.name == quantization
    assert not hasattr(model.layers[0].mlp.down_proj, "weight")  # no full-precision copy kept
    prompt = _prompts(512, [11])[0]
    got = PagedCache(model, num_blocks=8).step(model, [(0, prompt)])
    torch.testing.assert_close(got, _hf_logits(hf, prompt), atol=2e-4, rtol=0)


def test_load_time_int8_engine_greedy_matches_float_closely(tiny_model_factory):
    """Through the engine with the packed CPU kernels: int8 decode stays on the float model's
    greedy path for a short continuation (weights differ by < 0.4%)."""
    from kvserve.runtime import LLM, SamplingParams

    model_dir = tiny_model_factory("llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for q in (None, "int8"):
        with LLM(str(model_dir), quantization=q, dtype="float32", device="cpu", num_kv_blocks=32) as llm:
            runs[q] = llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0].outputs[0].token_ids
            assert llm.engine.quantization == q
    assert runs["int8"][:4] == runs[None][:4]


# ---------------------------------------------------------------------------- tensor parallelism


def _row_spec(input_size, tp_size, tp_rank=0):
    shard = input_size // tp_size
    return LinearSpec(input_size=input_size, output_sizes=(64,), output_slices=((0, 64),),
                      input_slice=(tp_rank * shard, shard), prefixes=("model.layers.0.self_attn.o_proj",),
                      tp_rank=tp_rank, tp_size=tp_size)


def test_tp_degree_that_splits_a_group_is_refused():
    check_group(_row_spec(256, 2), 128, "int4")  # 128 per rank: whole groups
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2: model.layers.0.self_attn.o_proj would split "
                                         r"int4 quantization groups of 128 input features between ranks "
                                         r"\(128 input features, 64 per rank\)"):
        check_group(_row_spec(128, 2), 128, "int4")


def test_int4_group_size_follows_the_input_size():
    assert [group_size_for(k) for k in (4096, 576, 1536, 96, 40)] == [128, 64, 128, 32, None]
    with pytest.raises(ValueError, match="int4 needs input sizes divisible by 32"):
        Int4Config().get_linear_method(_row_spec(40, 1))


def test_int4_tp2_matches_tp1(tiny_model_factory):
    """Real worker processes and gloo: each rank quantizes its own shard, whole groups only, and
    greedy decoding at tp=2 equals tp=1 token for token."""
    from kvserve.runtime import LLM, SamplingParams

    model_dir = tiny_model_factory("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2)
    prompts = [[5, 6, 7, 8, 9], [30, 31, 32]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(quantization="int4", dtype="float32", device="cpu", num_kv_blocks=32, block_size=4)
    runs = []
    for tp in (1, 2):
        with LLM(str(model_dir), tensor_parallel_size=tp, **kw) as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_int4_tp_that_splits_groups_fails_before_serving(tiny_llama):
    from kvserve.runtime import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size 2: .* would split int4 quantization groups of 64"):
        LLM(str(tiny_llama), quantization="int4", tensor_parallel_size=2, device="cpu", num_kv_blocks=16)


def test_metrics_export_weight_bytes_and_model_info(tiny_llama):
    from kvserve.runtime import LLM
    from kvserve.runtime.server.metrics import ServerMetrics

    rendered = {}
    for q in (None, "int8"):
        with LLM(str(tiny_llama), quantization=q, dtype="float32", device="cpu", num_kv_blocks=16) as llm:
            metrics = ServerMetrics("tiny")
            metrics.update(llm.engine.get_stats())
            rendered[q] = metrics.render().decode()
    assert 'kvserve:model_info{dtype="float32",kv_cache_dtype="auto",model_name="tiny",quantization="int8"} 1.0' \
        in rendered["int8"]
    assert 'quantization="none"' in rendered[None]
    # vLLM's own label for the KV cache dtype, so vLLM dashboards see it too.
    assert 'vllm:cache_config_info{block_size="16",cache_dtype="auto",model_name="tiny",num_gpu_blocks="16"} 1.0' \
        in rendered["int8"]
    with LLM(str(tiny_llama), kv_cache_dtype="fp8_e5m2", device="cpu", num_kv_blocks=16) as llm:
        metrics = ServerMetrics("tiny")
        metrics.update(llm.engine.get_stats())
        fp8 = metrics.render().decode()
    assert 'vllm:cache_config_info{block_size="16",cache_dtype="fp8_e5m2",model_name="tiny",num_gpu_blocks="16"} 1.0' \
        in fp8
    assert 'kv_cache_dtype="fp8_e5m2"' in fp8

    def weight_bytes(text):
        line = next(x for x in text.splitlines() if x.startswith("kvserve:model_weight_bytes{"))
        return float(line.rsplit(" ", 1)[1])

    # float32 weights -> int8 values plus one float32 and one bf16 scale per row: about a quarter.
    assert weight_bytes(rendered["int8"]) < 0.3 * weight_bytes(rendered[None])
