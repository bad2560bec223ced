"""Tensor parallelism end to end on CPU: real worker processes, real gloo collectives, 2 ranks.

Greedy tp=2 equals tp=1 token for token; the KV pool each rank really allocates is what the
capacity model predicts; a killed worker makes the engine raise within seconds naming the rank,
and nothing is left running afterwards.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import threading
import time

import pytest
import torch

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.capacity import (
    ModelShape,
    blocks_for_budget,
    kv_bytes_per_token,
    plan_capacity,
    weight_bytes_per_gpu,
)
from kvserve.runtime.executor import protocol
from kvserve.runtime.executor.multiproc import TensorParallelError, WorkerDiedError

BLOCK_SIZE = 4
KV_BUDGET = 96 * 1024  # bytes per rank: tp=1 has 96 blocks for the GQA llama, tp=2 192




def tp_worker_pids() -> set[int]:
    """Live children of this process that are tensor-parallel workers (from /proc, no psutil)."""
    me = str(os.getpid())
    found = set()
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[1] != me or fields[0] == "Z":
                continue
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if b"kvserve.runtime.executor.worker_process" in cmdline:
            found.add(int(stat.parent.name))
    return found


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 40, 3, 29)]


def _generate(llm: LLM, prompts) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 9, 16, 31, 5)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


CASES = {
    # 4 query heads, 2 KV heads: each rank gets one KV head, so KV bytes per token halve.
    "llama-gqa-split": ("llama", dict(num_key_value_heads=2)),
    # Qwen3 (q/k RMSNorm) with one KV head: both ranks keep a copy of it.
    "qwen3-mqa-replicated": ("qwen3", dict(num_key_value_heads=1)),
    # q/k/v bias, tied embeddings and a vocabulary that 2 does not divide (padded shards).
    "qwen2-tied-odd-vocab": ("qwen2", dict(tie_word_embeddings=True, vocab_size=509)),
    # Gemma 2: local/global layers with a window (8) shorter than the prompts, soft-capping.
    "gemma2-window-softcaps": ("gemma2", dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5)),
    # Every layer local: rank 0 gives back blocks behind the window; the workers follow its tables.
    "mistral-window-release": ("mistral", dict(sliding_window=6)),
    # Experts split by intermediate size (routed and the gated shared expert), router replicated.
    "qwen2moe-experts-split": ("qwen2_moe", {}),
    # MLA: heads split, the latent (and its cache) replicated, so KV capacity does not grow.
    "deepseekv3-mla-latent-replicated": ("deepseek_v3", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1_and_capacity_model(tiny_model_factory, case):
    arch, overrides = CASES[case]
    model_dir = tiny_model_factory(arch, **overrides)
    kw = dict(kv_cache_memory_bytes=KV_BUDGET, block_size=BLOCK_SIZE, max_num_batched_tokens=32,
              dtype="float32", device="cpu")
    # The capacity checks below are for one block table serving every layer: local and global
    # layers get KV cache groups otherwise (tests/test_tp_matrix.py runs them at tp=2).
    kw["disable_hybrid_kv_cache_manager"] = arch == "gemma2"
    with LLM(str(model_dir), **kw) as llm1:
        shape = llm1.engine.model_config.shape
        prompts = _prompts(shape.vocab_size)
        want = _generate(llm1, prompts)
        stats1 = llm1.engine.get_stats()
        weights1 = sum(p.numel() * p.element_size() for p in llm1.engine.model.parameters())
    with LLM(str(model_dir), tensor_parallel_size=2, **kw) as llm2:
        got = _generate(llm2, prompts)
        stats2 = llm2.engine.get_stats()
        reports = llm2.engine.executor.rank_reports
        assert len(tp_worker_pids()) == 1
    assert got == want
    assert not tp_worker_pids(), "close() must reap every worker"

    # The runtime's pool is what the capacity model says a per-rank budget holds ...
    for tp, stats in ((1, stats1), (2, stats2)):
        blocks = blocks_for_budget(KV_BUDGET, shape, 4, BLOCK_SIZE, tp)
        assert stats.kv_blocks_total == blocks and stats.tensor_parallel_size == tp
        assert stats.kv_cache_capacity_tokens == blocks * BLOCK_SIZE
        plan = plan_capacity(shape, dtype_size=4, block_size=BLOCK_SIZE, tp=tp, gpu_memory_utilization=1.0,
                             gpu_memory_bytes=weight_bytes_per_gpu(shape, 4, tp) + KV_BUDGET,
                             activation_reserve_bytes=0)
        assert plan.kv_tokens == stats.kv_cache_capacity_tokens
    # ... capacity grows with tp exactly as KV bytes per token per rank shrink ...
    growth = kv_bytes_per_token(shape, 4, 1) / kv_bytes_per_token(shape, 4, 2)
    assert growth == (1 if shape.num_kv_heads == 1 or shape.mla is not None else 2)
    assert stats2.kv_blocks_total == growth * stats1.kv_blocks_total
    # ... and every rank really allocated that many bytes, holding only its weight shard.
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["num_kv_blocks"] == stats2.kv_blocks_total
        assert r["kv_cache_bytes"] == stats2.kv_blocks_total * BLOCK_SIZE * kv_bytes_per_token(shape, 4, 2)
        assert r["weight_bytes"] < 0.75 * weights1
        assert abs(r["weight_bytes"] - weight_bytes_per_gpu(shape, 4, 2)) <= 0.02 * r["weight_bytes"]


def test_tp2_shared_prefixes_and_forks_match_tp1(tiny_model_factory, monkeypatch):
    """Prefix-cache hits and n > 1 forks (copy-on-write of a shared partial block) under tp=2:
    rank 0 decides and copies, the workers must copy the same blocks in their own pools."""
    import kvserve.runtime.executor.worker as model_runner

    copied = []
    real_copy = model_runner.copy_blocks
    monkeypatch.setattr(model_runner, "copy_blocks", lambda caches, pairs: (copied.extend(pairs),
                                                                             real_copy(caches, pairs)))
    model_dir = tiny_model_factory("llama")
    prefix = list(range(10, 30))  # 5 full blocks of 4
    prompts = [prefix + [40, 41], prefix + [50], prefix + [40, 41], [7, 8, 9, 10, 11, 12]]
    params = [SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(n=3, temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True),
              SamplingParams(n=2, temperature=0.7, seed=11, max_tokens=10, ignore_eos=True)]
    kw = dict(kv_cache_memory_bytes=KV_BUDGET, block_size=BLOCK_SIZE, dtype="float32", device="cpu")
    results = {}
    for tp in (1, 2):
        with LLM(str(model_dir), tensor_parallel_size=tp, **kw) as llm:
            llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # cache the prefix
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[tp] = [[list(c.token_ids) for c in o.outputs] for o in outs]
            assert llm.engine.get_stats().prefix_cache_hits_total > 0
    assert copied, "the workload must exercise copy-on-write"
    assert results[2] == results[1]


def test_bad_tensor_parallel_size_is_a_value_error(tiny_model_factory):
    llama = tiny_model_factory("llama")  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size.* 3 does not divide the model's 4 attention heads"):
        LLM(str(llama), tensor_parallel_size=3, device="cpu")
    odd_mlp = tiny_model_factory("llama", intermediate_size=130)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 does not divide .*intermediate_size 130"):
        LLM(str(odd_mlp), tensor_parallel_size=4, device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(llama), tensor_parallel_size=0, device="cpu")
    assert not tp_worker_pids()  # refused before any worker started


def test_killed_worker_mid_generate_fails_fast_naming_the_rank(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    llm = LLM(str(model_dir), tensor_parallel_size=2, kv_cache_memory_bytes=KV_BUDGET * 4,
              block_size=BLOCK_SIZE, device="cpu")
    (pid,) = llm.engine.executor.worker_pids
    assert tp_worker_pids() == {pid}
    killed_at: list[float] = []
    steps = 0
    step = llm.engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        if steps == 20:  # mid-generate: requests are running, the worker is in its loop
            threading.Timer(0.05, lambda: (killed_at.append(time.monotonic()), os.kill(pid, signal.SIGKILL))).start()
        return step()

    llm.engine.step = counting_step
    params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) killed by signal SIGKILL") as info:
        llm.generate([[5, 6, 7, 8]] * 4, params, use_tqdm=False)
    raised_after = time.monotonic() - killed_at[0]
    # Far below the 120 s collective timeout, with room for a loaded CI machine.
    assert raised_after < 15.0, raised_after
    assert info.value.rank == 1 and info.value.pid == pid
    # Nothing is left: the dead worker is reaped, the request's blocks are free, and the engine
    # keeps saying why it cannot run instead of hanging.
    assert not tp_worker_pids()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert llm.engine.block_manager.num_used_blocks == 0
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(WorkerDiedError):
        llm.engine.check_health()
    assert time.monotonic() - started < 5.0  # answered from the recorded failure, no collective
    llm.close()
    llm.close()  # idempotent


def test_worker_death_while_idle_is_seen_by_health_check(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    with LLM(str(model_dir), tensor_parallel_size=2, kv_cache_memory_bytes=KV_BUDGET,
             block_size=BLOCK_SIZE, device="cpu") as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
        llm.engine.check_health()
        (pid,) = llm.engine.executor.worker_pids
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while llm.engine.executor.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(WorkerDiedError, match="rank 1 .* killed by signal SIGTERM"):
            llm.engine.check_health()
        assert not tp_worker_pids()
    with pytest.raises(TensorParallelError):
        llm.engine.check_health()


def test_hung_worker_is_bounded_by_the_collective_timeout(tiny_model_factory, monkeypatch):
    """A worker that stops responding without dying (SIGSTOP) cannot hang the engine: the step's
    collective times out, the engine raises, and the stopped worker is killed and reaped."""
    monkeypatch.setenv("KVSERVE_TP_TIMEOUT_S", "2")
    llm = LLM(str(tiny_model_factory("llama")), tensor_parallel_size=2, kv_cache_memory_bytes=KV_BUDGET * 4,
              block_size=BLOCK_SIZE, device="cpu")
    try:
        (pid,) = llm.engine.executor.worker_pids
        step = llm.engine.step
        steps = 0

        def stopping_step():
            nonlocal steps
            steps += 1
            if steps == 10:
                os.kill(pid, signal.SIGSTOP)
            return step()

        llm.engine.step = stopping_step
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="every worker still running .* timeout"):
            llm.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=1500, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - started < 2 + 3 + 5  # timeout + grace for a death to show + slack
        assert not tp_worker_pids()
    finally:
        llm.close()


def test_worker_exception_mid_generate_is_reported_with_its_cause(tiny_model_factory, tmp_path, monkeypatch):
    """A worker that raises (here: its 5th step, injected through sitecustomize in the worker
    processes only) sends its traceback; the engine's error names the rank and the exception."""
    (tmp_path / "sitecustomize.py").write_text(
        "import kvserve.runtime.kv_cache as kv\n"
        "real, calls = kv.copy_blocks, [0]\n"
        "def copy_blocks(caches, pairs):\n"
        "    calls[0] += 1\n"
        "    if calls[0] == 5:\n"
        "        raise RuntimeError('injected failure in step 5')\n"
        "    return real(caches, pairs)\n"
        "kv.copy_blocks = copy_blocks\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    llm = LLM(str(tiny_model_factory("llama")), tensor_parallel_size=2, kv_cache_memory_bytes=KV_BUDGET,
              block_size=BLOCK_SIZE, device="cpu")
    try:
        with pytest.raises(WorkerDiedError, match=r"rank 1 .* failed: RuntimeError: injected failure in step 5"):
            llm.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
        assert not tp_worker_pids()
    finally:
        llm.close()


