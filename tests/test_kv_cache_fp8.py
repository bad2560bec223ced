"""kv_cache_dtype="fp8" / "fp8_e4m3" / "fp8_e5m2": float8 KV pools with per-layer scales, sized by
the capacity model, and prefix caching, copy-on-write, speculative decoding and tensor parallelism
behaving as with full-precision pools."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.attention.torch_backend import TorchAttentionBackend
from kvserve.runtime.capacity import (
    ModelShape,
    blocks_for_budget,
    kv_cache_dtype_bytes,
    plan_capacity,
    weight_bytes_per_gpu,
)
from kvserve.runtime.config import EngineConfig
from kvserve.runtime.kv_cache import allocate_kv_cache, copy_blocks, kv_cache_torch_dtype
from kvserve.runtime.models import load_model

BUDGET = 1 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(vocab=512):
    prefix = list(range(10, 40))
    return [prefix + [41, 42, 43], prefix + [50, 51], [7, 8, 9], list(range(100, 140))]


def greedy(llm, ps=None, params=GREEDY):
    return [list(o.outputs[0].token_ids) for o in llm.generate(ps or prompts(), params, use_tqdm=False)]


# ------------------------------------------------------------------------------ config, capacity


@pytest.mark.parametrize("bad", ["fp16", "float8", "FP8", "", None, 8])
def test_bad_kv_cache_dtype_names_the_field(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of \\['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\\]"):
        EngineConfig(model="/m", kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtype_bytes(bad, "bfloat16")


def test_capacity_model_bytes_per_kv_element():
    assert kv_cache_dtype_bytes("auto", "bfloat16") == 2
    assert kv_cache_dtype_bytes("auto", "float32") == 4
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert kv_cache_dtype_bytes(name, "bfloat16") == 1
        assert kv_cache_torch_dtype(name, torch.bfloat16).itemsize == 1
    assert kv_cache_torch_dtype("auto", torch.float16) == torch.float16
    # A 70B-like shape on an 80 GB GPU: fp8 KV holds exactly twice bf16's tokens in the same budget.
    shape = ModelShape(num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8, head_dim=128,
                       intermediate_size=28672, vocab_size=128256)
    kw = dict(dtype_size=2, block_size=16, tp=4, gpu_memory_bytes=80 * 1024**3)
    bf16, fp8 = plan_capacity(shape, **kw), plan_capacity(shape, kv_dtype_size=1, **kw)
    assert fp8.weight_bytes_per_gpu == bf16.weight_bytes_per_gpu
    assert fp8.kv_bytes_per_token_per_gpu * 2 == bf16.kv_bytes_per_token_per_gpu
    assert fp8.kv_blocks in (2 * bf16.kv_blocks, 2 * bf16.kv_blocks + 1)


def test_engine_pool_is_float8_and_sized_by_the_capacity_model(tiny_llama):
    sizes = {}
    for kv in ("auto", "fp8", "fp8_e5m2"):
        llm = LLM(str(tiny_llama), kv_cache_dtype=kv, kv_cache_memory_bytes=BUDGET, block_size=8, dtype="float32")
        engine = llm.engine
        shape = engine.model_config.shape
        size = kv_cache_dtype_bytes(kv, "float32")
        assert engine.num_kv_blocks == blocks_for_budget(BUDGET, shape, size, 8)
        plan = plan_capacity(shape, dtype_size=4, kv_dtype_size=size, block_size=8, tp=1, gpu_memory_utilization=1.0,
                             gpu_memory_bytes=weight_bytes_per_gpu(shape, 4) + BUDGET, activation_reserve_bytes=0)
        assert engine.get_stats().kv_cache_capacity_tokens == plan.kv_tokens
        k, v = engine.kv_caches[0]
        assert k.dtype == v.dtype == {"auto": torch.float32, "fp8": torch.float8_e4m3fn,
                                      "fp8_e5m2": torch.float8_e5m2}[kv]
        assert sum(t.numel() * t.element_size() for kv_pair in engine.kv_caches for t in kv_pair) <= BUDGET
        sizes[kv] = engine.num_kv_blocks
    assert sizes["fp8"] == sizes["fp8_e5m2"] == 4 * sizes["auto"]  # float32 model: 4 bytes -> 1


# --------------------------------------------------------------------------------------- numerics


def _forward(model, pools, tokens, start, block_table):
    n = len(tokens)
    bs = pools[0][0].shape[1]
    positions = torch.arange(start, start + n)
    slots = [block_table[p // bs] * bs + p % bs for p in positions.tolist()]
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([start + n], dtype=torch.int32),
                             block_tables=torch.tensor([block_table], dtype=torch.int32),
                             slot_mapping=torch.tensor(slots),
                             max_query_len=n, max_seq_len=start + n, is_decode_only=n == 1)
    return model.compute_logits(model(torch.tensor(tokens), positions, pools, meta))


class _RoundedKV(TorchAttentionBackend):
    """Full-precision pools holding K/V rounded through float8 (value / s, rounded, times s): what
    a float8 pool with scales s must compute, done the obvious way."""

    def __init__(self, fp8, k_scale, v_scale):
        super().__init__()
        self.fp8, self.ks, self.vs = fp8, k_scale, v_scale

    def _round(self, x, s):
        return ((x / s).to(self.fp8).float() * s).to(x.dtype)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, **kw):
        super().write_kv(self._round(key, self.ks), self._round(value, self.vs), k_cache, v_cache, slot_mapping)

    def attend(self, query, key, value, *args, **kw):
        return super().attend(query, self._round(key, self.ks), self._round(value, self.vs), *args, **kw)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pools_compute_attention_over_the_rounded_kv(tiny_llama, kv):
    """Prefill, then decode steps that read the float8 cache, with non-unit scales: the logits
    equal those of float32 pools holding the float8-rounded K/V (scales folded into the queries
    and outputs change nothing), and stay near the unrounded model's."""
    fp8 = kv_cache_torch_dtype(kv, torch.float32)
    ks, vs = torch.tensor(0.75), torch.tensor(1.5)
    model = load_model(tiny_llama, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
    for layer in model.layers:
        layer.self_attn.k_scale.fill_(ks)
        layer.self_attn.v_scale.fill_(vs)
    rounded = load_model(tiny_llama, dtype=torch.float32, device="cpu", attention_backend=_RoundedKV(fp8, ks, vs))
    plain = load_model(tiny_llama, dtype=torch.float32, device="cpu", attention_backend=TorchAttentionBackend())
    shape = model.config.shape
    table = [3, 0, 5, 1, 4]
    pools = {name: allocate_kv_cache(shape, 6, 8, dtype, torch.device("cpu"))
             for name, dtype in (("fp8", fp8), ("rounded", torch.float32), ("full", torch.float32))}
    steps = [(list(range(5, 30)), 0), ([11], 25), ([12], 26), ([13], 27)]
    for tokens, start in steps:
        low = _forward(model, pools["fp8"], tokens, start, table)
        torch.testing.assert_close(low, _forward(rounded, pools["rounded"], tokens, start, table), atol=2e-5, rtol=2e-5)
        full = _forward(plain, pools["full"], tokens, start, table)
        assert 0 < (low - full).abs().max() < 0.25 * full.abs().max()


def test_checkpoint_kv_scales_are_loaded_and_used(tiny_llama, tmp_path):
    """k_scale / v_scale tensors (llm-compressor / ModelOpt names, and the older kv_scale) in the
    checkpoint become the layers' scales; stored K is then round(k / k_scale)."""
    import shutil

    model_dir = tmp_path / "scaled"
    shutil.copytree(tiny_llama, model_dir)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([0.25]),
               "model.layers.1.self_attn.kv_scale": torch.tensor(2.0, dtype=torch.bfloat16)},
              str(model_dir / "kv_scales.safetensors"))
    llm = LLM(str(model_dir), kv_cache_dtype="fp8", num_kv_blocks=32, block_size=8, dtype="float32")
    attn = [layer.self_attn for layer in llm.engine.model.layers]
    assert [(a.k_scale.item(), a.v_scale.item()) for a in attn] == [(0.5, 0.25), (2.0, 2.0)]
    out = greedy(llm, [[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0]) == 3

    (model_dir / "kv_scales.safetensors").unlink()
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}, str(model_dir / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match="kv cache scale: must be a positive finite number"):
        LLM(str(model_dir), kv_cache_dtype="fp8", num_kv_blocks=32)


