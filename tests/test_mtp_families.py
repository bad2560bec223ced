"""MTP beyond DeepSeek-V3: the target family's own decoder layer as the MTP block, with K/V pools.

- MiMo (Xiaomi's MiMo-7B: `MiMoForCausalLM`, Qwen2's model + `model.mtp_layers.0.*`): served as
  Qwen2; its MTP module (token_layernorm, hidden_layernorm, input_proj over [feature ; embedding],
  a Qwen2 decoder block, final_layernorm, the target's head) drafts for `method: "mtp"`. Its
  forward through the paged pools and the chain's scratch blocks equals a float64 reference of
  the published formula around transformers' own Qwen2 decoder layer.
- A GQA family in DeepSeek's layout (`model.layers.{L}.enorm/hnorm/eh_proj/shared_head`, as
  GLM-4.5 keeps it), here on a Llama target.
Greedy output with MTP drafts equals greedy output without, and every block comes back.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_mtp import _rms64, add_mtp_layer
from test_spec_decode import GREEDY, grounded_prompts, make_engine, run_checked  # noqa: E402


def mimo_checkpoint(src, dst, *, copy: bool = False, seed: int = 0):
    """A tiny Qwen2 checkpoint made MiMo: the config names MiMoForCausalLM, and one MTP module
    under model.mtp_layers.0 (random; `copy`: the block adds nothing and input_proj passes the
    feature through, so drafts repeat the target's own next-token guess)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(dst / "model.safetensors"))
    H, n = config["hidden_size"], config["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{n - 1}.", "model.mtp_layers.0."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            new = 1.0 + 0.1 * torch.randn(t.shape, generator=gen) if name.endswith("norm.weight") else \
                0.05 * torch.randn(t.shape, generator=gen)
            if copy and (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")):
                new = torch.zeros(t.shape)
            tensors[mtp + name[len(last):]] = new.to(t.dtype).contiguous()
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        tensors[f"{mtp}{norm}.weight"] = (torch.ones(H) if copy and norm != "token_layernorm"
                                          else 1.0 + 0.1 * torch.randn(H, generator=gen))
    # MiMo's input_proj reads [feature ; embedding]
    tensors[mtp + "input_proj.weight"] = (torch.cat((torch.eye(H), torch.zeros(H, H)), dim=1) if copy
                                          else 0.1 * torch.randn(H, 2 * H, generator=gen))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def mimo(tiny_qwen2, tmp_path_factory):
    return mimo_checkpoint(tiny_qwen2, tmp_path_factory.mktemp("mimo") / "random")


def test_mimo_is_served_as_qwen2_and_its_mtp_layer_matches_a_float64_reference(mimo):
    import transformers

    from kvserve.runtime.attention.torch_backend import TorchAttentionBackend
    from kvserve.runtime.model_config import ModelConfig
    from kvserve.runtime.models import load_model
    from kvserve.runtime.spec_decode.mtp import MTPProposer, load_mtp_layer

    cfg = ModelConfig.from_pretrained(mimo)
    assert cfg.architecture == "Qwen2ForCausalLM"
    backend = TorchAttentionBackend()
    target = load_model(mimo, dtype=torch.float32, device="cpu", attention_backend=backend, config=cfg)
    layer = load_mtp_layer(mimo, cfg, backend, dtype=torch.float32, device="cpu")
    bs, T = 4, 7
    proposer = MTPProposer(layer, target, num_blocks=16, block_size=bs, max_num_seqs=2, num_speculative_tokens=3)
    assert len(proposer.pools) == 2  # K and V
    torch.manual_seed(0)
    tokens = torch.randint(3, 500, (T + 2,))
    features = torch.randn(T, cfg.hidden_size)
    table = [9, 2]
    out = proposer._forward([table], [0], [T], tokens[:T], features)
    scratch = [16, 17]
    for pool in proposer.pools:
        pool[scratch[0]] = pool[table[1]]
    chain_table = [table[0]] + scratch
    c1 = proposer._forward([chain_table], [T], [1], tokens[T:T + 1], out[T - 1:T])
    c2 = proposer._forward([chain_table], [T + 1], [1], tokens[T + 1:T + 2], c1)
    ours = torch.cat((out, c1, c2))

    hf_cfg = transformers.Qwen2Config.from_pretrained(mimo)
    hf_cfg._attn_implementation = "eager"
    block = transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer(hf_cfg, layer_idx=0).double().eval()
    sd = load_file(str(mimo / "model.safetensors"))
    pre = "model.mtp_layers.0."
    w = {k[len(pre):]: v.double() for k, v in sd.items() if k.startswith(pre)}
    block.load_state_dict({k: v for k, v in w.items()
                           if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})
    rotary = transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding(hf_cfg)
    eps = cfg.rms_norm_eps
    with torch.no_grad():
        n = T + 2
        pos = torch.arange(n)
        cos_sin = rotary(torch.zeros(1, n, 1, dtype=torch.float64), pos[None])
        cos_sin = tuple(c.double() for c in cos_sin)
        mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        emb = sd["model.embed_tokens.weight"].double()[tokens[:n]] * (pos != 0)[:, None]
        feats = list(features.double())
        outs = []
        for upto in range(T, n + 1):
            h = torch.stack(feats + outs[T - 1:upto - 1])
            x = torch.cat((_rms64(h, w["hidden_layernorm.weight"], eps), _rms64(emb[:upto], w["token_layernorm.weight"],
                                                                                 eps)), -1)
            x = x @ w["input_proj.weight"].T
            y = block(x[None], attention_mask=mask[..., :upto, :upto], position_ids=pos[None, :upto],
                      position_embeddings=tuple(c[:, :upto] for c in cos_sin))
            outs = list((y[0] if isinstance(y, tuple) else y)[0])
        ref = torch.stack(outs)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-4)
    logits_ref = _rms64(ref, w["final_layernorm.weight"], eps) @ sd["lm_head.weight"].double().T
    assert proposer._argmax(ours) == logits_ref.argmax(-1).tolist()


@pytest.mark.parametrize("layout", ["mimo", "deepseek-layout-llama"])
def test_greedy_with_mtp_drafts_equals_plain(tiny_qwen2, tiny_model_factory, tmp_path, layout):
    if layout == "mimo":
        model = mimo_checkpoint(tiny_qwen2, tmp_path / "copy", copy=True)
    else:
        model = add_mtp_layer(tiny_model_factory("llama"), tmp_path / "copy", copy=True)
    want = run_checked(make_engine(model), grounded_prompts(n=5), GREEDY)
    engine = make_engine(model, {"method": "mtp", "num_speculative_tokens": 2}, num_kv_blocks=48)
    got = run_checked(engine, grounded_prompts(n=5), GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in want.items()}
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total > 0 and s.spec_decode_num_accepted_tokens_total > 0
    assert engine.block_manager.num_used_blocks == 0


def test_families_without_an_mtp_layout_are_refused(tiny_model_factory, tmp_path):
    from kvserve.runtime import LLMEngine

    gemma = tiny_model_factory("gemma2")
    config = json.loads((gemma / "config.json").read_text())
    (tmp_path / "g").mkdir()
    for f in gemma.iterdir():
        shutil.copy(f, tmp_path / "g" / f.name)
    (tmp_path / "g" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match="'mtp' needs a DeepSeek-V3, GLM-4.5 or MiMo-style MTP layer"):
        LLMEngine.from_args(model=str(tmp_path / "g"), speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                            num_kv_blocks=16, block_size=4)