def test_startup_failure_stops_the_workers(tiny_model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_model_factory("llama")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LLM(str(tmp_path), tensor_parallel_size=2, kv_cache_memory_bytes=KV_BUDGET, device="cpu")
    assert not tp_worker_pids()
    # The process group is gone too: a new tensor-parallel engine can start in this process.
    with LLM(str(src), tensor_parallel_size=2, kv_cache_memory_bytes=KV_BUDGET, device="cpu") as llm:
        assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_step_message_round_trip():
    from kvserve.runtime.attention.backend import AttentionMetadata

    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
                             seq_lens=torch.tensor([3, 9], dtype=torch.int32),
                             block_tables=torch.tensor([[1, 0, 0], [2, 5, 7]], dtype=torch.int32),
                             slot_mapping=torch.tensor([4, 5, 6, 34]), max_query_len=3, max_seq_len=9,
                             is_decode_only=False)
    prepared = (torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 8]), meta, [2, 3])
    extra = torch.randn(3, dtype=torch.bfloat16)  # numpy has no bfloat16: travels as a tensor
    kind, (copies, got, got_extra) = protocol.decode(protocol.encode(protocol.STEP, [(1, 9)], prepared, extra))
    assert kind == protocol.STEP and copies == [(1, 9)]
    assert torch.equal(got_extra, extra) and got_extra.dtype == torch.bfloat16
    assert got[3] == [2, 3] and isinstance(got[2], AttentionMetadata)
    for a, b in zip(got[:2], prepared[:2]):
        assert torch.equal(a, b) and a.dtype == b.dtype
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(got[2], name), getattr(meta, name))
        assert getattr(got[2], name).dtype == getattr(meta, name).dtype
    assert (got[2].max_query_len, got[2].max_seq_len, got[2].is_decode_only) == (3, 9, False)


