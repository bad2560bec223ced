"""GGUF files as models: the reader against the gguf package, every supported type against
transformers loading the same file, llama.cpp's Q/K permutation, the tokenizer and chat template
from the metadata, clear errors, and the real SmolLM2 Q4_1 file against transformers' float32
dequantization of it."""

from __future__ import annotations

import math
import pathlib
import threading

import ggufmodels as G
import numpy as np
import pytest
import torch

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.attention.torch_backend import TorchAttentionBackend
from kvserve.runtime.gguf import GGUFFile, load_tokenizer, model_config
from kvserve.runtime.gguf.weights import GROUPWISE_TYPES, group_quantized, to_float
from kvserve.runtime.model_config import ModelConfig
from kvserve.runtime.models import load_model

ALL_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# Rows of 256 values: the K types quantize in 256-value super-blocks along the input features.
K_MODEL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


class GGUFFactory:
    """(arch, kind, **options) -> path of a tiny GGUF written from a tiny HF model, cached."""

    def __init__(self, root: pathlib.Path, tiny_model_factory):
        self.root, self.tiny = root, tiny_model_factory
        self.built: dict[tuple, pathlib.Path] = {}
        self.lock = threading.Lock()

    def hf_dir(self, arch: str = "llama", **overrides) -> pathlib.Path:
        return self.tiny(arch, **{**K_MODEL, **overrides})

    def __call__(self, kind: str = "F32", arch: str = "llama", *, embed_kind=None, rope_freqs=None,
                 tensor_kinds=None, **overrides) -> pathlib.Path:
        key = (kind, arch, embed_kind, None if rope_freqs is None else tuple(rope_freqs),
               tuple(sorted((tensor_kinds or {}).items())), tuple(sorted(overrides.items())))
        with self.lock:
            if key not in self.built:
                hf = self.hf_dir(arch, **overrides)
                out = self.root / f"{hf.name}-{kind}-{len(self.built)}.gguf"
                self.built[key] = G.write_gguf(hf, out, kind, embed_kind=embed_kind, rope_freqs=rope_freqs,
                                               tensor_kinds=tensor_kinds)
            return self.built[key]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_model_factory) -> GGUFFactory:
    return GGUFFactory(tmp_path_factory.mktemp("gguf"), tiny_model_factory)


PROMPT = [1, 5, 77, 300, 12, 9, 400, 33, 250, 7, 64, 128]


def our_logits(model_path, prompt=PROMPT, **load_kwargs) -> torch.Tensor:
    """Logits of every prompt position from our model, one prefill through the torch backend."""
    model = load_model(model_path, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend(),
                       **load_kwargs)
    n, block = len(prompt), 16
    blocks = -(-n // block)
    kv = [(torch.zeros(blocks, block, model.num_kv_heads, model.head_dim),
           torch.zeros(blocks, block, model.num_kv_heads, model.head_dim)) for _ in model.layers]
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                             slot_mapping=torch.arange(n), max_query_len=n, max_seq_len=n)
    return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), kv, meta))


def transformers_logits(path: pathlib.Path, prompt=PROMPT) -> torch.Tensor:
    """transformers' own GGUF loading (its reader, dequantizers and Q/K un-permutation) or HF dir."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


# ---------------------------------------------------------------------------------- the reader


def test_reader_agrees_with_the_gguf_package(tiny_gguf):
    import gguf

    path = tiny_gguf("Q4_K", embed_kind="Q8_0")
    ref = gguf.GGUFReader(path)
    ours = GGUFFile(path, string_arrays=True)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(fields) == set(ours.metadata)
    for key, field in fields.items():
        mine = ours.metadata[key]
        mine = mine.tolist() if isinstance(mine, np.ndarray) else mine
        theirs = field.contents()
        assert mine == pytest.approx(theirs) if isinstance(theirs, float) else mine == theirs, key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.ggml_type, info.offset, info.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert info.shape == tuple(reversed([int(d) for d in t.shape]))
        assert np.array_equal(ours.raw(t.name).reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))
    # Without string_arrays the vocabulary is skipped (the tokenizer reads it), the rest is the same.
    lazy = GGUFFile(path)
    assert lazy.metadata["tokenizer.ggml.tokens"].count == len(ours.metadata["tokenizer.ggml.tokens"])
    assert lazy.metadata["llama.block_count"] == ours.metadata["llama.block_count"]


@pytest.mark.parametrize("kind", G.K_TYPES)
def test_k_block_packing_matches_the_gguf_dequantizer(kind):
    """The test helper's Q4_K/Q5_K/Q6_K blocks mean what it thinks they mean (gguf as the oracle)."""
    import gguf

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 512)) * 0.1).astype(np.float32)
    x[0, :256] = np.abs(x[0, :256]) + 0.05  # a super-block with no negative value (min 0)
    x[1, :256] = 0.0  # an all-zero super-block (zero scales)
    packed = G.quantize(x, kind)
    assert packed.shape == (6, 2 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1])
    decoded = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[kind])
    np.testing.assert_array_equal(decoded, G.k_blocks_reference(x, kind))
    assert np.abs(decoded - x).max() < 0.05  # and it is a quantization of x, not noise


