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
