"""The whole engine on the Triton kernels (interpreted on CPU) gives the torch path's greedy output.

Attention goes through TritonAttentionBackend (attention_backend="triton") and every layer op
through the Triton kernels (kernel mode "triton"), on a tiny model with chunked prefill, cached
context and preemption, so decode, prefill-with-prefix, mixed batches and KV writes all run.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")

from kvserve.kernels import layers, ops  # noqa: E402
from kvserve.runtime import LLM, SamplingParams  # noqa: E402
from kvserve.runtime.attention import triton_backend as attention_backend  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _workload(vocab, seed=0):
    rng = random.Random(seed)
    lengths = [1, 3, 26, 9, 17, 5]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    return prompts, [6, 4, 7, 5, 6, 8]


def _greedy(model_dir, prompts, max_tokens, **kwargs):
    llm = LLM(str(model_dir), **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine


# A step budget of 12 tokens chunks the 26- and 17-token prompts (prefill over a cached prefix);
# 14 blocks of 4 tokens cannot hold all six requests, so some are preempted and recomputed.
SQUEEZED = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=12, max_num_seqs=6)


@pytest.mark.parametrize("arch,overrides", [
    pytest.param("llama", {}, id="llama-gqa2"),
    pytest.param("qwen3", dict(num_attention_heads=6, num_key_value_heads=1, head_dim=24), id="qwen3-mqa-qknorm-d24"),
])
def test_engine_greedy_output_on_triton_equals_torch(tiny_model_factory, monkeypatch, arch, overrides):
    model_dir = tiny_model_factory(arch, **overrides)
    prompts, max_tokens = _workload(512)

    with ops.kernel_mode("torch"):
        expected, _ = _greedy(model_dir, prompts, max_tokens, attention_backend="torch", **SQUEEZED)

    calls = {"decode": 0, "prefill": 0, "rms_norm": 0}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    # The backend launches through kernels/custom_ops.py (ops under torch.compile, direct calls here).
    monkeypatch.setattr(attention_backend, "decode_attention", spy("decode", attention_backend.decode_attention))
    monkeypatch.setattr(attention_backend, "prefill_attention", spy("prefill", attention_backend.prefill_attention))
    monkeypatch.setattr(layers, "fused_add_rms_norm", spy("rms_norm", layers.fused_add_rms_norm))
    with ops.kernel_mode("triton"):
        got, engine = _greedy(model_dir, prompts, max_tokens, attention_backend="triton", **SQUEEZED)

    assert engine.attention_backend == "triton"
    assert all(calls.values()), calls  # both attention kernels and the layer kernels really ran
    assert engine.get_stats().num_preemptions_total > 0
    assert got == expected
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("arch,overrides", [
    # Local/global layers (window 8 < the 26-token prompt), attention and final soft-capping,
    # Gemma's norms and GELU(tanh) MLP kernels.
    pytest.param("gemma2", dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5), id="gemma2-window8-caps"),
    # Every layer local: blocks behind the window are given back and never read by the kernels.
    pytest.param("mistral", dict(sliding_window=6), id="mistral-window6-release"),
])
def test_engine_sliding_window_on_triton_equals_torch(tiny_model_factory, arch, overrides):
    model_dir = tiny_model_factory(arch, **overrides)
    # Kept small (the interpreter runs every program of every launch in Python): a 14-token
    # prompt in chunks of 8 past the window, and a short one decoding beside it.
    rng = random.Random(1)
    prompts, max_tokens = [[rng.randrange(3, 512) for _ in range(n)] for n in (14, 2)], [3, 5]
    kw = dict(SQUEEZED, max_num_batched_tokens=8)
    with ops.kernel_mode("torch"):
        expected, _ = _greedy(model_dir, prompts, max_tokens, attention_backend="torch", **kw)
    with ops.kernel_mode("triton"):
        got, engine = _greedy(model_dir, prompts, max_tokens, attention_backend="triton", **kw)
    assert got == expected
    assert engine.block_manager.num_used_blocks == 0


def test_moe_and_mla_engine_on_triton_equals_torch(tiny_model_factory, monkeypatch):
    """DeepSeek V3 (MLA + routed and shared experts): the fused MoE kernel and the absorbed MLA
    decode kernel in the engine, with chunks and preemptions, give the torch path's tokens."""
    from kvserve.kernels import moe
    from kvserve.runtime.attention import triton_mla as mla_backend

    model_dir = tiny_model_factory("deepseek_v3")
    rng = random.Random(1)
    # Smaller than _workload (the interpreter runs every expert GEMM): the three prompts fit the
    # 6 blocks of 4 (2 + 3 + 1) but their growth does not, so a running one is preempted; 6-token
    # steps chunk the 10-token prompt.
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 10, 2)]
    max_tokens = [6, 5, 2]
    squeezed = dict(block_size=4, num_kv_blocks=6, max_num_batched_tokens=6, max_num_seqs=3)
    with ops.kernel_mode("torch"):
        expected, _ = _greedy(model_dir, prompts, max_tokens, attention_backend="torch", **squeezed)
    calls = {"fused_moe": 0, "mla_decode": 0}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(moe, "fused_moe", spy("fused_moe", moe.fused_moe))
    monkeypatch.setattr(mla_backend, "mla_decode", spy("mla_decode", mla_backend.mla_decode))
    with ops.kernel_mode("triton"):
        got, engine = _greedy(model_dir, prompts, max_tokens, attention_backend="triton", **squeezed)
    assert all(calls.values()), calls
    assert engine.get_stats().num_preemptions_total > 0
    assert got == expected
    assert engine.block_manager.num_used_blocks == 0