@pytest.mark.parametrize("kind", [t.name for t in GROUPWISE_TYPES])
def test_group_wise_form_is_exactly_the_gguf_dequantization(kind):
    import gguf

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((8, 512)) * 0.2).astype(np.float32)
    packed = G.quantize(x, kind)
    qtype = gguf.GGMLQuantizationType[kind]
    g = group_quantized(packed, qtype, x.shape)
    assert g.codes.shape == x.shape and g.scales.shape == (8, 512 // 32)
    assert g.bits == (8 if kind == "Q8_0" else 4)
    lo, hi = (-128, 127) if kind == "Q8_0" else (0, 15)
    assert int(g.codes.min()) >= lo and int(g.codes.max()) <= hi
    expected = torch.from_numpy(gguf.quants.dequantize(packed, qtype))
    assert torch.equal(g.dequantize(), expected)
    assert torch.equal(to_float(packed, qtype, x.shape), expected)


# -------------------------------------------------------------------------- model numerics

# float32 logits against transformers, as tests/test_models.py allows: the native CPU matmuls sum
# in another order than MKL (a few ulps); a wrong dequantization is off by far more.
LOGITS_ATOL = 1e-4


@pytest.fixture
def exact_cpu_matmuls():
    """The int4 layers multiply by dequantize-then-matmul in the compute dtype (the kernels' torch
    twin) instead of torch's packed CPU kernel, which takes bfloat16 activations."""
    from kvserve.runtime.models.quantization.packed import set_cpu_packed

    set_cpu_packed(False)
    yield
    set_cpu_packed(None)


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_every_type_matches_transformers_on_the_same_file(tiny_gguf, kind, exact_cpu_matmuls):
    path = tiny_gguf(kind)
    with GGUFFile(path) as gf:
        assert gf.tensors["blk.0.attn_q.weight"].type_name == kind
    ours = our_logits(path)
    ref = transformers_logits(path)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=LOGITS_ATOL)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_packed_cpu_int4_kernel_stays_close(tiny_gguf, kind):
    """The default CPU path for the 4-bit types (torch's int4 packed kernel, bfloat16 activations):
    within bfloat16 rounding of transformers on the dequantized file."""
    path = tiny_gguf(kind)
    ours, ref = our_logits(path), transformers_logits(path)
    assert (ours - ref).abs().max() < 0.03 * ref.abs().max()


def _methods(path, **kw):
    model = load_model(path, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend(), **kw)
    layer = model.layers[0]
    return {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj, "embed": model.embed_tokens, "lm_head": model.lm_head}


@pytest.mark.parametrize("kind, kept", [("Q4_0", True), ("Q4_1", True), ("Q4_K", True), ("Q8_0", False),
                                        ("Q5_K", False), ("Q6_K", False), ("F16", False)])
def test_which_types_stay_quantized(tiny_gguf, kind, kept):
    """4-bit types are held as int4 (group 32) by the gguf linear method; Q8_0 as int8 (group 32)
    where the native CPU kernels are loaded, else (like 5/6-bit and float types) dequantized at
    load into the unquantized path."""
    from kvserve.kernels.cpu import native
    from kvserve.runtime.models.quantization.gguf import GGUFInt4Method, GGUFInt8Method
    from kvserve.runtime.models.quantization.unquantized import UnquantizedLinearMethod

    if kind == "Q8_0" and native.available():
        kept = True
    layers = _methods(tiny_gguf(kind))
    for name, layer in layers.items():
        want = (GGUFInt8Method if kind == "Q8_0" else GGUFInt4Method) if kept else UnquantizedLinearMethod
        assert type(layer.quant_method) is want, (name, type(layer.quant_method))
        if kept:  # the int4 form replaced the codes: nothing float of the matrix's size is left
            assert all(p.dtype != torch.float32 or p.numel() < layer.spec.out_features * layer.spec.in_features
                       for p in layer.parameters())


