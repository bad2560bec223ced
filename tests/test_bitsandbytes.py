"""Pre-quantized bitsandbytes checkpoints (``quant_method: bitsandbytes``), written by transformers
+ bitsandbytes on the CPU from a tiny random model: NF4 with double quantization, FP4 without,
LLM.int8. The 4-bit decoding against bitsandbytes' own dequantizer, bit for bit; logits against
transformers on the dequantized weights (float32), and against transformers + bitsandbytes
itself (whose CPU matmuls round activations, so within a bound); one layer against
dequantize-then-matmul in float64; the engine, tensor parallelism, and the refusals."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.attention.torch_backend import TorchAttentionBackend
from kvserve.runtime.models import load_model

bnb = pytest.importorskip("bitsandbytes")

PROMPT = [1, 5, 77, 300, 12, 9, 400, 33, 250, 7, 64, 128]
# Rows of 128: whole 64-value blocks per row, and 256-block nested groups that straddle rows.
MODEL = dict(hidden_size=128, intermediate_size=256)
KINDS = {
    "nf4-dq": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_factory):
    """kind -> (bitsandbytes checkpoint dir, its source dir), written once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    src = tiny_model_factory("llama", **MODEL)
    root = tmp_path_factory.mktemp("bnb")
    built = {}

    def get(kind: str) -> pathlib.Path:
        if kind not in built:
            qc = BitsAndBytesConfig(**KINDS[kind], bnb_4bit_compute_dtype=torch.float32)
            model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=qc, device_map="cpu",
                                                         dtype=torch.float32)
            model.save_pretrained(root / kind)
            AutoTokenizer.from_pretrained(str(src)).save_pretrained(root / kind)
            built[kind] = root / kind
        return built[kind]

    get.src = src
    return get


def _tensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def dequantized_state(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """The checkpoint's float weights, decoded by bitsandbytes itself (4-bit) or w = code * SCB / 127."""
    from bitsandbytes.functional import QuantState, dequantize_4bit

    tensors = _tensors(path)
    out = {}
    for name, t in tensors.items():
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight"):
            continue
        extras = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        if extras:
            state = QuantState.from_dict(extras, device=torch.device("cpu"))
            out[name] = dequantize_4bit(t, state).float()
        elif f"{prefix}.SCB" in tensors:
            out[name] = t.float() * tensors[f"{prefix}.SCB"][:, None] / 127
        else:
            out[name] = t.float()
    return out


def our_logits(path, prompt=PROMPT) -> torch.Tensor:
    model = load_model(path, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
    n = len(prompt)
    kv = [tuple(torch.zeros(model.kv_cache_shape(1, 16)) for _ in range(2)) for _ in model.layers]
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=torch.arange(n),
                             max_query_len=n, max_seq_len=n)
    return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), kv, meta))


