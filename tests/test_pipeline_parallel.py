"""Pipeline parallelism end to end on CPU: real worker processes, gloo point-to-point between stages.

Greedy PP=2 equals PP=1 token for token on the tiny families (untied and tied heads, Gemma's
sandwich norms and embedding scale, MoE + MLA) and on the real SmolLM2; the features that work at
TP (prefix caching, chunked prefill, preemption, n-gram speculative decoding, structured outputs,
quantized weights) give the same tokens at PP=2; TP=2 x PP=2 runs on four processes; each stage
holds only its layers' weights and KV pools; a killed stage fails the engine and the server's
/health naming the rank.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from test_tensor_parallel import tp_worker_pids as _all_worker_pids

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.capacity import ModelShape, blocks_for_budget, plan_capacity
from kvserve.runtime.capacity.pipeline import layer_shape, split_layers, stage_weight_bytes
from kvserve.runtime.executor.multiproc import WorkerDiedError, spare_worker_pids

# A closed engine's workers wait as spares for the next engine here (conftest.recycled_workers).
pytestmark = pytest.mark.usefixtures("recycled_workers")


def tp_worker_pids() -> set[int]:
    """Worker processes serving an engine (spares waiting for the next one are not)."""
    return _all_worker_pids() - set(spare_worker_pids())

KW = dict(block_size=4, max_num_batched_tokens=32, dtype="float32", device="cpu", kv_cache_memory_bytes=256 * 1024)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 40, 3)]


def _generate(llm: LLM, prompts, params=None) -> list[list[int]]:
    params = params or [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 7, 9, 15)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


# llama-untied last: its case uses the shared PP=2 engine (pp2_llama), whose worker must not be
# alive while the other cases count worker processes; the killed-stage case right after ends it.
FAMILIES = {
    # Tied head on the last stage (its own copy of the embedding) and a vocabulary 2 does not divide.
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, vocab_size=509)),
    # Sandwich norms, embedding scale on stage 0, local/global layers (a block table per group at PP).
    "gemma2": ("gemma2", dict(final_logit_softcapping=1.5)),
    # A dense first layer then MoE, latent attention.
    "deepseek_v3": ("deepseek_v3", {}),
    "llama-untied": ("llama", dict(num_hidden_layers=3)),
}


def _family_dir(factory, family: str):
    arch, overrides = FAMILIES[family]
    return factory(arch, **overrides)


@pytest.fixture(scope="module")
def pp2_llama(tiny_model_factory):
    """One PP=2 engine on the tiny Llama, shared: its family case checks outputs, then the
    killed-stage case kills its worker (a worker process start is most of a PP test's cost)."""
    llm = LLM(str(_family_dir(tiny_model_factory, "llama-untied")), pipeline_parallel_size=2, **KW)
    yield llm
    llm.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pp2_matches_pp1(tiny_model_factory, request, family):
    model_dir = _family_dir(tiny_model_factory, family)
    # Greedy rows, plus seeded random rows that finish first (one asking for logprobs, one n = 2
    # with penalties and min_tokens): the last stage samples those with each request's generator
    # state sent along and sends back tokens, logprobs and the advanced states, so the draws are
    # PP=1's; the all-greedy steps after them send only argmax ids.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 7, 9, 15)]
    params += [SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=5, ignore_eos=True),
               SamplingParams(temperature=1.0, seed=12, max_tokens=4, ignore_eos=True, logprobs=2),
               SamplingParams(temperature=0.8, seed=13, n=2, presence_penalty=0.5, repetition_penalty=1.2,
                              min_tokens=2, max_tokens=4, ignore_eos=True)]

    def generate(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        logprobs = [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in outs[5].outputs[0].logprobs]
        return [[list(c.token_ids) for c in o.outputs] for o in outs], logprobs

    with LLM(str(model_dir), **KW) as llm1:
        prompts = _prompts(llm1.engine.model_config.vocab_size)
        prompts += prompts[:3]
        want = generate(llm1)
        full_weights = llm1.engine.executor.model_weight_bytes
    shared = family == "llama-untied"
    llm2 = (request.getfixturevalue("pp2_llama") if shared
            else LLM(str(model_dir), pipeline_parallel_size=2, **KW))
    try:
        got = generate(llm2)
        executor = llm2.engine.executor
        worker = executor.driver_worker
        assert worker.steps_with_stage_rows > 0 and worker.steps_sampled_on_last_stage > worker.steps_with_stage_rows
        stats = llm2.engine.get_stats()
        reports = executor.rank_reports
        assert len(tp_worker_pids()) == 1
        # Stage 0 holds only its layers (and the embedding): less than the whole model.
        assert executor.model_weight_bytes < full_weights
        assert len(executor.kv_caches) == executor.driver_worker.layer_end
    finally:
        if not shared:
            llm2.close()
    assert got == want
    if not shared:
        assert not tp_worker_pids(), "close() must reap every worker"
    assert stats.pipeline_parallel_size == 2 and 0.0 < stats.pipeline_bubble_fraction < 1.0
    # Each stage sized KV pools for its own layers from the same budget; the replica holds the
    # smallest count, as the capacity model says.
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    kv = [blocks_for_budget(KW["kv_cache_memory_bytes"], layer_shape(shape, *r), 4, KW["block_size"], 1)
          for r in split_layers(shape, 2)]
    assert stats.kv_blocks_total == min(kv)
    assert [r["rank"] for r in reports] == [0, 1]


def _run(engine, prompts, params, abort_at=None):
    """Steps the engine to the end; aborts request "r0" at step `abort_at`. Token ids by request."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    got, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == abort_at:
            engine.abort_request("r0")
        for out in engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
    return got


def test_micro_batches_overlap_and_survive_an_abort(pp2_llama):
    """Two micro-batches in flight (one per stage), never sharing a sequence; the same greedy tokens
    as one step at a time; a request aborted while its step is in flight leaks no block."""
    engine = pp2_llama.engine
    core, executor = engine.core, engine.executor
    assert core.depth == executor.max_concurrent_batches == 2
    prompts = _prompts(engine.model_config.vocab_size) * 2
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 7, 9, 15) * 2]
    core.depth = 1
    try:
        want = _run(engine, prompts, params)
    finally:
        core.depth = 2
    flights: list[set[int]] = []
    most = 0
    launch, land = executor.launch_model, executor.land_model

    def launch_model(model_input):
        nonlocal most
        ids = {item.seq.seq_id for item in model_input.scheduled}
        assert not any(ids & f for f in flights), "a sequence in two micro-batches in flight"
        flights.append(ids)
        most = max(most, len(flights))
        return launch(model_input)

    def land_model(pending):
        flights.pop(0)
        return land(pending)

    executor.launch_model, executor.land_model = launch_model, land_model
    try:
        assert _run(engine, prompts, params) == want
        assert most == 2
        got = _run(engine, prompts, params, abort_at=4)
    finally:
        del executor.launch_model, executor.land_model
    assert got.keys() == want.keys() and all(got[k] == want[k] for k in want if k != "r0")
    assert len(got["r0"]) < len(want["r0"])
    assert engine.block_manager.num_used_blocks == 0 and not core._queue


def test_killed_stage_mid_generate_raises_naming_the_rank(pp2_llama):
    """Kills the shared engine's stage 1 (this case is its last user)."""
    llm = pp2_llama
    (pid,) = llm.engine.executor.worker_pids
    steps = 0
    step = llm.engine.step

    def killing_step():
        nonlocal steps
        steps += 1
        if steps == 5:
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        return step()

    llm.engine.step = killing_step
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) killed by signal SIGKILL"):
        llm.generate([[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=500, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - started < 15.0
    assert llm.engine.block_manager.num_used_blocks == 0
    llm.close()
    assert not tp_worker_pids()


def test_pp2_features_match_pp1(tiny_model_factory):
    """Prefix caching (shared prompts), chunked prefill (max 8 tokens a step), preemption (a pool
    too small for every sequence at once), n-gram speculative decoding, a regex constraint and
    int8 weights, all at once: the same tokens at PP=2 as at PP=1, with and without micro-batches
    in flight."""
    model_dir = tiny_model_factory("llama", num_hidden_layers=4)
    kw = dict(KW, num_kv_blocks=14, max_num_batched_tokens=8, quantization="int8",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    base = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    prompts = [base + [20 + i] for i in range(4)] + [[3, 4, 3, 4, 3, 4]]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True) for _ in range(4)]
    params.append(SamplingParams(temperature=0, max_tokens=10, structured_outputs={"regex": "[a-c]{3,6}"}))
    outs, pids = [], []
    # The last run drops speculative decoding (greedy drafting gives the same tokens), so two
    # micro-batches are in flight under the same preemption and prefix-cache pressure.
    for pp, spec in ((1, True), (2, True), (2, False)):
        kw_run = kw if spec else {k: v for k, v in kw.items() if k != "speculative_config"}
        with LLM(str(model_dir), pipeline_parallel_size=pp, **kw_run) as llm:
            assert llm.engine.core.depth == (1 if spec else 2)
            pids.append(llm.engine.executor.worker_pids if pp > 1 else [])
            outs.append(_generate(llm, prompts, params))
            stats = llm.engine.get_stats()
            assert stats.num_preemptions_total > 0, "the pool must be small enough to preempt"
            assert stats.prefix_cache_hits_total > 0
            assert (stats.spec_decode_num_drafts_total > 0) == spec
            assert llm.engine.block_manager.num_used_blocks == 0
    assert outs[1] == outs[0] and outs[2] == outs[0]
    assert pids[2] == pids[1]  # the second engine's stage 1 served the third (recycled_workers)


def test_tp2_pp2_on_four_processes(tiny_model_factory):
    model_dir = tiny_model_factory("llama", num_hidden_layers=4)
    with LLM(str(model_dir), **KW) as llm1:
        prompts = _prompts(llm1.engine.model_config.vocab_size)
        want = _generate(llm1, prompts)
    with LLM(str(model_dir), tensor_parallel_size=2, pipeline_parallel_size=2, **KW) as llm4:
        got = _generate(llm4, prompts)
        assert len(tp_worker_pids()) == 3
        assert [r["rank"] for r in llm4.engine.executor.rank_reports] == [0, 1, 2, 3]
    assert got == want
    assert not tp_worker_pids()


def test_bad_pipeline_parallel_size_is_a_value_error(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size: 3 exceeds the model's 2 layers"):
        LLM(str(model_dir), pipeline_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(str(model_dir), pipeline_parallel_size=0, device="cpu")
    assert not tp_worker_pids()


def test_pp2_real_smollm2_matches_pp1(smollm2):
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 28, 638, 359, 346]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20)
    outs = []
    for pp in (1, 2):
        with LLM(str(smollm2.hf_dir), pipeline_parallel_size=pp, **kw) as llm:
            outs.append(_generate(llm, prompts, [params] * len(prompts)))
    assert outs[1] == outs[0]


def test_killed_stage_fails_engine_and_server_health(tiny_model_factory):
    from server_helpers import http, m, metrics, wait_until

    from kvserve.runtime.server.main import ServerThread

    model_dir = tiny_model_factory("llama")
    srv = ServerThread([str(model_dir), "--served-model-name", "tiny", "--port", "0", "--device", "cpu",
                        "--pipeline-parallel-size", "2", "--kv-cache-memory-bytes", str(256 * 1024),
                        "--block-size", "4", "--drain-timeout", "5"]).start()
    try:
        wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
        status, _, body = http(srv.url, "POST", "/v1/completions",
                               {"model": "tiny", "prompt": "Hello world", "max_tokens": 5, "temperature": 0})
        assert status == 200, body
        snap = metrics(srv.url)
        assert m(snap, "kvserve:pipeline_parallel_size") == 2
        assert 0 < m(snap, "kvserve:pipeline_bubble_fraction") < 1
        (pid,) = tp_worker_pids()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: http(srv.url, "GET", "/health")[0] == 500, timeout=5)
        status, _, body = http(srv.url, "GET", "/health")
        assert b"rank 1" in body and b"SIGKILL" in body, body
    finally:
        srv.stop()
    assert not tp_worker_pids()


# -- the split itself (pure) ----------------------------------------------------------------------

SMOL = ModelShape(num_layers=30, hidden_size=576, num_attention_heads=9, num_kv_heads=3, head_dim=64,
                  intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)


@pytest.mark.parametrize("shape, pp", [(SMOL, 1), (SMOL, 2), (SMOL, 3), (SMOL, 4), (SMOL, 30),
                                       (ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                   num_kv_heads=2, head_dim=16, intermediate_size=128,
                                                   vocab_size=512), 2)])