def test_a_fused_layer_with_mixed_types_is_dequantized(tiny_gguf, exact_cpu_matmuls):
    """llama.cpp's _M files give attn_v (and ffn_down) a wider type than q/k: q|k|v then cannot be
    one int4 matrix and is dequantized; the layers of one family stay quantized."""
    from kvserve.runtime.models.quantization.gguf import GGUFInt4Method
    from kvserve.runtime.models.quantization.unquantized import UnquantizedLinearMethod

    path = tiny_gguf("Q4_K", tensor_kinds={"attn_v": "Q6_K", "ffn_up": "Q4_0"}, embed_kind="Q6_K")
    layers = _methods(path)
    assert type(layers["qkv"].quant_method) is UnquantizedLinearMethod
    assert type(layers["gate_up"].quant_method) is GGUFInt4Method  # Q4_K gate | Q4_0 up: both int4
    assert type(layers["o"].quant_method) is GGUFInt4Method
    assert type(layers["embed"].quant_method) is UnquantizedLinearMethod
    torch.testing.assert_close(our_logits(path), transformers_logits(path), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("packed", [False, True], ids=["twin", "cpu-packed"])
def test_kept_layers_match_dequantize_then_matmul_in_float64(kind, packed):
    """A layer of the gguf method (Q8_0 as on a GPU: the int8 method) against x @ W.T in float64
    with W the gguf package's dequantization, through the whole load path (loader slicing,
    process_weights_after_loading, apply)."""
    import gguf

    from kvserve.runtime.models.layers import MergedColumnParallelLinear
    from kvserve.runtime.models.quantization.gguf import GGUFConfig, GGUFInt4Method, GGUFInt8Method
    from kvserve.runtime.models.quantization.packed import set_cpu_packed

    rng = np.random.default_rng(4)
    w = (rng.standard_normal((48, 512)) * 0.1).astype(np.float32)
    packed_bytes = G.quantize(w, kind)
    qtype = gguf.GGMLQuantizationType[kind]
    config = GGUFConfig({"p.weight": kind})
    if kind == "Q8_0":
        config.get_linear_method = lambda spec: GGUFInt8Method()  # what a CUDA device gets
    set_cpu_packed(packed)
    try:
        layer = MergedColumnParallelLinear(512, [48], [48], [0], bias=False, dtype=torch.float32, device="cpu",
                                           part_names=[None], prefixes=["p"], quant_config=config)
        assert isinstance(layer.quant_method, GGUFInt8Method if kind == "Q8_0" else GGUFInt4Method)
        g = group_quantized(packed_bytes, qtype, w.shape)
        targets = layer.checkpoint_params()
        for name, tensor in (("p.weight", g.codes), ("p.gguf_scale", g.scales), ("p.gguf_offset", g.offsets)):
            if tensor is not None:
                param, part = targets[name]
                param.weight_loader(param, tensor.to(param.load_dtype), part)
        layer.process_weights_after_loading()
    finally:
        set_cpu_packed(None)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    got = layer(x).double()
    want = x.double() @ torch.from_numpy(gguf.quants.dequantize(packed_bytes, qtype)).double().T
    tol = 2e-2 * want.abs().max().item() if packed and kind != "Q8_0" else 1e-5 * want.abs().max().item()
    assert (got - want).abs().max().item() < tol


def test_tensor_parallel_shards_kept_int4_weights(tiny_gguf):
    path = tiny_gguf("Q4_K")
    kw = dict(num_kv_blocks=64, block_size=8, dtype="float32", device="cpu")
    prompts = [{"prompt_token_ids": [1, 40, 41, 42, 300, 17]}, {"prompt_token_ids": [1, 7, 8]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), **kw) as one:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM(str(path), tensor_parallel_size=2, **kw) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_unpermuted_gguf_equals_the_hf_directory(tiny_gguf):
    """An F32 GGUF (Q/K rows permuted by llama.cpp's rule) gives the HF directory's logits: the
    un-permutation is checked against the original weights, not only against transformers."""
    path = tiny_gguf("F32")
    torch.testing.assert_close(our_logits(path), our_logits(tiny_gguf.hf_dir()), rtol=0, atol=1e-6)
    torch.testing.assert_close(our_logits(path), transformers_logits(tiny_gguf.hf_dir()), rtol=1e-5, atol=LOGITS_ATOL)


@pytest.mark.parametrize("arch, overrides", [
    ("qwen2", {}),
    ("qwen3", dict(head_dim=32)),
    ("llama", dict(tie_word_embeddings=True)),
])
def test_other_families_load_from_gguf(tiny_gguf, arch, overrides):
    """Qwen2 (q/k/v biases, rows not permuted), Qwen3 (q/k norms, head_dim from key_length) and
    tied embeddings (no output.weight) against the HF directory they were written from."""
    path = tiny_gguf("F32", arch, **overrides)
    cfg = model_config(path)
    assert cfg.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                "llama": "LlamaForCausalLM"}[arch]
    assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    hf = tiny_gguf.hf_dir(arch, **overrides)
    torch.testing.assert_close(our_logits(path), transformers_logits(hf), rtol=1e-5, atol=LOGITS_ATOL)


