"""EAGLE / EAGLE-3 draft heads: checkpoint layouts, the draft layer against transformers' Llama
decoder layer, refusals, and the engine's greedy exactness with the heads proposing.

The head only proposes; the target verifies, so greedy output with a head (random or trained)
must equal greedy output without one, inside continuous batching with preemption and prefix hits.
"""

from __future__ import annotations

import pytest
import torch
from test_spec_decode import GREEDY, grounded_prompts, make_engine, run_checked  # noqa: E402  (tests/ is on sys.path via conftest)

from kvserve.runtime import SamplingParams
from kvserve.runtime.spec_decode import SpeculativeConfig
from kvserve.runtime.spec_decode.eagle import EagleHead, EagleProposer, load_eagle_head, save_eagle_head

H, VOCAB = 64, 512
DIMS = dict(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-6)


def random_head(eagle3=False, *, seed=0, draft_vocab=None, input_norm=False, std=0.05) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(eagle3=eagle3, fc_bias=not eagle3, input_norm=input_norm, draft_vocab_size=draft_vocab, **DIMS)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 1 and "bias" not in name:
                p.uniform_(0.8, 1.2)  # norms
            else:
                p.normal_(0, std)
    if draft_vocab:
        # Draft id d stands for target token 2d + 1 (a sparse map, as trained heads have).
        head.d2t = torch.arange(draft_vocab) + 1
    return head


def target_copy_head() -> EagleHead:
    """fc passes the target's feature through and the layer adds nothing: the head's output is
    the target's own hidden state, so it guesses the token the target just produced again (a
    model that repeats itself gets drafts accepted)."""
    head = random_head()
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, H:] = torch.eye(H)
        head.fc.bias.zero_()
        head.o_proj.weight.zero_()
        head.down_proj.weight.zero_()
    return head


def base_config():
    return {"num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "intermediate_size": 96}


def test_config_methods():
    for method in ("eagle", "eagle3"):
        cfg = SpeculativeConfig.parse({"method": method, "model": "/h", "num_speculative_tokens": 2})
        assert (cfg.method, cfg.model) == (method, "/h")
        with pytest.raises(ValueError, match="speculative_config.model: a EAGLE head directory is required"):
            SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 2})


def test_layouts_round_trip_and_vllm_prefix(tmp_path):
    emb, feat = torch.randn(5, H), torch.randn(5, 3 * H)
    for eagle3, name in ((False, "eagle"), (True, "eagle3")):
        head = random_head(eagle3, draft_vocab=200 if eagle3 else None)
        path = save_eagle_head(head, tmp_path / name, base_config=base_config(), aux_layers=(1, 1, 2) if eagle3 else ())
        f = feat if eagle3 else feat[:, :H]
        loaded, aux = load_eagle_head(path, method=name, hidden_size=H, vocab_size=VOCAB, dtype=torch.float32,
                                      device="cpu")
        assert aux == ((1, 1, 2) if eagle3 else ())
        for a, b in zip(head.layer_input(emb, f), loaded.layer_input(emb, f)):
            assert torch.equal(a, b)
        if eagle3:
            assert torch.equal(loaded.d2t, head.d2t)
    # EAGLE-1's original files: pytorch_model.bin, vLLM's converted ones carry a model. prefix.
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    (tmp_path / "bin").mkdir()
    torch.save({f"model.{k}": v for k, v in t.items()}, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "eagle" / "config.json").read_text())
    loaded, _ = load_eagle_head(tmp_path / "bin", method="eagle", hidden_size=H, vocab_size=VOCAB,
                                dtype=torch.float32, device="cpu")
    assert torch.equal(loaded.fc.bias, t["fc.bias"])


