"""The executor package on its own: platforms, the step message, the executor's interface, and
close() handing rank 0's weights, pools and graphs back."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.executor import protocol
from kvserve.runtime.executor.forward_input import ForwardInput
from kvserve.runtime.executor.platform import CPU, CUDA, platform_for, resolve_device


@pytest.mark.parametrize("device, platform", [("cpu", CPU), (torch.device("cpu"), CPU), ("cuda", CUDA),
                                              ("cuda:1", CUDA)])
def test_each_device_has_one_platform(device, platform):
    assert platform_for(device) is platform


def test_platforms_say_what_their_device_does():
    assert (CPU.dist_backend, CPU.default_attention_backend, CPU.supports_cuda_graphs, CPU.supports_compile) == \
        ("gloo", "torch", False, False)
    assert (CUDA.dist_backend, CUDA.supports_cuda_graphs, CUDA.supports_compile) == ("nccl", True, True)
    assert CPU.attention_backend_name("auto") == "torch" and CPU.attention_backend_name("triton") == "triton"
    assert CPU.free_memory_bytes(torch.device("cpu")) is None


def test_an_unsupported_device_is_refused():
    with pytest.raises(ValueError, match="device: 'meta' is not supported"):
        platform_for("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_names_the_device(device):
    with pytest.raises(ValueError, match=f"device: '{device}' requested but CUDA is not available"):
        resolve_device(device)
    assert resolve_device("auto") == torch.device("cpu")


def _meta(tables, slots, seq_lens, **kw) -> AttentionMetadata:
    return AttentionMetadata(query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             block_tables=torch.tensor(tables, dtype=torch.int32),
                             slot_mapping=torch.tensor(slots), max_query_len=1, max_seq_len=max(seq_lens),
                             is_decode_only=True, **kw)


def test_a_step_with_kv_cache_groups_travels_whole():
    """One metadata per window (full attention: None), nested in the outer one, and the group
    copies: what a hybrid model's step sends to every rank."""
    full, local = _meta([[1, 2]], [9], [6]), _meta([[3, 0]], [13], [6])
    outer = _meta([[1, 2]], [9], [6], kv_groups={None: full, 8: local})
    step = ForwardInput(torch.tensor([5]), torch.tensor([5]), outer, [0], [(0, 1, 4), (1, 3, 7)])
    kind, (got,) = protocol.decode(protocol.encode(protocol.STEP, step))
    assert kind == protocol.STEP and isinstance(got, ForwardInput)
    assert got.logits_rows == [0] and got.block_copies == [(0, 1, 4), (1, 3, 7)]
    assert set(got.meta.kv_groups) == {None, 8}
    for window, want in ((None, full), (8, local)):
        have = got.meta.kv_groups[window]
        assert torch.equal(have.block_tables, want.block_tables) and torch.equal(have.slot_mapping, want.slot_mapping)
        assert have.kv_groups is None
    assert got.to(torch.device("cpu")) is got  # nothing to move on the CPU


def test_the_engine_talks_to_the_executor_interface(tiny_llama):
    from kvserve.runtime import LLM, SamplingParams
    from kvserve.runtime.executor.uniproc import UniProcExecutor

    with LLM(str(tiny_llama), num_kv_blocks=32, block_size=4) as llm:
        ex = llm.engine.executor
        assert isinstance(ex, UniProcExecutor)
        assert (ex.kv_groups, ex.num_blocks_per_group, ex.block_size, ex.kv_release_window) == (None, [32], 4, None)
        assert ex.supports_overlap and ex.model_weight_bytes > 0
        assert ex.rank_reports[0]["num_kv_blocks"] == 32
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        assert ex.last_timings is not None and all(t >= 0 for t in ex.last_timings)
        ex.check_health()


def test_close_hands_back_weights_pools_and_graphs(tiny_llama):
    """A second engine in the same process must see the first one's memory free (on a GPU its
    KV sizing reads free memory): after close() nothing of rank 0 is reachable."""
    from kvserve.runtime import LLM, SamplingParams

    llm = LLM(str(tiny_llama), num_kv_blocks=32, block_size=4)
    worker = llm.engine.executor.driver_worker
    worker.graphs = worker.build_graphs([1, 2], max_model_len=64, capture=False)  # the CPU twin
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    refs = [weakref.ref(next(llm.engine.model.parameters())), weakref.ref(llm.engine.kv_caches[0][0]),
            weakref.ref(worker.graphs), weakref.ref(llm.engine.model)]
    llm.close()
    llm.close()  # idempotent
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    assert llm.engine.model is None and llm.engine.kv_caches == []


