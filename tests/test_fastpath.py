"""The fast path's pure parts and its promise: outputs do not change when it is on.

CUDA graphs cannot be captured without a GPU, but everything around the capture is plain torch:
`DecodeGraphs(capture=False)` runs the model eagerly on the same padded static buffers a graph
would replay. Greedy outputs with it equal the plain engine's, on the architectures and
scheduler paths the parity tests cover (chunked prefill and preemption, prefix hits, n > 1,
speculative decoding). The `gpu` test captures real graphs where a GPU exists.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.config import EngineConfig
from kvserve.runtime.executor.cuda_graphs import CompilationConfig, DecodeGraphs, bucket_for, default_capture_sizes

# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("value,level,sizes", [
    (None, 0, None),
    ({}, 0, None),
    ('{"cudagraph_capture_sizes": [8, 1, 2, 2]}', 0, [1, 2, 8]),
    ("3", 3, None),
    (3, 3, None),
    ({"level": 0, "cudagraph_capture_sizes": []}, 0, []),
])
def test_compilation_config_parses(value, level, sizes):
    cc = CompilationConfig.parse(value)
    assert cc.level == level and cc.cudagraph_capture_sizes == sizes


@pytest.mark.parametrize("value,field", [
    ('{"levle": 3}', "compilation_config.levle"),
    ({"level": 2}, "compilation_config.level"),
    ({"level": True}, "compilation_config.level"),
    ({"cudagraph_capture_sizes": [0, 4]}, "compilation_config.cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": 8}, "compilation_config.cudagraph_capture_sizes"),
    ({"max_capture_size": 0}, "compilation_config.max_capture_size"),
    ("{not json", "compilation_config"),
    ([1, 2], "compilation_config"),
])
def test_compilation_config_rejects_bad_values_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        CompilationConfig.parse(value)


def test_engine_config_validates_the_fast_path_options():
    cfg = EngineConfig(model="m", compilation_config='{"max_capture_size": 16}')
    assert cfg.compilation_config.capture_sizes(max_num_seqs=256) == [1, 2, 4, 8, 16]
    assert cfg.compilation_config.capture_sizes(max_num_seqs=6) == [1, 2, 4]
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model="m", enforce_eager="yes")
    with pytest.raises(ValueError, match="compilation_config.level"):
        EngineConfig.from_args(model="m", compilation_config={"level": 1})


def _serve_args(*argv: str):
    import argparse

    from kvserve.runtime.server.args import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_server_flags_reach_the_engine():
    from kvserve.runtime.server.main import engine_kwargs

    kw = engine_kwargs(_serve_args("m", "--enforce-eager", "--compilation-config", '{"max_capture_size": 8}',
                                   "--async-scheduling"))
    assert kw["enforce_eager"] is True and kw["async_scheduling"] is True
    assert json.loads(kw["compilation_config"]) == {"max_capture_size": 8}
    kw = engine_kwargs(_serve_args("m", "-O", "3"))
    assert EngineConfig(**kw).compilation_config.level == 3
    assert "enforce_eager" not in engine_kwargs(_serve_args("m"))


def test_default_capture_sizes_follow_vllm():
    assert default_capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_capture_sizes(3) == [1, 2]


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=8, unique=True), n=st.integers(0, 80))
def test_bucket_is_the_smallest_size_that_holds_the_batch(sizes, n):
    sizes = sorted(sizes)
    got = bucket_for(n, sizes)
    fitting = [s for s in sizes if s >= n]
    assert got == (min(fitting) if fitting and n >= 1 else None)


# ------------------------------------------------------------------------------ static buffers


def _decode_meta(rows: list[tuple[int, int, list[int]]], block_size: int) -> tuple:
    """(input_ids, positions, metadata) of a decode step; rows are (token, position, block table)."""
    n = len(rows)
    width = max(len(t) for _, _, t in rows)
    tables = torch.zeros(n, width, dtype=torch.int32)
    for i, (_, _, t) in enumerate(rows):
        tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    pos = torch.tensor([p for _, p, _ in rows])
    slots = torch.tensor([t[p // block_size] * block_size + p % block_size for _, p, t in rows])
    meta = AttentionMetadata(query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                             seq_lens=(pos + 1).to(torch.int32), block_tables=tables, slot_mapping=slots,
                             max_query_len=1, max_seq_len=int(pos.max()) + 1, is_decode_only=True)
    return torch.tensor([tok for tok, _, _ in rows]), pos, meta


@settings(max_examples=30, deadline=None)
@given(batches=st.lists(st.lists(st.tuples(st.integers(1, 99), st.integers(0, 31)), min_size=1, max_size=8),
                        min_size=1, max_size=5))
def test_static_buffers_hold_the_step_and_pad_the_rest(batches):
    """After any sequence of steps, rows < n hold the step's data and rows >= n are the harmless
    dummy (token 0, position 0, no KV write, context 1 over block 0)."""
    block_size, max_len = 4, 32
    graphs = DecodeGraphs(None, [], block_size=block_size, max_model_len=max_len, sizes=[1, 2, 4, 8],
                          device=torch.device("cpu"), capture=False)
    for batch in batches:
        rows = [(tok, pos, list(range(3, 3 + pos // block_size + 1))) for tok, pos in batch]
        ids, pos, meta = _decode_meta(rows, block_size)
        n = len(rows)
        size = graphs.bucket(n)
        graphs.load(ids, pos, meta, size)
        assert torch.equal(graphs.input_ids[:n], ids) and torch.equal(graphs.positions[:n], pos)
        assert torch.equal(graphs.slot_mapping[:n], meta.slot_mapping)
        assert torch.equal(graphs.seq_lens[:n], meta.seq_lens)
        width = meta.block_tables.shape[1]
        assert torch.equal(graphs.block_tables[:n, :width], meta.block_tables)
        assert not graphs.block_tables[:n, width:].any()
        assert not graphs.input_ids[n:].any() and not graphs.positions[n:].any()
        assert (graphs.slot_mapping[n:] == -1).all() and (graphs.seq_lens[n:] == 1).all()
        assert not graphs.block_tables[n:].any()
        got = graphs.metadata(size)
        assert got.max_seq_len == max_len and got.is_decode_only and got.seq_lens.shape == (size,)


def test_load_refuses_what_a_graph_cannot_hold():
    graphs = DecodeGraphs(None, [], block_size=4, max_model_len=8, sizes=[2], device=torch.device("cpu"),
                          capture=False)
    ids, pos, meta = _decode_meta([(5, 1, [0]), (6, 2, [1]), (7, 3, [2])], 4)
    with pytest.raises(ValueError, match="at most 2 rows"):
        graphs.load(ids, pos, meta, 2)
    ids, pos, meta = _decode_meta([(5, 1, [0, 1, 2])], 4)
    with pytest.raises(ValueError, match="block table width 3"):
        graphs.load(ids, pos, meta, 2)
    with pytest.raises(ValueError, match="outside the capture sizes"):
        graphs.run(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), meta)


# ------------------------------------------------------------------------ outputs do not change

SQUEEZED = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=8)


def _workload(vocab: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(9)]  # a common prefix: prefix-cache hits
    prompts, params = [], []
    for i, n in enumerate([1, 3, 40, 5, 13, 21, 8, 30, 2, 17]):
        body = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(shared + body if i % 3 == 0 else body)
        params.append(SamplingParams(temperature=0.0, max_tokens=4 + (i * 5) % 9, n=2 if i % 4 == 1 else 1,
                                     ignore_eos=i % 2 == 0))
    return prompts, params


def _install_twin_graphs(llm: LLM) -> DecodeGraphs:
    eng = llm.engine
    worker = eng.executor.driver_worker
    worker.graphs = worker.build_graphs([1, 2, 4, 8], max_model_len=eng.max_model_len, capture=False)
    return worker.graphs


def _generate(model_dir, prompts, params, *, graphs: bool, **kw):
    llm = LLM(str(model_dir), **{**SQUEEZED, **kw})
    assert llm.engine.core.overlap == (kw.get("async_scheduling", False) and "speculative_config" not in kw)
    twin = _install_twin_graphs(llm) if graphs else None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    stats = llm.engine.get_stats()
    assert llm.engine.block_manager.num_used_blocks == 0
    llm.close()
    return tokens, stats, twin


@pytest.mark.parametrize("arch,overrides", [
    pytest.param("llama", {}, id="llama"),
    pytest.param("qwen3", dict(tie_word_embeddings=True), id="qwen3-tied"),
    pytest.param("gemma2", dict(attn_logit_softcapping=2.0), id="gemma2-window-softcap"),
    pytest.param("qwen2_moe", {}, id="qwen2moe"),
    pytest.param("deepseek_v2", {}, id="deepseekv2-mla"),
])
def test_static_decode_and_overlap_give_the_same_greedy_outputs(tiny_model_factory, arch, overrides):
    model_dir = tiny_model_factory(arch, **overrides)
    prompts, params = _workload(512)
    want, stats, _ = _generate(model_dir, prompts, params, graphs=False)
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    got, _, twin = _generate(model_dir, prompts, params, graphs=True)
    assert got == want and twin.replays > 0
    got, _, twin = _generate(model_dir, prompts, params, graphs=True, async_scheduling=True)
    assert got == want and twin.replays > 0


def test_speculative_decoding_with_the_static_decode_path(tiny_llama):
    prompts, params = _workload(512, seed=3)
    prompts = [p * 3 for p in prompts]  # repetition: n-gram drafts get accepted
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    want, _, _ = _generate(tiny_llama, prompts, params, graphs=False, num_kv_blocks=200, max_num_batched_tokens=64)
    got, stats, twin = _generate(tiny_llama, prompts, params, graphs=True, num_kv_blocks=200,
                                 max_num_batched_tokens=64, speculative_config=spec)
    assert got == want
    assert stats.spec_decode_num_drafts_total > 0 and twin.replays > 0


def _stream(model_dir, *, async_scheduling: bool, abort_after: int | None = None):
    """Final (text, tokens, finish reason) per request; streamed texts must extend each other."""
    llm = LLM(str(model_dir), async_scheduling=async_scheduling, **SQUEEZED)
    eng = llm.engine
    for i, stop in enumerate([[], ["e"], [" t", "the"], []]):
        eng.add_request(f"r{i}", f"The quick brown fox {i}", SamplingParams(max_tokens=12, stop=stop))
    eng.add_request("gone", {"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=30, ignore_eos=True))
    final, texts, steps = {}, {}, 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        for out in outs:
            text = out.outputs[0].text
            assert text.startswith(texts.get(out.request_id, ""))
            texts[out.request_id] = text
            if out.finished:
                final[out.request_id] = (text, out.outputs[0].token_ids, out.outputs[0].finish_reason)
        steps += bool(outs)  # an overlapped engine's first call only launches step 1
        if steps == abort_after:
            eng.abort_request("gone")
    assert eng.block_manager.num_used_blocks == 0 and not eng.core.busy
    llm.close()
    return final


def test_overlapped_steps_stream_the_same_texts(tiny_llama):
    sync = _stream(tiny_llama, async_scheduling=False)
    assert _stream(tiny_llama, async_scheduling=True) == sync
    assert any(reason == "stop" for _, _, reason in sync.values())  # a stop string ended one


def test_an_abort_during_an_overlapped_forward_pass_drops_its_token(tiny_llama):
    """The abort lands while step N+1 is in flight: that request's token is dropped, its blocks are
    freed, and the others finish. (Which step it lands in can differ from the synchronous
    engine's by one, and so can the batches after it: only invariants are compared.)"""
    final = _stream(tiny_llama, async_scheduling=True, abort_after=4)
    text, tokens, reason = final.pop("gone")
    assert reason == "abort" and 0 < len(tokens) < 30
    assert sorted(final) == ["r0", "r1", "r2", "r3"]
    assert all(0 < len(t) <= 12 and r in ("stop", "length") for _, t, r in final.values())


def test_async_scheduling_keeps_speculative_steps_synchronous(tiny_llama):
    llm = LLM(str(tiny_llama), async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not llm.engine.core.overlap
    llm.close()


def test_step_phases_are_timed_once_per_step(tiny_llama):
    llm = LLM(str(tiny_llama), **SQUEEZED)
    llm.engine.get_stats()
    steps = 0
    llm.engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=5, ignore_eos=True))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
    phases = llm.engine.get_stats().step_phase_durations
    assert sorted(phases) == sorted(["schedule", "prepare", "forward", "sample", "output"])
    assert all(len(v) == steps and all(x >= 0 for x in v) for v in phases.values())
    assert sum(phases["forward"]) > 0
    llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_with_the_same_greedy_outputs(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    prompts, params = _workload(512)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", enforce_eager=eager,
                  compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]}, **SQUEEZED)
        assert (llm.engine.executor.driver_worker.graphs is None) == eager
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[eager] = [[c.token_ids for c in o.outputs] for o in res]
        if not eager:
            assert llm.engine.executor.driver_worker.graphs.replays > 0
        llm.close()
    assert outs[True] == outs[False]