def test_split_layers_is_contiguous_non_empty_and_balanced(shape, pp):
    ranges = split_layers(shape, pp)
    assert ranges[0][0] == 0 and ranges[-1][1] == shape.num_layers
    assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(pp - 1))
    weights = stage_weight_bytes(shape, ranges)
    # No single layer moved between neighbours would make the heaviest stage lighter.
    per_layer = stage_weight_bytes(layer_shape(shape, 0, 1), [(0, 1)]) if pp > 1 else None
    if per_layer is not None:
        assert max(weights) - min(weights) <= max(weights) // 2 + per_layer[0]


def test_split_layers_moves_layers_off_the_vocabulary_stages():
    """SmolLM2's 49152 x 576 table is about 2.6 layers' worth: at PP=2 both ends carry a copy
    (embedding first, tied head last), so the split stays even; at PP=3 the middle stage takes more."""
    assert split_layers(SMOL, 2) == [(0, 15), (15, 30)]
    (a0, a1), (b0, b1), (c0, c1) = split_layers(SMOL, 3)
    assert b1 - b0 > a1 - a0 and b1 - b0 > c1 - c0


def test_split_layers_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="exceeds the model's 30 layers"):
        split_layers(SMOL, 31)


def test_engine_config_reads_pipeline_flag():
    import argparse

    from kvserve.runtime.server.args import add_serve_parser
    from kvserve.runtime.server.main import engine_kwargs

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    kw = engine_kwargs(parser.parse_args(["serve", "/m", "--pipeline-parallel-size", "2", "-tp", "2"]))
    assert kw["pipeline_parallel_size"] == 2 and kw["tensor_parallel_size"] == 2


def test_stage_shape_counts_only_its_layers():
    s = layer_shape(SMOL, 10, 15)
    assert s.num_layers == 5 and s.vocab_size == SMOL.vocab_size


def test_capacity_plan_at_pp2_holds_each_stage_and_about_twice_the_tokens():
    kw = dict(dtype_size=2, block_size=16, tp=1, gpu_memory_bytes=4 << 30, activation_reserve_bytes=0)
    one, two = plan_capacity(SMOL, **kw), plan_capacity(SMOL, pp=2, **kw)
    assert two.weight_bytes_per_gpu == max(stage_weight_bytes(SMOL, split_layers(SMOL, 2)))
    assert two.weight_bytes_per_gpu < one.weight_bytes_per_gpu
    # Half the layers per GPU: each token costs half the KV bytes there, so about twice the tokens.
    assert 1.9 < two.kv_tokens / one.kv_tokens < 2.2