@pytest.mark.parametrize("arch", ["llama", "gemma2", "deepseek_v3"])
def test_the_profiling_step_runs_and_writes_no_kv(tiny_model_factory, arch):
    """On a GPU the KV budget is total x utilization minus the activation peak of this step
    (a prefill of the largest step, logits for max_num_seqs rows). Here: every model family runs
    it, also with KV cache groups (gemma2) and the latent cache (MLA), and no pool changes."""
    from kvserve.runtime import LLM

    with LLM(str(tiny_model_factory(arch)), num_kv_blocks=16, block_size=4, max_num_seqs=3) as llm:
        ex = llm.engine.executor
        assert (ex.kv_groups is not None) == (arch == "gemma2")
        for layer in ex.kv_caches:
            for pool in layer:
                pool.fill_(0.5)
        ex.driver_worker.profile_run(ex.kv_groups, 37)  # 9 full one-block sequences and one of 1
        assert all(bool((pool == 0.5).all()) for layer in ex.kv_caches for pool in layer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_second_engine_in_one_process_gets_the_same_kv_pool(tiny_llama):
    """The first engine's weights, pools and graphs are handed back on close(), and the
    profiled budget does not count what a closed engine left in the allocator's cache.

    Not to the block: what CUDA and its libraries load on first use (kernels, cuBLAS workspaces
    per stream) stays for the process's life, and the first engine measures some of it only after
    sizing. On an H200 the two pools differed by 28 MiB of 68 GiB after the in-use memory was read
    again after profiling (98 MiB before); a closed engine that leaked its pools would cost GiBs."""
    import os

    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.skip("sizes the pool from the device's free memory, which other pytest-xdist workers' engines "
                    "change while it runs: run it without -n")
    from kvserve.runtime import LLM

    pool_bytes = []
    for _ in range(2):
        llm = LLM(str(tiny_llama), device="cuda", gpu_memory_utilization=0.5)
        pool_bytes.append(sum(t.numel() * t.element_size() for layer in llm.engine.executor.kv_caches for t in layer))
        llm.close()
    assert abs(pool_bytes[0] - pool_bytes[1]) <= 64 * 2**20, pool_bytes


def test_the_platform_is_asked_which_kernels_serve_an_operation():
    """One named question per operation; CUDA never takes the native CPU kernels, the CPU takes
    them for float32 only (and only where they loaded)."""
    from kvserve.kernels.cpu import native

    loaded = native.available()
    f32 = torch.zeros(4, 2, 8)
    bf16 = f32.to(torch.bfloat16)
    pool = torch.zeros(3, 4, 2, 8)
    logits = torch.zeros(2, 64)
    assert CPU.native_kernels() == loaded
    assert CPU.native_ops(f32) == loaded and not CPU.native_ops(bf16)
    assert CPU.native_write_kv(f32, f32, pool) == loaded and not CPU.native_write_kv(bf16, bf16, pool.bfloat16())
    assert CPU.native_token_bitmask(logits) == loaded
    assert not CPU.native_token_bitmask(logits.t()) and not CPU.native_token_bitmask(logits.double())
    assert CPU.native_int_weights() == loaded and CPU.torch_packed_int_weights()
    for question in (CUDA.native_ops(f32), CUDA.native_write_kv(f32, f32, pool),
                     CUDA.native_decode_attention(f32, pool), CUDA.native_token_bitmask(logits), CUDA.native_kernels(),
                     CUDA.native_int_weights(), CUDA.torch_packed_int_weights()):
        assert question is False


def test_cuda_n_becomes_the_current_device(monkeypatch):
    """device="cuda:N" must launch on GPU N (each tensor-parallel rank on its own); a bare "cuda"
    keeps the current device. No GPU here: the call torch would make is recorded instead."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    CUDA.set_device(torch.device("cuda"))
    CUDA.set_device(torch.device("cuda", 1))
    CPU.set_device(torch.device("cpu"))
    assert calls == [torch.device("cuda", 1)]


@pytest.mark.parametrize("total,util,in_use,act,graphs,want", [
    (80 * 2**30, 0.9, 10 * 2**30, 2 * 2**30, 2**30, 72 * 2**30 - 13 * 2**30 - 1),  # 72 GiB - 13 GiB (floor)
    (1000, 0.5, 100, 50, 0, 350),
    (1000, 0.5, 400, 50, 100, -50),  # nothing left: determine_num_blocks then says no block fits
])
def test_the_kv_budget_leaves_room_for_activations_and_graphs(total, util, in_use, act, graphs, want):
    from kvserve.runtime.kv_cache import profiled_kv_budget

    assert abs(profiled_kv_budget(total, util, in_use, act, graphs) - want) <= 1
    with pytest.raises(ValueError, match="graph_bytes"):
        profiled_kv_budget(total, util, in_use, act, -1)


@pytest.mark.parametrize("first,each,n,want", [(1000, 10, 4, 1030), (1000, 10, 1, 1000), (5, -3, 3, 5),
                                               (7, 7, 0, 0)])
def test_graph_memory_extrapolates_from_two_captures(first, each, n, want):
    from kvserve.runtime.kv_cache import graph_memory_estimate

    assert graph_memory_estimate(first, each, n) == want


def _scripted_platform(free_values, total, allocated=0, peak=0):
    """A platform that reports device memory from a script: the CPU stands in for a GPU whose
    numbers the test chooses (nothing here has a device with fixed memory to measure)."""
    from dataclasses import dataclass

    from kvserve.runtime.executor.platform import CpuPlatform

    free = iter(free_values)

    @dataclass(frozen=True)
    class Scripted(CpuPlatform):
        def free_memory_bytes(self, device):
            return next(free), total

        def memory_allocated(self, device):
            return allocated

        def peak_memory_allocated(self, device):
            return peak

    return Scripted()


def test_kv_sizing_profiles_the_largest_step_and_the_decode_graphs(tiny_llama, monkeypatch):
    """The budget subtracts the activation peak of a prefill of max_num_batched_tokens (with
    max_num_seqs logits rows) and the graphs' memory from two measured captures (the CPU twin
    runs their forwards over a one-block pool: no real pool is touched)."""
    from kvserve.runtime import LLM

    with LLM(str(tiny_llama), num_kv_blocks=16, block_size=4, max_num_seqs=3, max_model_len=64) as llm:
        ex = llm.engine.executor
        worker = ex.driver_worker
        for layer in ex.kv_caches:
            for pool in layer:
                pool.fill_(0.5)
        rows = []
        real_logits = worker.model.compute_logits
        monkeypatch.setattr(worker.model, "compute_logits", lambda h: rows.append(h.shape[0]) or real_logits(h))
        monkeypatch.setattr(worker, "graph_sizes", lambda: ([1, 2, 4, 8], None))
        real_profile = worker.profile_graphs
        calls = []

        def profile_graphs(kv_groups, sizes, *, max_model_len, capture=None):
            calls.append((sizes, max_model_len))
            return real_profile(kv_groups, sizes, max_model_len=max_model_len, capture=False)

        monkeypatch.setattr(worker, "profile_graphs", profile_graphs)
        # free before profiling, then before / after the largest graph / after the smallest one, then
        # once all is released: 50 MiB less than at first (kernels the first step loaded stay loaded)
        gib, mib = 2**30, 2**20
        worker.platform = _scripted_platform([6 * gib, 5 * gib, 5 * gib - 1000, 5 * gib - 1010, 6 * gib - 50 * mib],
                                             8 * gib, allocated=100, peak=100 + 3000)
        budget = worker._profiled_kv_budget(None, 40, 64)
        assert rows == [3]  # max_num_seqs sampler rows of the 40-token step
        assert calls == [([1, 2, 4, 8], 64)]
        in_use = 2 * gib + 50 * mib
        assert budget == int(8 * gib * llm.engine.config.gpu_memory_utilization) - in_use - 3000 - (1000 + 3 * 10)
        assert all(bool((pool == 0.5).all()) for layer in ex.kv_caches for pool in layer)


def test_a_failed_graph_capture_is_an_error_with_its_traceback_and_a_stat(tiny_llama, caplog):
    """Capture needs CUDA; on the CPU it fails for real, which is the fault injected here."""
    import logging

    from kvserve.runtime import LLM
    from kvserve.runtime.server.metrics import EXPORTED_NAMES

    with LLM(str(tiny_llama), num_kv_blocks=16, block_size=4) as llm:
        worker = llm.engine.executor.driver_worker
        assert llm.engine.get_stats().cuda_graph_capture_failures_total == 0
        with caplog.at_level(logging.ERROR, logger="kvserve.runtime.executor.worker"):
            assert worker.build_graphs([1, 2], max_model_len=64, capture=True) is None
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and "CUDA graph capture failed" in r.message]
        assert len(errors) == 1 and errors[0].exc_info is not None
        assert llm.engine.get_stats().cuda_graph_capture_failures_total == 1
        assert "kvserve:cuda_graph_capture_failures_total" in EXPORTED_NAMES
        # A measuring capture that fails (while sizing the KV cache) also keeps the real one from being tried.
        assert worker.profile_graphs(None, [1, 2], max_model_len=64, capture=True) == 0
        assert worker.graph_capture_failures == 2 and worker._graphs_refused


def test_a_step_message_refuses_device_tensors():
    """Rank 0 sends the step it prepared on the host; it never copies a device tensor back to send
    it (a "meta" tensor stands in for a GPU one)."""
    step = ForwardInput(torch.tensor([5]), torch.tensor([5]), _meta([[1]], [9], [6]), [0])
    protocol.encode(protocol.STEP, step)  # host tensors travel
    with pytest.raises(ValueError, match="host tensors only; got one on meta"):
        protocol.encode(protocol.STEP, ForwardInput(torch.empty(1, device="meta"), torch.tensor([5]), step.meta, [0]))
