"""DeepSeek-V3's MTP layer as a speculative proposer (speculative_config method "mtp").

A tiny random DeepSeek-V3 checkpoint gets an MTP module in the published layout
(model.layers.{L}.enorm / hnorm / eh_proj / shared_head / a decoder block with MLA + MoE). The
layer's forward, through the paged latent pool and the chain's scratch blocks, must equal a
float64 reference written from the published formula around transformers' own DeepSeek-V3
decoder layer; greedy output with MTP drafts must equal greedy output without speculation.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_spec_decode import GREEDY, grounded_prompts, make_engine, run_checked  # noqa: E402

from kvserve.runtime.spec_decode import SpeculativeConfig
from kvserve.testing.mtp_layers import add_mtp_layer  # noqa: F401  (test modules import it from here)


@pytest.fixture(scope="module")
def tiny_dsv3(tiny_model_factory):
    return tiny_model_factory("deepseek_v3")


@pytest.fixture(scope="module")
def dsv3_mtp(tiny_dsv3, tmp_path_factory):
    return add_mtp_layer(tiny_dsv3, tmp_path_factory.mktemp("mtp") / "random")


def test_config_names():
    cfg = SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2})
    assert (cfg.method, cfg.model) == ("mtp", None)
    assert SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method == "mtp"
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig.parse({"method": "mtp", "model": 3, "num_speculative_tokens": 1})


def _rms64(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_layer_matches_float64_reference(dsv3_mtp):
    """Fill slots 0..T-1 (paged, scattered blocks), then two chain steps on scratch blocks:
    every output row equals the published formula in float64 around transformers' decoder
    layer (the MTP's layer index, loaded by transformers from the same file)."""
    import transformers

    from kvserve.runtime.attention.torch_backend import TorchAttentionBackend
    from kvserve.runtime.model_config import ModelConfig
    from kvserve.runtime.models import load_model
    from kvserve.runtime.spec_decode.mtp import MTPProposer, load_mtp_layer

    cfg = ModelConfig.from_pretrained(dsv3_mtp)
    backend = TorchAttentionBackend()
    target = load_model(dsv3_mtp, dtype=torch.float32, device="cpu", attention_backend=backend, config=cfg)
    layer = load_mtp_layer(dsv3_mtp, cfg, backend, dtype=torch.float32, device="cpu")
    # The layer's copies of the embedding and head equal the target's: shared, not kept twice.
    bs, T = 4, 7
    proposer = MTPProposer(layer, target, num_blocks=16, block_size=bs, max_num_seqs=2, num_speculative_tokens=3)
    assert layer.embed is None and layer.head is None
    torch.manual_seed(0)
    tokens = torch.randint(3, 500, (T + 2,))
    features = torch.randn(T, cfg.hidden_size)
    table = [9, 2]  # positions 0..7; the chain's first position, 7, sits in block 2's last slot
    out = proposer._forward([table], [0], [T], tokens[:T], features)
    # Two chain steps as _chain runs them: positions 7 and 8 on scratch blocks.
    scratch = [16, 17]
    proposer.pool[scratch[0]] = proposer.pool[table[1]]
    chain_table = [table[0]] + scratch
    c1 = proposer._forward([chain_table], [T], [1], tokens[T:T + 1], out[T - 1:T])
    c2 = proposer._forward([chain_table], [T + 1], [1], tokens[T + 1:T + 2], c1)
    ours = torch.cat((out, c1, c2))

    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        dsv3_mtp, num_hidden_layers=cfg.num_layers + 1, dtype=torch.float64, attn_implementation="eager",
        experts_implementation="eager").eval()
    block = hf.model.layers[cfg.num_layers]
    sd = load_file(str(dsv3_mtp / "model.safetensors"))
    pre = f"model.layers.{cfg.num_layers}."
    w = {k[len(pre):]: v.double() for k, v in sd.items() if k.startswith(pre)}
    eps = cfg.rms_norm_eps
    # The reference chains like the proposer: rows T, T+1 take the previous row's output as
    # their feature, so it runs once per chain row over the growing prefix.
    with torch.no_grad():
        n = T + 2
        pos = torch.arange(n)
        cos_sin = hf.model.rotary_emb(torch.zeros(1, n, 1, dtype=torch.float64), pos[None])
        mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        emb = w["embed_tokens.weight"][tokens[:n]] * (pos != 0)[:, None]  # as vLLM: position 0 sees no token
        feats = list(features.double())
        outs = []
        for upto in range(T, n + 1):
            h = torch.stack(feats + outs[T - 1:upto - 1])
            x = torch.cat((_rms64(emb[:upto], w["enorm.weight"], eps), _rms64(h, w["hnorm.weight"], eps)), -1)
            x = x @ w["eh_proj.weight"].T
            y = block(x[None], attention_mask=mask[..., :upto, :upto], position_ids=pos[None, :upto],
                      position_embeddings=tuple(c[:, :upto] for c in cos_sin))
            outs = list((y[0] if isinstance(y, tuple) else y)[0])
        ref = torch.stack(outs)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-4)
    logits_ref = _rms64(ref, w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T
    assert proposer._argmax(ours) == logits_ref.argmax(-1).tolist()


def test_refusals(tiny_dsv3, tiny_llama, tmp_path):
    from kvserve.runtime import LLMEngine

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"no MTP weights \(model.layers.2"):
        LLMEngine.from_args(model=str(tiny_dsv3), speculative_config=spec, num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="has no MTP layer"):
        LLMEngine.from_args(model=str(tiny_llama), speculative_config=spec, num_kv_blocks=16, block_size=4)
    broken = add_mtp_layer(tiny_dsv3, tmp_path / "broken")
    sd = load_file(str(broken / "model.safetensors"))
    del sd["model.layers.2.eh_proj.weight"]
    save_file(sd, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks model.layers.2.eh_proj.weight"):
        LLMEngine.from_args(model=str(broken), speculative_config=spec, num_kv_blocks=16, block_size=4)


@pytest.fixture(scope="module")
def dsv3_reference(dsv3_mtp):
    outs = run_checked(make_engine(dsv3_mtp), grounded_prompts(), GREEDY)
    return {k: v.outputs[0].token_ids for k, v in outs.items()}


@pytest.mark.parametrize("kind", ["random", "copy"])
def test_greedy_equals_plain(dsv3_mtp, dsv3_reference, tiny_dsv3, tmp_path, kind):
    """Continuous batching with a small pool (preemption and prefix hits): MTP drafts, random
    or accepted, never change greedy output, and every block comes back."""
    model = dsv3_mtp if kind == "random" else add_mtp_layer(tiny_dsv3, tmp_path / "copy", copy=True)
    engine = make_engine(model, {"method": "mtp", "num_speculative_tokens": 3}, num_kv_blocks=48)
    outs = run_checked(engine, grounded_prompts(), GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == dsv3_reference
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total > 0
    if kind == "copy":
        assert s.spec_decode_num_accepted_tokens_total > 0
        # n > 1: the samples fork after the prompt and each speculates on its own slots.
        engine.add_request("n", grounded_prompts()[0], GREEDY.clone(n=3))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        assert [c.token_ids for c in outs[0].outputs] == [dsv3_reference["r0"]] * 3
        assert engine.block_manager.num_used_blocks == 0


def test_mtp_layer_from_its_own_directory(tiny_dsv3, dsv3_mtp, dsv3_reference, tmp_path):
    """`model` names a directory holding only the MTP layer (same names): the target's own
    checkpoint has none."""
    own = tmp_path / "nextn"
    own.mkdir()
    sd = load_file(str(dsv3_mtp / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k.startswith("model.layers.2.")}, str(own / "model.safetensors"))
    shutil.copy(dsv3_mtp / "config.json", own / "config.json")
    engine = make_engine(tiny_dsv3, {"method": "mtp", "model": str(own), "num_speculative_tokens": 2},
                         num_kv_blocks=48)
    outs = run_checked(engine, grounded_prompts()[:3], GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == {k: dsv3_reference[k] for k in outs}
    assert engine.get_stats().spec_decode_num_drafts_total > 0