def test_rope_freqs_tensor_gives_llama3_rope_scaling(tiny_gguf):
    """llama.cpp stores Llama 3's rope scaling as per-frequency divisors (rope_freqs.weight);
    applied to plain RoPE they reproduce the HF model with rope_type llama3."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    overrides = dict(rope_scaling=scaling, max_position_embeddings=512)
    hf = tiny_gguf.hf_dir(**overrides)
    cfg = ModelConfig.from_pretrained(hf)
    head_dim, theta = cfg.head_dim, cfg.rope_theta
    factors = []  # the converter's rule (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors)
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        low, high = 64 / 1.0, 64 / 4.0
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(8.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    plain = {**overrides, "rope_scaling": None}
    path = tiny_gguf("F32", rope_freqs=factors, **plain)
    gcfg = model_config(path)
    assert gcfg.rope_scaling is None and gcfg.rope_freq_factors == pytest.approx(factors)
    prompt = list(range(3, 200))  # past the original 64 positions, where the scaling matters
    ours = our_logits(path, prompt, config=gcfg)
    # the HF model (llama3 scaling) and this GGUF hold the same weights: tiny_model_factory seeds them alike
    torch.testing.assert_close(ours, transformers_logits(hf, prompt), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------- tokenizer, config


def test_tokenizer_and_chat_template_come_from_the_metadata(tiny_gguf):
    from transformers import AutoTokenizer

    path = tiny_gguf("Q8_0")
    ours, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(tiny_gguf.hf_dir())
    assert ours.chat_template == ref.chat_template
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<s>", "</s>", "<pad>")
    for text in ["The quick brown fox", "Café, naïve 東京 🙂 numbers 42 and  spaces",
                 "<|user|>Hello<|end|><|assistant|>"]:
        assert ours.encode(text) == ref.encode(text), text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert (ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    cfg = model_config(path)
    assert cfg.eos_token_ids == {2} and cfg.bos_token_id == 1 and cfg.pad_token_id == 0
    assert cfg.dtype == torch.float16 and cfg.max_position_embeddings == 2048


def test_llm_on_a_gguf_file_end_to_end(tiny_gguf, exact_cpu_matmuls):
    """LLM(model="x.gguf"): tokenizer and chat template from the file, greedy output equal to
    transformers' generate on the same file, chat rendering through the file's template."""
    from transformers import AutoModelForCausalLM

    path = tiny_gguf("Q4_K")
    prompts = [[1, 40, 41, 42], [1, 300, 17, 5, 9, 250, 12], [1, 7]]
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64, block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        x = torch.tensor([prompt])
        expected = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, min_new_tokens=10,
                                do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected
    chat = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0.0, max_tokens=4),
                    use_tqdm=False)[0]
    assert chat.prompt == "<s><|user|>Hello<|end|><|assistant|>"
    # An explicit tokenizer= wins over the metadata.
    other = LLM(str(path), tokenizer=str(tiny_gguf.hf_dir()), num_kv_blocks=16)
    assert other.get_tokenizer().encode("fox") == llm.get_tokenizer().encode("fox")


# ------------------------------------------------------------------------------------ errors


def test_unsupported_type_names_tensor_type_and_supported(tiny_gguf, tmp_path):
    import gguf

    src = GGUFFile(tiny_gguf("F32"), string_arrays=True)
    out = tmp_path / "q2k.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for key, value in src.metadata.items():
        if key in ("general.architecture", "GGUF.version"):
            continue
        if key.startswith("tokenizer."):
            continue
        if isinstance(value, np.ndarray):
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
    for name, info in src.tensors.items():
        if name == "blk.1.ffn_up.weight":  # Q2_K: 84 bytes per 256 values
            rows, cols = info.shape
            w.add_tensor(name, np.zeros((rows, cols // 256 * 84), dtype=np.uint8), raw_shape=(rows, cols // 256 * 84),
                         raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        else:
            w.add_tensor(name, to_float(src.raw(name), info.ggml_type, info.shape).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up\.weight' has type Q2_K.*supported types: F32, F16, "
                                         r"BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K"):
        load_model(out, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())


def test_bad_files_are_value_errors_naming_the_file(tiny_gguf, tmp_path):
    missing = tmp_path / "none.gguf"
    with pytest.raises(ValueError, match="does not exist"):
        model_config(missing)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        model_config(not_gguf)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        model_config(empty)
    good = tiny_gguf("Q4_0").read_bytes()
    header_cut = tmp_path / "cut-header.gguf"
    header_cut.write_bytes(good[:2000])
    with pytest.raises(ValueError, match="truncated"):
        model_config(header_cut)
    data_cut = tmp_path / "cut-data.gguf"
    data_cut.write_bytes(good[:-100])
    with pytest.raises(ValueError, match="tensor 'output.weight': truncated"):
        model_config(data_cut)
    with pytest.raises(ValueError, match="model: .*cut-data.gguf"):
        LLM(str(data_cut))


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    out = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(out), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2'.*supported: llama, qwen2, qwen3, gemma2, .*deepseek2"):
        ModelConfig.from_pretrained(out)


# -------------------------------------------------------------------------------- real model


def test_real_smollm2_q4_1_matches_transformers_and_answers(smollm2):
    """The shipped Q4_1 file, its 4-bit layers kept quantized (torch's int4 CPU kernel): greedy
    tokens equal transformers' on the float32 weights it dequantized from the same file, except
    where the oracle's own top two logits are a near tie (then the rest of that sequence is not
    compared); and a chat question gets the right answer."""
    import transformers
    from test_engine_parity import hf_greedy

    llm = LLM(str(smollm2.gguf), max_model_len=512)
    assert llm.engine.quantization == "gguf"
    tok = llm.get_tokenizer()
    texts = ["The capital of Germany is", "def fibonacci(n):", "Once upon a time, a little robot",
             "Water boils at"]
    prompts = [tok.encode(t) for t in texts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    expected = hf_greedy(smollm2.hf_dir, prompts, [16] * len(prompts))
    oracle = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2.hf_dir), dtype=torch.float32)
    exact = 0
    for prompt, out, want in zip(prompts, outs, expected):
        got = list(out.outputs[0].token_ids)
        i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if i is None:
            assert got == want
            exact += 1
            continue
        with torch.no_grad():
            logits = oracle(torch.tensor([prompt + want[:i]])).logits[0, -1]
        margin = (logits[want[i]] - logits[got[i]]).item()
        assert margin < 0.15, f"{tok.decode(prompt)!r}: token {i} differs with a logit margin of {margin:.3f}"
    assert exact >= len(prompts) - 1
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"


def test_serve_a_fetched_gguf_directory_over_the_openai_api(tiny_gguf, tmp_path):
    """`kvserve serve DIR` where DIR holds one .gguf (what `kvserve agent fetch` of a GGUF
    source leaves): the chat template from the file renders the messages, greedy output equals
    the offline engine's."""
    import shutil

    import openai
    from server_helpers import http, wait_until

    from kvserve.runtime.server.main import ServerThread

    model_dir = tmp_path / "models" / "tiny"
    model_dir.mkdir(parents=True)
    shutil.copyfile(tiny_gguf("Q4_0"), model_dir / "tiny.Q4_0.gguf")
    srv = ServerThread([str(model_dir), "--served-model-name", "tiny", "--num-kv-blocks", "64",
                        "--max-model-len", "256", "--port", "0"])
    srv.start()
    try:
        wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Hello"}]
        got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    finally:
        assert srv.stop() == 0
    offline = LLM(str(model_dir / "tiny.Q4_0.gguf"), num_kv_blocks=64).chat(
        messages, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert got.choices[0].message.content == offline.text
    assert got.usage.completion_tokens == len(offline.token_ids)