@pytest.mark.parametrize("code, words", [(-9, "killed by signal SIGKILL"), (-15, "killed by signal SIGTERM"),
                                          (1, "exited with code 1"), (0, "exited with code 0"),
                                          (None, "is still running")])
def test_describe_exit(code, words):
    assert protocol.describe_exit(code) == words


def test_capacity_shape_helpers_agree_with_tp_layout():
    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=512)
    assert [shape.kv_heads_per_rank(tp) for tp in (1, 2, 4)] == [2, 1, 1]
    assert shape.valid_tp_degrees(8) == [1, 2, 4]


async def _agent_signals(engine_url: str) -> dict:
    import aiohttp
    from aiohttp import web

    from kvserve.runtime.agent.app import AgentConfig, build_app

    runner = web.AppRunner(build_app(AgentConfig(engine_url=engine_url, interval_s=0.1)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/signals"
    try:
        async with aiohttp.ClientSession() as client:
            deadline = time.monotonic() + 10
            while True:
                async with client.get(url) as r:
                    sig = await r.json()
                if not sig["stale"] or time.monotonic() > deadline:
                    return sig
                await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()


def test_server_exports_tp_capacity_and_fails_health_when_a_worker_dies(tiny_model_factory):
    from server_helpers import http, m, metrics, wait_until

    from kvserve.runtime.server.main import ServerThread

    model_dir = tiny_model_factory("llama")
    srv = ServerThread([str(model_dir), "--served-model-name", "tiny", "--port", "0", "--device", "cpu",
                        "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", str(KV_BUDGET),
                        "--block-size", str(BLOCK_SIZE), "--drain-timeout", "5"]).start()
    try:
        wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
        status, _, body = http(srv.url, "POST", "/v1/completions",
                               {"model": "tiny", "prompt": "Hello world", "max_tokens": 5, "temperature": 0})
        assert status == 200, body
        snap = metrics(srv.url)
        shape = ModelShape.from_hf_config(__import__("json").loads((model_dir / "config.json").read_text()))
        capacity = BLOCK_SIZE * blocks_for_budget(KV_BUDGET, shape, 4, BLOCK_SIZE, 2)
        assert m(snap, "kvserve:tensor_parallel_size") == 2
        assert m(snap, "kvserve:kv_cache_capacity_tokens") == capacity
        # What the operator's autoscaler reads, through the sidecar agent.
        sig = asyncio.run(_agent_signals(srv.url))
        assert (sig["tensor_parallel_size"], sig["kv_cache_capacity_tokens"]) == (2, capacity)
        (pid,) = tp_worker_pids()
        os.kill(pid, signal.SIGKILL)
        # Idle engine: the health check between steps notices, and /health turns 500 for the kubelet.
        wait_until(lambda: http(srv.url, "GET", "/health")[0] == 500, timeout=5)
        status, _, body = http(srv.url, "POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert status == 503 and b"rank 1" in body, body
    finally:
        srv.stop()
    assert not tp_worker_pids()