# ------------------------------------------------------------- features unchanged on float8 pools


def test_prefix_caching_gives_the_same_tokens_on_fp8(tiny_llama):
    """A prompt computed over a cached float8 prefix equals the same prompt computed from scratch:
    a fresh prefill attends to the float8-rounded K/V it stores, not to the unrounded ones."""
    kw = dict(kv_cache_dtype="fp8", num_kv_blocks=64, block_size=4, dtype="float32")
    cold = greedy(LLM(str(tiny_llama), enable_prefix_caching=False, **kw))
    llm = LLM(str(tiny_llama), enable_prefix_caching=True, **kw)
    greedy(llm, [prompts()[0]], SamplingParams(max_tokens=1))  # caches the shared 30-token prefix
    warm = greedy(llm)
    assert llm.engine.get_stats().prefix_cache_hits_total > 0
    assert warm == cold


def test_copy_on_write_copies_float8_blocks(tiny_llama):
    caches = allocate_kv_cache(ModelShape(2, 64, 4, 2, 16, 128, 512), 6, 4, torch.float8_e4m3fn, torch.device("cpu"))
    for k, v in caches:
        k.copy_(torch.randn(k.shape).to(k.dtype))
        v.copy_(torch.randn(v.shape).to(v.dtype))
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, [(1, 4), (2, 5)])
    for (k, v), (k0, v0) in zip(caches, before):
        for src, dst in ((1, 4), (2, 5)):
            assert torch.equal(k[dst].view(torch.uint8), k0[src].view(torch.uint8))
            assert torch.equal(v[dst].view(torch.uint8), v0[src].view(torch.uint8))
        assert torch.equal(k[:4].view(torch.uint8), k0[:4].view(torch.uint8))
    # In the engine: n > 1 forks share the prompt's blocks and copy the partial last one.
    llm = LLM(str(tiny_llama), kv_cache_dtype="fp8", num_kv_blocks=64, block_size=4, dtype="float32")
    single = greedy(llm, [prompts()[1]])
    forked = llm.generate([prompts()[1]], SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0]
    assert [list(c.token_ids) for c in forked.outputs] == single * 3
    assert llm.engine.block_manager.num_used_blocks == 0


