"""bench/kernel_sweep.py: its configurations fit Hopper's shared memory, launches that Triton
compiles alike share one compile task, and its CPU smoke run (interpreter, tiny shapes) checks each
configuration against SDPA and writes the best per shape."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kernel_sweep", ROOT / "bench" / "kernel_sweep.py")
ks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ks)


def test_configs_fit_shared_memory_and_include_the_defaults():
    from kvserve.kernels.attention import decode_config, prefill_config

    prefill = ks.prefill_configs(False)
    assert prefill_config(128, 2, True) in prefill
    tiles = {k: v for k, v in decode_config(128, 2, True).items() if k != "min_split"}
    assert tiles in ks.decode_kernel_configs(False)
    for c in prefill:
        assert c["num_stages"] * 2 * c["block_n"] * 128 * 2 + c["block_m"] * 128 * 2 <= ks.SMEM_BYTES
    assert not any(c["block_m"] == 128 and c["block_n"] == 128 and c["num_stages"] == 4 for c in prefill)


def test_launches_compiled_alike_share_a_compile_key():
    cfg = dict(block_n=64, num_warps=4, num_stages=2)
    assert ks.compile_key("decode", cfg, 3, 256) == ks.compile_key("decode", cfg, 4, 128)
    assert ks.compile_key("decode", cfg, 3, 256) != ks.compile_key("decode", cfg, 9, 256)  # merge tile
    assert ks.compile_key("decode", cfg, 16, 256) == ks.compile_key("decode", cfg, 16, 512)
    assert len({ks.compile_key("decode", cfg, n, 256) for n in (1, 2, 16)}) == 3
    assert ks.compile_key("prefill", dict(block_m=64), None, None) != ks.compile_key("prefill", dict(block_m=128))


def test_interpreted_smoke_run_writes_the_best_per_shape(tmp_path, monkeypatch):
    from kvserve.kernels.triton_utils import interpreter_problem

    if interpreter_problem():
        pytest.skip(interpreter_problem())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "sweep.json"
    ks.main(["--interpret", "--out", str(out)])
    result = json.loads(out.read_text())
    kinds = [b["kind"] for b in result["best"]]
    assert kinds == ["prefill", "prefill", "decode"]
    assert all("error" not in r for r in result["rows"]), result["rows"]
    assert all(r["max_err"] < 1e-4 for r in result["rows"])


def test_the_swept_configs_apply_only_where_the_sweep_measured_them(monkeypatch):
    """16-bit queries on 16-bit pools without window, soft cap or ALiBi take the swept tiles, key
    split and decode splits; everything else keeps the launch from before the sweep."""
    import torch

    from kvserve.kernels import attention

    assert attention.prefill_config(128, 2, True, measured=False) == dict(
        block_m=64, block_n=64, num_warps=8, num_stages=2, causal_split=False)
    assert attention.prefill_config(32, 4, True)["causal_split"] is False  # float32
    assert attention.decode_config(128, 2, True, measured=False)["min_split"] == 256
    assert attention.decode_config(128, 2, True)["min_split"] == 64
    seen = []
    for name in ("prefill_config", "decode_config"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, real=real, name=name: seen.append((name, a[-1])) or real(*a))
    cache = torch.randn(3, 16, 1, 16)
    args = (torch.randn(1, 2, 16), cache, cache.clone(), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([20], dtype=torch.int32), torch.tensor([[1, 2]], dtype=torch.int32), 0.25)
    for fn in (attention.paged_prefill_attention, attention.paged_decode_attention):
        for opts in ({}, dict(sliding_window=4), dict(logits_soft_cap=2.0), dict(alibi_slopes=torch.ones(2))):
            fn(*args, **opts)
    assert [m for _, m in seen] == [True, False, False, False] * 2
