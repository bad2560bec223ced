"""The KV offload tier: flags and options, the tier's stores, engine integration, swap, warm restarts."""

from __future__ import annotations

import argparse

import pytest

from kvserve.runtime.config import EngineConfig


def _serve_args(*argv: str) -> argparse.Namespace:
    from kvserve.runtime.server.args import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_flags_reach_the_engine_config(tmp_path):
    from kvserve.runtime.server.main import engine_kwargs

    kw = engine_kwargs(_serve_args("m", "--kv-offload-bytes", "1000000", "--kv-offload-dir", str(tmp_path),
                                   "--swap-space", "0.5"))
    cfg = EngineConfig(**kw)
    assert (cfg.kv_offload_bytes, cfg.kv_offload_dir, cfg.swap_space) == (1000000, str(tmp_path), 0.5)
    kw = engine_kwargs(_serve_args("m"))
    assert not {"kv_offload_bytes", "kv_offload_dir", "swap_space"} & set(kw)
    cfg = EngineConfig(**kw)
    assert (cfg.kv_offload_bytes, cfg.kv_offload_dir, cfg.swap_space) == (0, None, 0)


@pytest.mark.parametrize("kw, field", [
    (dict(kv_offload_bytes=-1), "kv_offload_bytes"),
    (dict(kv_offload_bytes=True), "kv_offload_bytes"),
    (dict(kv_offload_bytes=1.5), "kv_offload_bytes"),
    (dict(kv_offload_dir="/tmp/x"), "kv_offload_dir"),
    (dict(kv_offload_bytes=10, kv_offload_dir=""), "kv_offload_dir"),
    (dict(swap_space=-1), "swap_space"),
    (dict(swap_space=float("nan")), "swap_space"),
    (dict(swap_space="4"), "swap_space"),
])
def test_bad_offload_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", **kw)


def test_bad_flags_are_usage_errors():
    with pytest.raises(SystemExit):
        _serve_args("m", "--kv-offload-bytes", "-5")
    with pytest.raises(SystemExit):
        _serve_args("m", "--swap-space", "-1")


# -- engine end to end (tiny model) ----------------------------------------------------------------
import random  # noqa: E402

from kvserve.runtime import LLMEngine, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run(engine, prompts, params=GREEDY, ids=None):
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    final = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return {k: v.outputs[0].token_ids for k, v in final.items()}


def assert_no_leak(engine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and not bm.block_tables


def make_engine(model, **kw):
    opts = dict(block_size=4, num_kv_blocks=24, max_model_len=128, max_num_batched_tokens=64)
    opts.update(kw)
    return LLMEngine.from_args(model=str(model), **opts)


def conversations(seed=0, n=6, length=40):
    """Distinct long prompts: together far more than the pool, so each one's blocks are evicted
    before it comes back."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy outputs of a big pool without a tier (nothing is ever evicted)."""
    engine = make_engine(tiny_llama, num_kv_blocks=400)
    prompts = conversations()
    return {"first": run(engine, prompts), "again": run(engine, prompts)}


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_returning_prompts_load_from_the_tier_bit_exact(tiny_llama, reference, tier, tmp_path):
    prompts = conversations()
    extra = dict(kv_offload_dir=str(tmp_path)) if tier == "file" else {}
    engine = make_engine(tiny_llama, kv_offload_bytes=1 << 24, **extra)
    assert run(engine, prompts) == reference["first"]
    before = engine.get_stats()
    assert before.kv_offload_stored_blocks_total > 0  # the pool (24 blocks) overflowed into the tier
    assert run(engine, prompts) == reference["again"]
    after = engine.get_stats()
    assert after.kv_offload_hit_tokens_total > 0 and after.kv_offload_loaded_bytes_total > 0
    # Every returning prompt's full blocks came back from the pool or the tier: none recomputed.
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total == len(prompts) * 40 - len(prompts)
    assert after.kv_offload_failed_loads_total == 0
    assert_no_leak(engine)
    engine.close()