def test_draft_layer_matches_transformers_llama_layer():
    """Filling slots 0..n-1 and reading the last one's output equals transformers' LlamaDecoderLayer
    run causally over fc(concat(embedding, feature)) with the same weights and RoPE."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    head = random_head(input_norm=True, std=0.2)
    cfg = LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=96, rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).weight.copy_(getattr(head, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(head, name).weight)
        layer.input_layernorm.weight.copy_(head.input_layernorm)
        layer.post_attention_layernorm.weight.copy_(head.post_attention_layernorm)

    class Target:  # the parts of the target model the proposer borrows
        embed = torch.nn.Embedding(VOCAB, H)
        lm_head = torch.randn(VOCAB, H)
        dtype = torch.float32
        cos_sin_cache = None

        def embed_tokens(self, ids):
            return self.embed(ids)

        def compute_logits(self, x):
            return x @ self.lm_head.T

    target = Target()
    rope = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(64)[None]
    cos, sin = rope(torch.zeros(1, 64, H), pos)
    target.cos_sin_cache = torch.cat((cos[0, :, :8], sin[0, :, :8]), dim=-1)

    n = 11
    tokens = torch.randint(0, VOCAB, (n,))
    features = torch.randn(n, H)
    proposer = EagleProposer(head, target, num_blocks=8, block_size=4)
    table = [5, 2, 7]
    drafts = proposer.step([(table, list(range(n)), tokens.tolist(), features)], [2])
    with torch.no_grad():
        x = head.fc(torch.cat((target.embed(tokens), features), -1))[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=pos[:, :n],
                    position_embeddings=(cos[:, :n], sin[:, :n]))
        out = out[0] if isinstance(out, tuple) else out
        first = int(target.compute_logits(out[0, -1]).argmax())
        # The chain's second step: the head's own output as the feature at position n.
        x2 = head.fc(torch.cat((target.embed(torch.tensor([first])), out[0, -1:]), -1))
        out2 = layer(torch.cat((x, x2[None]), 1), attention_mask=torch.full((n + 1, n + 1), float("-inf")).triu(1)[None, None],
                     position_ids=pos[:, :n + 1], position_embeddings=(cos[:, :n + 1], sin[:, :n + 1]))
        out2 = out2[0] if isinstance(out2, tuple) else out2
        second = int(target.compute_logits(out2[0, -1]).argmax())
    assert drafts == [[first, second]]


def test_bad_heads_are_refused(tmp_path, tiny_llama):
    save_eagle_head(random_head(True, draft_vocab=200), tmp_path / "e3", base_config=base_config())
    with pytest.raises(ValueError, match=r"no eagle head .*looks like the other layout, midlayer"):
        load_eagle_head(tmp_path / "e3", method="eagle", hidden_size=H, vocab_size=VOCAB, dtype=torch.float32,
                        device="cpu")
    with pytest.raises(ValueError, match="the head's hidden size is 64, the target's 32"):
        load_eagle_head(tmp_path / "e3", method="eagle3", hidden_size=32, vocab_size=VOCAB, dtype=torch.float32,
                        device="cpu")
    bad = random_head(True, draft_vocab=200)
    bad.d2t = torch.full((200,), VOCAB)
    save_eagle_head(bad, tmp_path / "d2t", base_config=base_config())
    with pytest.raises(ValueError, match="d2t maps outside the target's 512 tokens"):
        load_eagle_head(tmp_path / "d2t", method="eagle3", hidden_size=H, vocab_size=VOCAB, dtype=torch.float32,
                        device="cpu")
    # The tiny Llama has 2 layers: vLLM's default layers (2, 1, -1) do not exist there.
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        make_engine(tiny_llama, {"method": "eagle3", "model": str(tmp_path / "e3"), "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama):
    outs = run_checked(make_engine(tiny_llama), grounded_prompts(), GREEDY)
    return {k: v.outputs[0].token_ids for k, v in outs.items()}


@pytest.mark.parametrize("kind", ["eagle_random", "eagle_target_copy", "eagle3_random"])
def test_greedy_with_head_equals_greedy_without(tiny_llama, greedy_reference, tmp_path, kind):
    method = kind.split("_")[0]
    head = {"eagle_random": lambda: random_head(), "eagle_target_copy": target_copy_head,
            "eagle3_random": lambda: random_head(True, draft_vocab=200)}[kind]()
    path = save_eagle_head(head, tmp_path / kind, base_config=base_config(),
                           aux_layers=(1, 2, 2) if method == "eagle3" else ())
    # Small pool: preemption and prefix-cache hits happen along the way.
    engine = make_engine(tiny_llama, {"method": method, "model": str(path), "num_speculative_tokens": 3},
                         num_kv_blocks=48)
    outs = run_checked(engine, grounded_prompts(), GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == greedy_reference
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total > 0
    if kind == "eagle_target_copy":
        assert s.spec_decode_num_accepted_tokens_total > 0
    if method == "eagle3":
        assert engine.executor.driver_worker.model.aux_hidden_layers == (0, 1)


def test_sampling_and_structured_outputs_with_head(tiny_llama, tmp_path):
    """Greedy with a grammar equals plain decoding with it (drafts the grammar refuses are cut);
    temperature > 0 goes through the rejection sampler over the masked distribution."""
    import re

    from kvserve.runtime import LLM
    from kvserve.runtime.structured_outputs.params import StructuredOutputsParams as so

    path = save_eagle_head(target_copy_head(), tmp_path / "h", base_config=base_config())
    prompts = ["ab ab ab ab ab", "Hello world"]
    grammar = "(ab ){3,12}(cd ){3,12}"
    greedy = [SamplingParams(structured_outputs=so(regex=grammar), temperature=0, max_tokens=60),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    with LLM(str(tiny_llama), num_kv_blocks=64, max_model_len=512) as m:
        plain = m.generate(prompts, greedy, use_tqdm=False)
    with LLM(str(tiny_llama), num_kv_blocks=64, max_model_len=512,
             speculative_config={"method": "eagle", "model": str(path), "num_speculative_tokens": 3}) as m:
        spec = m.generate(prompts, greedy, use_tqdm=False)
        sampled = m.generate(["ab ab ab ab"] * 2, SamplingParams(structured_outputs=so(regex=grammar), seed=9,
                                                                 max_tokens=60), use_tqdm=False)
        stats = m.engine.get_stats()
        assert m.engine.block_manager.num_used_blocks == 0
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    for o in sampled + spec[:1]:
        assert re.fullmatch(grammar, o.outputs[0].text), o.outputs[0]
    assert stats.spec_decode_num_drafts_total > 0


def test_forked_samples_get_their_own_first_slot(tiny_llama, tmp_path):
    """n > 1: the samples fork off sample 0 after the prompt; each one's slot at the prompt's
    last position pairs the prompt's feature with *its own* first token (as a request whose
    prompt ended with that token has it), and the forks speculate."""
    path = save_eagle_head(random_head(seed=3), tmp_path / "h", base_config=base_config())
    spec = {"method": "eagle", "model": str(path), "num_speculative_tokens": 2}
    prompt = list(range(40, 50))  # P = 10: the last slot's block (4 slots) is not full
    P = len(prompt)

    def slot(engine, seq):
        table = engine.block_manager.get_block_table(seq.seq_id)
        return engine.spec_decoder.eagle.k_pool[table[(P - 1) // 4] * 4 + (P - 1) % 4].clone()

    engine = make_engine(tiny_llama, spec, block_size=4)
    engine.add_request("n", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))
    seen = {}
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.num_computed_tokens > P:  # the sample's first decode step has run
                seen[seq.seq_id] = (seq.token_ids[P], slot(engine, seq))
    assert len(seen) == 4 and len({t for t, _ in seen.values()}) > 1
    assert engine.get_stats().spec_decode_num_drafts_total >= 4
    for first, got in seen.values():
        ref = make_engine(tiny_llama, spec, block_size=4)
        ref.add_request("r", prompt + [first], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        ref.step()
        torch.testing.assert_close(got, slot(ref, ref.scheduler.running[0]), rtol=1e-4, atol=1e-5)


def test_eagle_through_the_server_with_the_openai_client(tiny_llama, tmp_path):
    """`kvserve serve --speculative-config '{"method": "eagle", ...}'`: completions equal the
    offline engine's greedy text without speculation, drafts counted on /metrics."""
    from server_helpers import m, metrics
    from spec_server import plain_greedy_texts, spec_server

    path = save_eagle_head(target_copy_head(), tmp_path / "h", base_config=base_config())
    prompts = grounded_prompts(n=3)
    want = plain_greedy_texts(tiny_llama, prompts)
    with spec_server(tiny_llama, {"method": "eagle", "model": str(path), "num_speculative_tokens": 3}) as (url, client):
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
        assert got == want
        assert m(metrics(url), "vllm:spec_decode_num_drafts_total") > 0