def test_speculative_decoding_on_fp8_equals_plain_greedy(tiny_llama):
    kw = dict(kv_cache_dtype="fp8", num_kv_blocks=96, block_size=4, dtype="float32")
    grounded = [(p * 3)[:40] for p in prompts()]
    plain = greedy(LLM(str(tiny_llama), **kw), grounded)
    spec = LLM(str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                    "prompt_lookup_max": 3}, **kw)
    assert greedy(spec, grounded) == plain
    stats = spec.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens_total > 0


def test_tensor_parallel_on_fp8_equals_tp1(tiny_model_factory):
    model_dir = tiny_model_factory("llama", num_key_value_heads=2)
    kw = dict(kv_cache_dtype="fp8", kv_cache_memory_bytes=BUDGET, block_size=8, dtype="float32", device="cpu")
    with LLM(str(model_dir), **kw) as one:
        want = greedy(one)
        blocks1 = one.engine.num_kv_blocks
    with LLM(str(model_dir), tensor_parallel_size=2, **kw) as two:
        got = greedy(two)
        reports = two.engine.executor.rank_reports
        shape = two.engine.model_config.shape
        assert two.engine.num_kv_blocks == blocks_for_budget(BUDGET, shape, 1, 8, 2) == 2 * blocks1
    assert got == want
    for r in reports:  # every rank's float8 pool is one byte per element of its KV heads
        assert r["kv_cache_bytes"] == r["num_kv_blocks"] * 8 * 2 * shape.num_layers * 1 * shape.head_dim


def test_triton_kernels_on_fp8_pools_equal_the_torch_backend(tiny_llama, monkeypatch):
    pytest.importorskip("triton")
    from kvserve.kernels import ops

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kw = dict(kv_cache_dtype="fp8", num_kv_blocks=24, block_size=4, max_num_batched_tokens=16, dtype="float32")
    ps = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [30, 31, 32], [40]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with ops.kernel_mode("torch"):
        want = greedy(LLM(str(tiny_llama), attention_backend="torch", **kw), ps, params)
        got = greedy(LLM(str(tiny_llama), attention_backend="triton", **kw), ps, params)
    assert got == want


# ------------------------------------------------------------------------------------ real model


def test_real_smollm2_answers_with_an_fp8_kv_cache(smollm2):
    llm = LLM(str(smollm2.hf_dir), kv_cache_dtype="fp8", max_model_len=512)
    assert llm.engine.kv_caches[0][0].dtype == torch.float8_e4m3fn
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"


def test_serve_flag_reaches_the_engine_config():
    from kvserve.runtime.cli import build_parser
    from kvserve.runtime.server.main import engine_kwargs

    args = build_parser().parse_args(["serve", "/m", "--kv-cache-dtype", "fp8_e5m2"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8_e5m2"
    assert "kv_cache_dtype" not in engine_kwargs(build_parser().parse_args(["serve", "/m"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "/m", "--kv-cache-dtype", "int8"])