# ------------------------------------------------------------------ the native decoder stack


@pytest.mark.parametrize("arch,overrides", [
    pytest.param("llama", dict(attention_bias=True, mlp_bias=True), id="llama-biases"),
    pytest.param("qwen2", dict(tie_word_embeddings=True, vocab_size=509), id="qwen2-bias-tied-oddvocab"),
    pytest.param("qwen3", dict(head_dim=24), id="qwen3-qknorm-headdim24"),
    pytest.param("mistral", dict(sliding_window=6), id="mistral-window6"),
    pytest.param("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}, num_key_value_heads=1),
                 id="llama-mqa-rope-linear"),
])
def test_native_decoder_stack_is_bit_identical_to_the_per_op_path(tiny_model_factory, arch, overrides):
    """One native call per decode step runs the same kernels in the same order: same logits, bit
    for bit, and so the same tokens (chunked prefill and preemption around it)."""
    _check_stack_against_per_op(tiny_model_factory, arch, overrides)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("arch,overrides", [
    pytest.param("llama", dict(attention_bias=True, mlp_bias=True), id="llama-biases"),
    pytest.param("qwen2", dict(tie_word_embeddings=True, vocab_size=509), id="qwen2-bias-tied-oddvocab"),
])
def test_native_decoder_stack_takes_int8_and_int4_weights(tiny_model_factory, arch, overrides, quantization):
    """Load-time int8/int4 weights in the stack (the native integer kernels + bias inside C): bit
    for bit the per-op path's numbers, which use the same kernels."""
    _check_stack_against_per_op(tiny_model_factory, arch, overrides, quantization=quantization)