def test_real_smollm2_greedy_with_random_heads_equals_plain(smollm2, tmp_path):
    """The real SmolLM2 (tied embeddings, 9 heads / 3 KV heads): greedy text with a random EAGLE-1
    head and a random EAGLE-3 head (layers 2, 15, 27 by vLLM's default) equals plain greedy."""
    from kvserve.runtime import LLM

    dims = dict(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=128, rms_norm_eps=1e-5)
    cfg = {"num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "intermediate_size": 128}
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    small = dict(dtype="float32", max_model_len=128, block_size=16, num_kv_blocks=24)
    with LLM(str(smollm2.hf_dir), **small) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for method in ("eagle", "eagle3"):
        torch.manual_seed(0)
        head = EagleHead(eagle3=method == "eagle3", draft_vocab_size=4096 if method == "eagle3" else None, **dims)
        with torch.no_grad():
            for p in head.parameters():
                p.normal_(0, 0.02)
        if method == "eagle3":
            head.d2t = torch.arange(4096) * 11
        path = save_eagle_head(head, tmp_path / method, base_config=cfg)
        spec = {"method": method, "model": str(path), "num_speculative_tokens": 3}
        with LLM(str(smollm2.hf_dir), **small, speculative_config=spec) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert llm.engine.get_stats().spec_decode_num_drafts_total > 0
        assert got == want, method
