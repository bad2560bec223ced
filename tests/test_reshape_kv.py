"""KV across a live layout change with no configured tier (issue 22): the old engines write the
moved requests' whole blocks into a transient file tier in RAM, the new layout's ranks read them at
their own TP degree, and the directory is deleted once the requests resume
(runtime/engine/reshape_kv.py). Real engines, real gloo worker processes, the tiny Llama."""

from __future__ import annotations

import pytest

from kvserve.runtime.engine import reshape_kv
from kvserve.runtime.engine.reshape_kv import choose_root, fit_requests

PROMPTS = {f"r{i}": list(range(5 + 20 * i, 5 + 20 * i + 24)) for i in range(3)}


@pytest.mark.parametrize("need, shm_free, tmp_free, ram, want", [
    (10, 100, 1000, 400, ("shm", 100)),        # fits in /dev/shm: its free space bounds it
    (10, 1000, 1000, 400, ("shm", 100)),       # a quarter of the available RAM bounds it
    (200, 100, 1000, 4000, ("tmp", 1000)),     # /dev/shm too small (a container's 64 MB): temp dir
    (10, None, 50, 4000, ("tmp", 50)),         # no /dev/shm
    (10, None, 5000, 40, ("tmp", 10)),
])
def test_where_the_transient_tier_goes_and_its_budget(need, shm_free, tmp_free, ram, want):
    assert choose_root(need, shm_free=shm_free, tmp_free=tmp_free, ram_available=ram) == want


@pytest.mark.parametrize("sizes, budget, n", [
    ([3, 3, 3], 10, 3), ([3, 3, 3], 7, 2), ([8, 1], 5, 0), ([0, 4, 0], 4, 3), ([], 0, 0)])
def test_requests_fit_oldest_first_each_whole(sizes, budget, n):
    assert fit_requests(sizes, budget) == n


def _run(model, root, reshapes: dict[int, tuple[int, int]], factory=None) -> tuple[dict, list]:
    from kvserve.runtime.config import EngineConfig
    from kvserve.runtime.engine.data_parallel import DataParallelEngine, ReshapeError
    from kvserve.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = EngineConfig.from_args(model=str(model), device="cpu", block_size=4, num_kv_blocks=128,
                                    max_model_len=256, enable_prefix_caching=True)
    out: dict = {}
    with DataParallelEngine(config, 2, factory) as engine:
        for rid, ids in PROMPTS.items():
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
        steps = 0
        while engine.has_unfinished_requests():
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            steps += 1
            if steps in reshapes:
                try:
                    engine.reshape(*reshapes[steps])
                except ReshapeError:
                    assert factory is not None  # only where the test makes the new layout fail
        for e in engine.engines:  # every block is back in the pool, none held by a request
            assert e.core.block_manager.num_free_blocks == e.core.block_manager.num_blocks
        assert engine._move is None
        records = [r.get("kv") for r in engine.reshapes]
    return out, records


@pytest.fixture(scope="module")
def greedy(tiny_llama):
    return _run(tiny_llama, None, {})[0]


def test_kv_moves_through_a_transient_tier_across_dp_tp_dp(tiny_llama, tmp_path, monkeypatch, greedy):
    monkeypatch.setenv(reshape_kv.DIR_ENV, str(tmp_path))
    got, kv = _run(tiny_llama, tmp_path, {3: (1, 2), 7: (2, 1)})
    assert got == greedy
    for record in kv:  # every moved request's whole blocks written and read back, none recomputed
        assert record["requests"] == 3 and record["recomputed"] == 0, record
        assert record["written_blocks"] >= 3 * 6, record
        assert record["read_blocks"] >= record["written_blocks"] - 3, record
        assert record["read_tokens"] >= 3 * 24, record
    assert list(tmp_path.iterdir()) == []  # each move's directory is gone


def test_a_failed_transient_write_falls_back_to_recompute(tiny_llama, tmp_path, monkeypatch, greedy):
    from kvserve.runtime.kv_offload.store import FileStore

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setenv(reshape_kv.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(FileStore, "put", full)
    got, kv = _run(tiny_llama, tmp_path, {3: (1, 2)})
    assert got == greedy
    assert kv[0]["transient_dir"] is None or kv[0]["read_blocks"] == 0, kv
    assert list(tmp_path.iterdir()) == []


def test_over_budget_means_recompute(tiny_llama, tmp_path, monkeypatch, greedy):
    monkeypatch.setenv(reshape_kv.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(reshape_kv.BYTES_ENV, "0")
    got, kv = _run(tiny_llama, tmp_path, {3: (1, 2)})
    assert got == greedy
    assert kv[0]["transient_dir"] is None, kv
    assert list(tmp_path.iterdir()) == []


def test_a_rolled_back_reshape_reads_the_moved_kv_in_the_old_layout_and_leaves_nothing(tiny_llama, tmp_path,
                                                                                       monkeypatch, greedy):
    from kvserve.runtime.engine.llm_engine import LLMEngine

    def factory(config):  # the new layout (TP2) cannot start: the old one is built again
        if config.tensor_parallel_size == 2:
            raise RuntimeError("injected: no room for the shard")
        return LLMEngine(config)

    monkeypatch.setenv(reshape_kv.DIR_ENV, str(tmp_path))
    got, kv = _run(tiny_llama, tmp_path, {3: (1, 2)}, factory)
    assert got == greedy
    assert kv[0]["requests"] == 3 and kv[0]["read_blocks"] >= kv[0]["written_blocks"] - 3 > 0, kv
    assert list(tmp_path.iterdir()) == []