def _check_stack_against_per_op(tiny_model_factory, arch, overrides, **kw):
    from kvserve.kernels.cpu import native

    if not native.available():
        pytest.skip(f"native CPU kernels: {native.status()}")
    model_dir = tiny_model_factory(arch, **overrides)
    prompts, params = _workload(overrides.get("vocab_size", 512))
    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, n=p.n, ignore_eos=p.ignore_eos,
                             logprobs=3) for p in params]

    def run(stack: bool):
        llm = LLM(str(model_dir), **SQUEEZED, **kw)
        model = llm.engine.model
        if not stack:
            model._native_stack = None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        used = model._native_stack
        llm.close()
        return [[(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]) for c in o.outputs]
                for o in outs], used

    with_stack, stack = run(True)
    per_op, _ = run(False)
    assert isinstance(stack, native.DecoderStack)
    assert with_stack == per_op


@pytest.mark.parametrize("arch,overrides,kw", [
    pytest.param("gemma2", {}, {}, id="gemma-sandwich-norms"),
    pytest.param("qwen2_moe", {}, {}, id="moe"),
    pytest.param("deepseek_v2", {}, {}, id="mla"),
    pytest.param("llama", {}, dict(dtype="bfloat16"), id="bfloat16"),
])
def test_native_decoder_stack_only_takes_plain_float32_llama_layers(tiny_model_factory, arch, overrides, kw):
    llm = LLM(str(tiny_model_factory(arch, **overrides)), **SQUEEZED, **kw)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert llm.engine.model._native_stack is None
    llm.close()