def oracle_logits(src: pathlib.Path, state: dict, prompt=PROMPT) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("kind", ["nf4-dq", "fp4"])
def test_4bit_decoding_is_bitsandbytes_dequantization(checkpoints, kind):
    from bitsandbytes.functional import QuantState
    from bitsandbytes.functional import dequantize_4bit as bnb_dequantize

    from kvserve.runtime.models.quantization.bitsandbytes import dequantize_4bit

    tensors = _tensors(checkpoints(kind))
    name = "model.layers.1.mlp.down_proj.weight"
    extras = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
    state_key = next(k for k in extras if k.startswith("quant_state."))
    state = json.loads(bytes(extras[state_key].tolist()))
    assert ("nested_blocksize" in state) == (kind == "nf4-dq")
    ours = dequantize_4bit(tensors[name], extras["absmax"], extras["quant_map"], state,
                           extras.get("nested_absmax"), extras.get("nested_quant_map"))
    want = bnb_dequantize(tensors[name], QuantState.from_dict(extras, device=torch.device("cpu")))
    assert torch.equal(ours, want.float())


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_match_transformers_on_the_dequantized_weights(checkpoints, kind):
    path = checkpoints(kind)
    torch.testing.assert_close(our_logits(path), oracle_logits(checkpoints.src, dequantized_state(path)),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind, bound", [("nf4-dq", 0.03), ("int8", 0.06)])
def test_logits_close_to_transformers_with_bitsandbytes(checkpoints, kind, bound):
    """transformers running the checkpoint through bitsandbytes' CPU matmuls: the 4-bit one
    rounds activations (about 1% of the largest logit here), LLM.int8 casts them to float16 and
    splits outlier columns off (about 3%); the runtime multiplies by the exact dequantized weight."""
    from transformers import AutoModelForCausalLM

    path = checkpoints(kind)
    ref = AutoModelForCausalLM.from_pretrained(str(path), device_map="cpu", dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    assert (our_logits(path) - want).abs().max() < bound * want.abs().max()


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "torch-twin"])
def test_held_forms_and_float64_layer_parity(checkpoints, monkeypatch, native):
    """4-bit layers hold their codes packed with a float32 absmax per block (a fused layer's parts
    stacked), whose dequantization is bitsandbytes' bit for bit and whose matmul equals
    dequantize-then-matmul in float64, at 0.5 + 4 / 64 bytes per weight; with keep_packed off
    they hold the dequantized weight. 8-bit ones hold an Int8Weight; an 8-bit layer's output
    equals x @ W.T in float64 with W = code * SCB / 127."""
    from kvserve.kernels.cpu import native as native_kernels
    from kvserve.runtime.models.quantization.bitsandbytes import BnB4bitMethod, BnB8bitMethod
    from kvserve.runtime.models.quantization.bnb4 import Packed4bitWeight
    from kvserve.runtime.models.quantization.packed import Int8Weight, set_cpu_native

    if native and not native_kernels.available():
        pytest.skip(f"native CPU kernels: {native_kernels.status()}")
    kw = dict(dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
    set_cpu_native(None if native else False)
    try:
        fours = {kind: load_model(checkpoints(kind), **kw) for kind in ("nf4-dq", "fp4")}
    finally:
        set_cpu_native(None)
    for kind, four in fours.items():
        state = dequantized_state(checkpoints(kind))
        qkv = four.layers[0].self_attn.qkv_proj
        assert type(qkv.quant_method) is BnB4bitMethod and isinstance(qkv.bnb4, Packed4bitWeight)
        assert (qkv.bnb4.native is not None) == native
        want = torch.cat([state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(qkv.bnb4.dequantize(), want)
        assert qkv.bnb4.nbytes == want.numel() * (0.5 + 4 / 64) + 16 * 4
        x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
        ref = x.double() @ want.double().T
        assert (qkv(x).double() - ref).abs().max() < 1e-5 * ref.abs().max()
        assert (qkv(x[:1]).double() - ref[:1]).abs().max() < 1e-5 * ref[:1].abs().max()  # a decode row
    if not native:
        return
    monkeypatch.setattr(BnB4bitMethod, "keep_packed", False)
    four = load_model(checkpoints("nf4-dq"), **kw)
    assert not any(p.dtype == torch.uint8 for p in four.parameters())
    eight = load_model(checkpoints("int8"), dtype=torch.float32, device="cpu",
                       attention_backend=TorchAttentionBackend())
    down = eight.layers[1].mlp.down_proj
    assert type(down.quant_method) is BnB8bitMethod and isinstance(down.int8, Int8Weight)
    state = dequantized_state(checkpoints("int8"))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    want = x.double() @ state["model.layers.1.mlp.down_proj.weight"].double().T
    assert (down(x).double() - want).abs().max() < 1e-5 * want.abs().max()


def test_engine_and_tensor_parallelism(checkpoints):
    """Greedy output through the engine (decode steps in the native one-call stack where it
    builds) equals transformers on the dequantized weights; at
    tensor_parallel_size 2 (each rank keeps its slice of the packed codes: rows of the
    column-parallel layers, whole blocks of the row-parallel ones' columns) it is the same."""
    from transformers import AutoModelForCausalLM

    path = checkpoints("nf4-dq")
    prompt = [1, 40, 41, 42, 300, 17]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(num_kv_blocks=32, block_size=8, dtype="float32", device="cpu")
    with LLM(str(path), **kw) as one:
        assert one.engine.quantization == "bitsandbytes"
        got = one.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        from kvserve.kernels.cpu import native

        if native.available():  # decode steps ran the one-call native stack on the packed 4-bit layers
            assert isinstance(one.engine.model._native_stack, native.DecoderStack)
    with LLM(str(path), tensor_parallel_size=2, **kw) as two:
        got2 = two.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    ref = AutoModelForCausalLM.from_pretrained(str(checkpoints.src), dtype=torch.float32)
    ref.load_state_dict(dequantized_state(path), strict=False)
    x = torch.tensor([prompt])
    want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                        pad_token_id=0)[0, len(prompt):].tolist()
    assert list(got) == want and list(got2) == want


@pytest.mark.parametrize("qc, match", [
    ({"load_in_4bit": True, "load_in_8bit": True}, "exactly one"),
    ({}, "exactly one"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type: 'int4'"),
    ({"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"}, "bnb_4bit_quant_storage"),
    ({"load_in_8bit": True, "llm_int8_has_fp16_weight": True}, "llm_int8_has_fp16_weight"),
])
def test_unsupported_settings_name_the_field(qc, match):
    from kvserve.runtime.weight_formats.bitsandbytes import BitsAndBytesFormat

    with pytest.raises(ValueError, match=f"quantization_config.*{match}"):
        BitsAndBytesFormat.from_config({"quant_method": "bitsandbytes", **qc})


def test_a_checkpoint_missing_its_quant_state_is_refused(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import save_file

    path = checkpoints("nf4-dq")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = {k: v for k, v in _tensors(path).items() if "layers.0.self_attn.q_proj.weight.absmax" not in k}
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights \(quantization bitsandbytes\).*q_proj.weight.absmax"):
        load_model(broken, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
