"""Our model implementations against transformers (the oracle), through the paged KV cache.

For each architecture and config option: logits of (a) a whole prompt in one pass, (b) the same
prompt in chunks, (c) token-by-token decode of several packed sequences with scattered block
tables, all equal transformers' logits in float32.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvserve.runtime.attention import AttentionMetadata, TorchAttentionBackend, get_attention_backend
from kvserve.runtime.model_config import ModelConfig
from kvserve.runtime.models import load_model

ATOL = 1e-4
BLOCK_SIZE = 4

CONFIGS = [
    pytest.param("llama", {}, id="llama-gqa"),
    pytest.param("mistral", {}, id="mistral"),
    pytest.param("qwen2", {}, id="qwen2-bias"),
    pytest.param("qwen3", {}, id="qwen3-qknorm-headdim16"),
    pytest.param("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, vocab_size=509),
                 id="llama-mqa-tied-oddvocab"),
    pytest.param("llama", dict(head_dim=24, num_key_value_heads=4, rope_theta=500000.0, attention_bias=True,
                               mlp_bias=True), id="llama-mha-headdim24-theta-biases"),
    pytest.param("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), id="llama-rope-linear"),
    pytest.param("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                               rope_theta=50000.0), id="llama-rope-llama3"),
    pytest.param("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 256}), id="qwen2-rope-yarn"),
    pytest.param("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True, head_dim=32), id="qwen3-mqa-tied"),
    pytest.param("mistral", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64),
                 id="mistral-rope-dynamic"),
    # Sliding windows shorter than the prompts (11 and 17 tokens) and than some chunks.
    pytest.param("mistral", dict(sliding_window=6), id="mistral-window6"),
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint, a window on every layer.
    pytest.param("phi3", dict(sliding_window=6), id="phi3-fused-window6"),
    # MPT: ALiBi (6 heads: slopes of a non-power-of-two head count), LayerNorms, plain GELU MLP.
    pytest.param("mpt", dict(num_attention_heads=6, hidden_size=96), id="mpt-alibi-6heads"),
    pytest.param("mpt", dict(attn_config={"clip_qkv": 0.3, "softmax_scale": 0.2}), id="mpt-clipqkv-softmaxscale"),
    # BLOOM: ALiBi, head-interleaved fused q|k|v, biases everywhere, a LayerNorm on the embeddings.
    pytest.param("bloom", dict(num_attention_heads=6, hidden_size=96), id="bloom-alibi-6heads"),
    # Falcon's ALiBi variant (Falcon-RW): BLOOM's layout, exact GELU, the biases scaled with the scores.
    # (transformers rounds its ALiBi table to bfloat16: exact at these short positions.)
    pytest.param("falcon", dict(num_attention_heads=6, hidden_size=96), id="falcon-alibi-6heads"),
    pytest.param("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
                 id="qwen2-window5-from-layer1"),
    pytest.param("gemma2", {}, id="gemma2-caps50-30-window8"),
    pytest.param("gemma2", dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5, num_hidden_layers=3,
                                num_key_value_heads=1, sliding_window=3), id="gemma2-tightcaps-mqa-window3"),
    pytest.param("gemma3", dict(num_hidden_layers=4, layer_types=["sliding_attention", "sliding_attention",
                                                                 "full_attention", "sliding_attention"],
                                rope_scaling={"rope_type": "linear", "factor": 4.0}), id="gemma3-local-global-rope"),
    # One layer type at a time: every layer local, every layer global.
    pytest.param("gemma3", dict(layer_types=["sliding_attention"] * 2, sliding_window=5, tie_word_embeddings=False),
                 id="gemma3-all-local-untied"),
    pytest.param("gemma3", dict(layer_types=["full_attention"] * 2), id="gemma3-all-global"),
    # Mixture of experts and MLA: (c) covers MLA's absorbed decode, (a)/(b) its up-projected prefill.
    pytest.param("mixtral", {}, id="mixtral"),
    pytest.param("qwen2_moe", dict(tie_word_embeddings=True), id="qwen2moe-shared-expert-tied"),
    pytest.param("qwen3_moe", {}, id="qwen3moe"),
    pytest.param("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=2, topk_group=1),
                 id="deepseekv2-mla-group-limited"),
    pytest.param("deepseek_v3", dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "mscale": 0.9,
                                                   "mscale_all_dim": 0.7, "original_max_position_embeddings": 32}),
                 id="deepseekv3-mla-yarn-mscale"),
]


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


class PagedCache:
    """A tiny stand-in for the block manager: scattered block ids, packed metadata."""

    def __init__(self, model, num_blocks: int, seed: int = 0):
        shape = model.kv_cache_shape(num_blocks, BLOCK_SIZE)
        pools = model.config.shape.kv_cache_layout(model.tp_size)[0]  # K and V, or one MLA latent
        # NaN-filled so that reading an unwritten slot or padding block shows up in the logits.
        self.caches = [tuple(torch.full(shape, float("nan")) for _ in range(pools))
                       for _ in range(model.config.num_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, model, batch: list[tuple[int, list[int]]], device=torch.device("cpu")) -> torch.Tensor:
        """batch: (seq id, new token ids). Returns logits of every new token, packed."""
        ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for sid, new in batch:
            table = self.tables.setdefault(sid, [])
            start = self.lens.get(sid, 0)
            end = start + len(new)
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids += new
            positions += range(start, end)
            qsl.append(qsl[-1] + len(new))
            seq_lens.append(end)
            tables.append(table)
            self.lens[sid] = end
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(len(n) for _, n in batch),
            max_seq_len=max(seq_lens),
            is_decode_only=all(len(n) == 1 for _, n in batch),
        )
        hidden = model.forward(torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                               self.caches, meta)
        return model.compute_logits(hidden)


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch,overrides", CONFIGS)
def test_logits_match_transformers(tiny_model_factory, arch, overrides):
    model_dir = tiny_model_factory(arch, **overrides)
    hf = _hf(model_dir)
    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=TorchAttentionBackend())
    vocab = model.config.vocab_size
    prompts = _prompts(vocab, [11, 5, 17, 1])
    expected = [_hf_logits(hf, p) for p in prompts]
    assert expected[0].shape[-1] == vocab

    # (a) every prompt whole, all packed into one forward pass
    cache = PagedCache(model, num_blocks=64, seed=1)
    got = cache.step(model, list(enumerate(prompts)))
    assert got.shape == (sum(map(len, prompts)), vocab) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.cat(expected), atol=ATOL, rtol=0)

    # (b) chunked prefill: prompt 0 in chunks of 4, 3, 4 while prompt 2 goes in chunks of 7, 10
    cache = PagedCache(model, num_blocks=64, seed=2)
    pieces = []
    for chunk in ([(0, prompts[0][:4]), (2, prompts[2][:7])], [(0, prompts[0][4:7]), (2, prompts[2][7:])],
                  [(0, prompts[0][7:])]):
        out = cache.step(model, chunk)
        offsets = [0]
        for _, n in chunk:
            offsets.append(offsets[-1] + len(n))
        pieces.append({sid: out[offsets[j]:offsets[j + 1]] for j, (sid, _) in enumerate(chunk)})
    torch.testing.assert_close(torch.cat([p[0] for p in pieces]), expected[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([p[2] for p in pieces if 2 in p]), expected[2], atol=ATOL, rtol=0)

    # (c) several sequences of different lengths decoded together, one token each per step,
    # with a prefill of a new sequence mixed into the second step
    cache = PagedCache(model, num_blocks=64, seed=3)
    seqs = {i: list(p) for i, p in enumerate(prompts[:3])}
    cache.step(model, [(i, s) for i, s in seqs.items()])
    rng = random.Random(4)
    for step in range(4):
        batch = []
        for i in seqs:
            tok = rng.randrange(3, vocab)
            seqs[i].append(tok)
            batch.append((i, [tok]))
        if step == 1:
            seqs[9] = list(prompts[1])
            batch.insert(1, (9, list(prompts[1])))
        out = cache.step(model, batch)
        row = 0
        for sid, new in batch:
            want = _hf_logits(hf, seqs[sid])[-len(new):]
            torch.testing.assert_close(out[row:row + len(new)], want, atol=ATOL, rtol=0)
            row += len(new)


_MANY_DECODES = [(random.Random(i).randrange(0, 40), 1) for i in range(37)]


@pytest.mark.parametrize("plan", [[(9, 1), (5, 6), (0, 7), (13, 1)], _MANY_DECODES + [(3, 5)], _MANY_DECODES],
                         ids=["mixed", "many-decodes-and-a-chunk", "many-decodes-grouped"])
def test_torch_backend_matches_dense_attention(plan):
    """plan: (context already cached, new tokens) per sequence; 16+ decodes take the grouped path."""
    torch.manual_seed(0)
    backend = TorchAttentionBackend()
    heads, kv_heads, d = 6, 2, 8
    num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in plan) + 3
    k_cache = torch.full((num_blocks, BLOCK_SIZE, kv_heads, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    full_k, full_v, tables = [], [], []
    for ctx, new in plan:
        total = ctx + new
        table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        tables.append(table)
        full_k.append(torch.randn(total, kv_heads, d))
        full_v.append(torch.randn(total, kv_heads, d))
        for pos in range(ctx):  # the context written by earlier steps
            b, o = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            k_cache[b, o], v_cache[b, o] = full_k[-1][pos], full_v[-1][pos]
    q_all = [torch.randn(new, heads, d) for _, new in plan]
    key = torch.cat([k[ctx:] for k, (ctx, _) in zip(full_k, plan)])
    value = torch.cat([v[ctx:] for v, (ctx, _) in zip(full_v, plan)])
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, (ctx, new) in zip(tables, plan)
             for p in range(ctx, ctx + new)]
    width = max(map(len, tables))
    qsl = [0]
    for _, new in plan:
        qsl.append(qsl[-1] + new)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in plan], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), max_query_len=max(n for _, n in plan),
        max_seq_len=max(c + n for c, n in plan), is_decode_only=all(n == 1 for _, n in plan),
    )
    backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    out = backend.attend(torch.cat(q_all), key, value, k_cache, v_cache, meta, scale=0.3)

    expected = []
    for (ctx, new), q, k, v in zip(plan, q_all, full_k, full_v):
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
        causal = torch.arange(ctx + new)[None, :] <= (torch.arange(new)[:, None] + ctx)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        expected.append(torch.einsum("hqk,khd->qhd", probs, v))
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
    # the same metadata again (as the next layer would pass it) reuses the plan
    torch.testing.assert_close(backend.attend(torch.cat(q_all), key, value, k_cache, v_cache, meta, scale=0.3),
                               out, atol=0, rtol=0)

    # slot -1 is not written
    before = k_cache.clone()
    backend.write_kv(key[:1], value[:1], k_cache, v_cache, torch.tensor([-1]))
    assert torch.equal(before.nan_to_num(7.0), k_cache.nan_to_num(7.0))


@pytest.mark.parametrize("window", [None, 9])
def test_a_decode_row_attends_alike_in_a_mixed_step_and_a_decode_step(window):
    """Decode rows of a step that also prefills take the decode path of a pure decode step (the
    native kernel on CPU): bit-identical outputs, so sharing a step with a prompt changes nothing."""
    from kvserve.kernels.cpu import native

    torch.manual_seed(1)
    heads, kv_heads, d, blocks = 6, 2, 16, 32
    k_cache, v_cache = torch.randn(blocks, BLOCK_SIZE, kv_heads, d), torch.randn(blocks, BLOCK_SIZE, kv_heads, d)
    decode_lens = [5, 20, 33]  # every position already in the cache, the new token's included
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(3)] + [[30, 31] + [0] * 8]  # padded rows
    prefill_len = 7
    q_decode, q_prefill = torch.randn(3, heads, d), torch.randn(prefill_len, heads, d)
    key, value = torch.randn(prefill_len, kv_heads, d), torch.randn(prefill_len, kv_heads, d)

    def meta(lens, q_lens, rows):
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=torch.tensor([tables[r] for r in rows], dtype=torch.int32),
            slot_mapping=torch.full((starts[-1],), -1), max_query_len=max(q_lens), max_seq_len=max(lens),
            is_decode_only=all(n == 1 for n in q_lens))

    backend = TorchAttentionBackend()
    # Mixed: decode 0, the prompt, decodes 1 and 2.
    mixed_q = torch.cat([q_decode[:1], q_prefill, q_decode[1:]])
    mixed_kv = [torch.cat([torch.zeros(1, kv_heads, d), t, torch.zeros(2, kv_heads, d)]) for t in (key, value)]
    mixed = backend.attend(mixed_q, *mixed_kv, k_cache, v_cache,
                           meta([5, prefill_len, 20, 33], [1, prefill_len, 1, 1], [0, 3, 1, 2]), 0.25,
                           sliding_window=window)
    alone = TorchAttentionBackend().attend(q_decode, q_decode[:, :kv_heads], q_decode[:, :kv_heads], k_cache, v_cache,
                                           meta(decode_lens, [1, 1, 1], [0, 1, 2]), 0.25, sliding_window=window)
    got = mixed[[0, prefill_len + 1, prefill_len + 2]]
    if native.available():
        assert torch.equal(got, alone)
    else:
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


def _write_config(tmp_path, **changes):
    from kvserve.testing.tinymodels import _config  # noqa: PLC0415

    cfg = _config("llama", {}).to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_unsupported_architecture_names_supported(tmp_path):
    _write_config(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_pretrained(tmp_path)


def test_unsupported_rope_type_names_supported(tmp_path):
    _write_config(tmp_path, rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0},
                  rope_scaling=None)
    with pytest.raises(ValueError, match="rope type 'mrope'.*linear.*llama3.*longrope"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("changes,field", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "needs 'factor'"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(torch_dtype="float64", dtype=None), "float64"),
])
def test_unsupported_options_are_named(tmp_path, changes, field):
    _write_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_pretrained(tmp_path)


def test_legacy_rope_fields_and_eos_ids(tmp_path):
    _write_config(tmp_path, rope_parameters=None, rope_theta=12345.0,
                  rope_scaling={"type": "linear", "factor": 2.0}, eos_token_id=[2, 7], torch_dtype="bfloat16")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.rope_theta == 12345.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.eos_token_ids == {2, 7, 9} and cfg.dtype == torch.bfloat16


def test_sliding_window_no_longer_caps_max_model_len(tmp_path):
    _write_config(tmp_path, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=256)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.sliding_window == 256 and cfg.all_layers_sliding
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [256, 256]
    assert cfg.default_max_model_len() == cfg.max_position_embeddings == 2048
    assert cfg.resolve_max_model_len(1024) == 1024


@pytest.mark.parametrize("changes,windows", [
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None), [None, None]),
    # Qwen2/3: only with use_sliding_window, and on layers >= max_window_layers
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=64, use_sliding_window=False),
     [None, None]),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=64, use_sliding_window=True,
          max_window_layers=1, layer_types=None), [None, 64]),
    (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", sliding_window=64, use_sliding_window=True,
          layer_types=["sliding_attention", "full_attention"]), [64, None]),
    # Gemma 2 alternates local/global; Gemma 3 (legacy config) has one global layer every
    # sliding_window_pattern layers.
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=16, layer_types=None,
          num_hidden_layers=4), [16, None, 16, None]),
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=16, layer_types=None,
          sliding_window_pattern=3, num_hidden_layers=7), [16, 16, None, 16, 16, None, 16]),
])
def test_layer_windows_follow_each_family(tmp_path, changes, windows):
    _write_config(tmp_path, **changes)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == windows
    assert cfg.all_layers_sliding == all(w is not None for w in windows)


def test_gemma3_legacy_rope_fields(tmp_path):
    """Gemma 3's original config.json: rope_theta and rope_scaling for the global layers,
    rope_local_base_freq (no scaling) for the local ones."""
    _write_config(tmp_path, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=512,
                  rope_parameters=None, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                  rope_scaling={"rope_type": "linear", "factor": 8.0}, hidden_activation="gelu_pytorch_tanh",
                  query_pre_attn_scalar=256, final_logit_softcapping=None, attn_logit_softcapping=None)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.local_rope == (1e4, None)
    assert cfg.gemma_norms and cfg.qk_norm and cfg.hidden_act == "gelu_tanh" and cfg.query_pre_attn_scalar == 256


@pytest.mark.parametrize("changes,message", [
    (dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", sliding_window=16),
     "Gemma3ForCausalLM"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_activation="relu", sliding_window=16),
     "hidden_activation 'relu'.*'silu', 'gelu_pytorch_tanh'"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", layer_types=["chunked_attention"] * 2),
     "layer_types entry 'chunked_attention'.*full_attention, sliding_attention"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", layer_types=["full_attention"]),
     "layer_types must list one type per layer"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=None, layer_types=None),
     "sliding_window is null"),
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", use_bidirectional_attention=True,
          sliding_window=16),
     "use_bidirectional_attention"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", final_logit_softcapping=-1.0, sliding_window=16),
     "final_logit_softcapping"),
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=0), "sliding_window"),
    (dict(rope_parameters={"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e6}}),
     "per-layer-type rope_parameters are only supported for Gemma3ForCausalLM"),
])
def test_unsupported_window_and_gemma_options_are_named(tmp_path, changes, message):
    _write_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(tmp_path)


def test_selector():
    assert get_attention_backend("auto", torch.device("cpu")).name == "torch"
    assert get_attention_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="auto, torch, triton"):
        get_attention_backend("flash", "cpu")


def test_sharded_checkpoint_loads(tiny_model_factory, tmp_path):
    src = tiny_model_factory("qwen2")
    hf = _hf(src)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model = load_model(tmp_path, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
    prompt = _prompts(model.config.vocab_size, [9])[0]
    got = PagedCache(model, num_blocks=8).step(model, [(0, prompt)])
    torch.testing.assert_close(got, _hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_missing_weight_is_named(tiny_model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_model_factory("llama")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())


def _tp_worker(rank: int, world: int, init_file: str, model_dirs, prompts, result_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = []
        for model_dir in model_dirs:
            model = load_model(model_dir, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend(),
                               tp_rank=rank, tp_size=world)
            cache = PagedCache(model, num_blocks=32, seed=rank)  # each rank caches only its own KV heads
            results.append([cache.step(model, list(enumerate(prompts))),
                            cache.step(model, [(i, [5 + i]) for i in range(len(prompts))])])
        if rank == 0:
            torch.save(results, result_file)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_layout_matches_single_rank(tiny_model_factory, tmp_path):
    """The weight loaders' shards, run with real all-reduce/all-gather (gloo, 2 processes),
    reproduce the single-rank logits: GQA split across ranks, and MQA with its one KV head
    replicated, odd vocabulary and tied embeddings."""
    import torch.multiprocessing as mp

    model_dirs = [tiny_model_factory("llama", num_key_value_heads=2),
                  tiny_model_factory("llama", num_key_value_heads=1, vocab_size=509, tie_word_embeddings=True)]
    prompts = _prompts(509, [6, 3])
    want = []
    for model_dir in model_dirs:
        single = load_model(model_dir, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
        cache = PagedCache(single, num_blocks=32)
        want.append([cache.step(single, list(enumerate(prompts))),
                     cache.step(single, [(i, [5 + i]) for i in range(len(prompts))])])
    result = tmp_path / "tp.pt"
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "init"), [str(d) for d in model_dirs], prompts, str(result)),
             nprocs=2)
    got = torch.load(result)
    for got_model, want_model in zip(got, want):
        for g, w in zip(got_model, want_model):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_bfloat16_is_as_close_to_fp32_as_transformers_bf16(tiny_model_factory):
    """Low precision: our bf16 model (prefill in two chunks through a bf16 cache) strays from
    the fp32 logits no more than transformers' own bf16 run does."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("qwen3")
    prompt = _prompts(512, [40])[0]
    reference = _hf_logits(_hf(model_dir), prompt)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    hf_err = (_hf_logits(hf_bf16, prompt) - reference).abs().max().item()
    model = load_model(model_dir, dtype=torch.bfloat16, device="cpu", attention_backend=TorchAttentionBackend())
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    cache = PagedCache(model, num_blocks=16)
    cache.caches = [(k.bfloat16(), v.bfloat16()) for k, v in cache.caches]
    ours = torch.cat([cache.step(model, [(0, prompt[:30])]), cache.step(model, [(0, prompt[30:])])])
    assert ours.dtype == torch.float32
    assert (ours - reference).abs().max().item() <= 1.5 * hf_err + 0.02


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_cuda_logits_match_transformers(tiny_model_factory, backend_name):
    model_dir = tiny_model_factory("qwen3", num_key_value_heads=1)
    hf = _hf(model_dir)
    device = torch.device("cuda")
    model = load_model(model_dir, dtype=torch.float32, device=device,
                       attention_backend=get_attention_backend(backend_name, device))
    prompts = _prompts(512, [13, 4, 21])
    cache = PagedCache(model, num_blocks=64)
    cache.caches = [(k.to(device), v.to(device)) for k, v in cache.caches]
    got = cache.step(model, list(enumerate(prompts)), device=device)
    torch.testing.assert_close(got.cpu(), torch.cat([_hf_logits(hf, p) for p in prompts]), atol=2e-3, rtol=0)
    got = cache.step(model, [(i, [7]) for i in range(3)], device=device)
    want = torch.stack([_hf_logits(hf, p + [7])[-1] for p in prompts])
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=0)
