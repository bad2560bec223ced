"""ALiBi models (MPT, BLOOM, Falcon-RW): slopes, the torch backend's ALiBi against dense attention with the bias,
greedy decoding through the engine (paged decode, a prefix served from the prefix cache)
against transformers, and what is refused. The Triton kernels' ALiBi is
tests/kernels/test_kernels_alibi.py's. Layer-by-layer logits against transformers over
prefill, chunked prefill and mixed decode steps are tests/test_models.py's (mpt-alibi-6heads)."""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.attention.torch_backend import TorchAttentionBackend
from kvserve.runtime.models.mpt import alibi_slopes

MPT = dict(num_attention_heads=6, hidden_size=96)


@pytest.mark.parametrize("heads", [4, 6, 12])
def test_slopes_are_transformers_mpt_slopes(heads):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias = build_mpt_alibi_tensor(heads, 5, alibi_bias_max=8)  # [H, 1, 5]: slope * (j - 4)
    torch.testing.assert_close(alibi_slopes(heads, 8.0), -bias[:, 0, 0] / 4)


@pytest.mark.parametrize("heads", [4, 6, 12, 40])
def test_bloom_slopes_are_the_same(heads):
    """BLOOM builds its slopes another way (powers of 2^(-8/n) plus odd powers of the next
    power of two's base); every head count gives MPT's slopes at bias max 8."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    torch.testing.assert_close(alibi_slopes(heads, 8.0), _get_alibi_slopes(heads, torch.device("cpu")).float())


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [3, 1, 20], [5, 7]])
def test_torch_backend_alibi_equals_dense_attention(query_lens):
    """Packed sequences with cached context (decodes, short queries, a long prefill chunk), GQA
    2:1, against softmax(q k^T * scale + slope * (j - i)) over each sequence's visible keys."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, block = 4, 2, 16, 4
    contexts = [9, 0, 6][: len(query_lens)]
    slopes = alibi_slopes(heads, 8.0)
    blocks_per_seq = 8
    k_cache = torch.zeros(len(query_lens) * blocks_per_seq, block, kv_heads, d)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.arange(len(query_lens) * blocks_per_seq, dtype=torch.int32).view(len(query_lens), -1)
    seqs_k, seqs_v, slots, rows = [], [], [], []
    for i, (ctx, q) in enumerate(zip(contexts, query_lens)):
        n = ctx + q
        k, v = torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen)
        seqs_k.append(k)
        seqs_v.append(v)
        for pos in range(n):
            slot = int(tables[i, pos // block]) * block + pos % block
            if pos < ctx:
                k_cache.view(-1, kv_heads, d)[slot], v_cache.view(-1, kv_heads, d)[slot] = k[pos], v[pos]
            else:
                slots.append(slot)
        rows.append(q)
    query = torch.randn(sum(query_lens), heads, d, generator=gen)
    new_k = torch.cat([k[c:] for k, c in zip(seqs_k, contexts)])
    new_v = torch.cat([v[c:] for v, c in zip(seqs_v, contexts)])
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             seq_lens=torch.tensor([c + q for c, q in zip(contexts, query_lens)], dtype=torch.int32),
                             block_tables=tables, slot_mapping=torch.tensor(slots), max_query_len=max(query_lens),
                             max_seq_len=max(c + q for c, q in zip(contexts, query_lens)),
                             is_decode_only=all(q == 1 for q in query_lens))
    backend = TorchAttentionBackend()
    backend.write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    scale = d ** -0.5
    got = backend.attend(query, new_k, new_v, k_cache, v_cache, meta, scale, alibi_slopes=slopes)
    for i, (ctx, q) in enumerate(zip(contexts, query_lens)):
        k = seqs_k[i].repeat_interleave(heads // kv_heads, dim=1).double()
        v = seqs_v[i].repeat_interleave(heads // kv_heads, dim=1).double()
        qi = query[starts[i]:starts[i + 1]].double()
        pos_q = torch.arange(ctx, ctx + q)[:, None]
        pos_k = torch.arange(ctx + q)[None, :]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale + slopes.double()[:, None, None] * (pos_k - pos_q)
        scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        torch.testing.assert_close(got[starts[i]:starts[i + 1]].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mpt", "bloom", "falcon"])
def test_engine_greedy_with_a_cached_prefix_matches_transformers(tiny_model_factory, family):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(family, **MPT)
    prefix = [1, 40, 41, 42, 300, 17, 5, 9, 250, 12, 7, 64, 128, 77, 33, 400]  # two whole blocks of 8
    prompts = [prefix + [3, 4], prefix + [200, 201, 202]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(str(path), num_kv_blocks=64, block_size=8, dtype="float32", device="cpu") as llm:
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
        second = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 16  # the shared prefix came from the cache
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for prompt, out in zip(prompts, (first, second)):
        x = torch.tensor([prompt])
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, min_new_tokens=10,
                            do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == want


def test_unsupported_mpt_options_are_named(tiny_model_factory):
    from kvserve.runtime.model_config import ModelConfig

    path = tiny_model_factory("mpt", **MPT)
    base = ModelConfig.from_pretrained(path).hf_config
    for change, field in ((dict(attn_config={"alibi": False}), "attn_config.alibi"),
                          (dict(attn_config={"qk_ln": True}), "attn_config.qk_ln"),
                          (dict(no_bias=False), "no_bias"), (dict(expansion_ratio=2), "expansion_ratio"),
                          (dict(logit_scale=2.0), "logit_scale"),
                          (dict(attn_config={"alibi_bias_max": 4}), "alibi_bias_max")):
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_dict({**base, **change})
    bloom = ModelConfig.from_pretrained(tiny_model_factory("bloom", **MPT)).hf_config
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm"):
        ModelConfig.from_dict({**bloom, "apply_residual_connection_post_layernorm": True})
    falcon = ModelConfig.from_pretrained(tiny_model_factory("falcon", **MPT)).hf_config
    for change, field in ((dict(alibi=False), "alibi false"), (dict(multi_query=True), "multi_query true"),
                          (dict(parallel_attn=True), "parallel_attn true"),
                          (dict(new_decoder_architecture=True), "new_decoder_architecture true"),
                          (dict(activation="relu"), "activation 'relu'")):
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_dict({**falcon, **change})


def test_tensor_parallel_slices_slopes_and_fused_biases(tiny_model_factory):
    """At tensor_parallel_size 2 each rank keeps its heads' slopes and its slice of BLOOM's
    head-interleaved q|k|v (weights and biases): greedy output equals one rank's."""
    path = tiny_model_factory("bloom", **MPT)
    prompts = [{"prompt_token_ids": [1, 40, 41, 42, 300, 17, 5, 9, 250]}, {"prompt_token_ids": [1, 7, 8]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(num_kv_blocks=64, block_size=8, dtype="float32", device="cpu")
    with LLM(str(path), **kw) as one:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM(str(path), tensor_parallel_size=2, **kw) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
    assert got == want
