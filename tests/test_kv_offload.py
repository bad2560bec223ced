"""The KV offload tier: flags and options, the tier's stores, engine integration, swap, warm restarts."""

from __future__ import annotations

import argparse
import json

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


def test_vllm_kv_transfer_config_maps_onto_the_tier(tmp_path):
    from kvserve.runtime.server.main import engine_kwargs

    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20, "block_size": 16}}
    cfg = EngineConfig(**engine_kwargs(_serve_args("m", "--kv-transfer-config", json.dumps(config))))
    assert (cfg.kv_offload_bytes, cfg.kv_offload_dir) == (1 << 20, None)
    config["kv_connector_extra_config"]["kv_offload_dir"] = str(tmp_path)
    cfg = EngineConfig(model="m", kv_transfer_config=config)
    assert (cfg.kv_offload_bytes, cfg.kv_offload_dir) == (1 << 20, str(tmp_path))


@pytest.mark.parametrize("config, field", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "kv_transfer_config.kv_connector"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 10}}, "kv_transfer_config.kv_role"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 10}},
     r"kv_connector_extra_config.num_cpu_blocks: not supported \(give cpu_bytes_to_use instead\)"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {}}, "cpu_bytes_to_use"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 10,
                                                                           "block_size": 64}}, "block_size 16"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "cpu_bytes_to_use": 10, "spec_name": "TieringOffloadingSpec"}}, "spec_name"),
    ({"kv_connector": "OffloadingConnector", "bogus": 1}, "kv_transfer_config.bogus"),
    ("{nope", "kv_transfer_config: not valid JSON"),
])
def test_bad_kv_transfer_config_names_the_key(config, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", kv_transfer_config=config)
    with pytest.raises(ValueError, match="give either kv_transfer_config or kv_offload_bytes"):
        EngineConfig(model="m", kv_offload_bytes=10, kv_transfer_config={"kv_connector": "OffloadingConnector"})


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


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache-and-tier"])
def test_swap_preemption_equals_recompute_preemption(tiny_llama, caching):
    prompts = conversations()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    tier = dict(kv_offload_bytes=1 << 24) if caching else {}
    for swap in (0, 0.01):
        # 24 blocks of 4 tokens for six 40-token prompts growing by 24: running sequences are preempted.
        engine = make_engine(tiny_llama, swap_space=swap, enable_prefix_caching=caching, **(tier if swap else {}))
        outs[swap] = run(engine, prompts, params)
        stats = engine.get_stats()
        assert stats.num_preemptions_total > 0
        if swap:
            assert stats.kv_swap_outs_total > 0 and stats.kv_swap_ins_total == stats.kv_swap_outs_total
            assert stats.kv_swap_used_bytes == 0 and stats.num_swapped == 0
        assert_no_leak(engine)
        engine.close()
    assert outs[0.01] == outs[0]


@pytest.mark.parametrize("arch", ["gemma3-hybrid", "mistral-all-sliding"])
def test_swap_preemption_of_sliding_window_models_equals_recompute(tiny_model_factory, arch, monkeypatch):
    """KV cache groups (Gemma 3: a full-attention group and a window group) and one table that
    gives back blocks behind the window (every layer sliding): a swap saves each group's live
    blocks only, and a resumed sequence's table starts with the FREED entries it had."""
    if arch == "gemma3-hybrid":
        model = tiny_model_factory("gemma3", sliding_window=8, max_position_embeddings=512, num_hidden_layers=3,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    else:
        model = tiny_model_factory("mistral", sliding_window=8)
    from kvserve.runtime.kv_offload.manager import OffloadManager

    states, swap_out = [], OffloadManager.swap_out
    monkeypatch.setattr(OffloadManager, "swap_out", lambda *a: states.append(swap_out(*a)) or states[-1])
    prompts = conversations(seed=7)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for swap in (0, 0.01):
        with make_engine(model, swap_space=swap, enable_prefix_caching=False) as engine:
            assert (engine.kv_groups is not None) == (arch == "gemma3-hybrid")
            outs[swap] = run(engine, prompts, params)
            stats = engine.get_stats()
            assert stats.num_preemptions_total > 0
            if swap:
                assert stats.kv_swap_outs_total > 0 and stats.kv_swap_ins_total == stats.kv_swap_outs_total
                assert stats.kv_swap_used_bytes == 0 and stats.num_swapped == 0
                # Some swapped sequence had given window-group blocks back (not saved). (With every
                # layer sliding, the victims here are all just prefilled: nothing released yet.)
                assert any(st is not None and st.num_freed[-1] > 0 for st in states) or arch != "gemma3-hybrid"
            assert_no_leak(engine)
    assert outs[0.01] == outs[0]


def test_kv_cache_groups_read_ahead_each_groups_tier_blocks_and_resume_keeps_freed_entries():
    from kvserve.runtime.engine.block_manager import FREED
    from kvserve.runtime.engine.kv_cache_groups import KVCacheCoordinator, KVCacheGroup
    from kvserve.runtime.engine.prefix_cache import extend_block_hashes
    from kvserve.runtime.engine.sequence import Sequence
    from kvserve.runtime.kv_offload.manager import OffloadManager, tier_key

    # Blocks of 4 tokens; after a 10-block hit of a 41-token prompt, the window group (window 8)
    # reads positions 33..40: blocks 8 and 9 of the hit.
    bm = KVCacheCoordinator([KVCacheGroup(None, (1,)), KVCacheGroup(8, (0, 2))], [16, 16], 4, enable_caching=True)
    sent = []
    manager = OffloadManager(apply=lambda ops: sent.extend(ops) or [], block_bytes=[10, 20], block_size=4,
                             tier_bytes=1 << 20, swap_bytes=0, medium="DISK")
    seq = Sequence("a", list(range(3, 44)), max_tokens=1)  # 41 tokens: 10 full blocks
    extend_block_hashes(seq.block_hashes, seq.token_ids, seq.num_tokens, 4, None)
    for i, h in enumerate(seq.block_hashes):
        manager.tier.add(tier_key(0, h), 10)
        if i >= 5:
            manager.tier.add(tier_key(1, h), 20)
    manager.prefetch([seq], bm)
    manager.prefetch([seq], bm)  # once per request
    manager.flush()
    [(kind, _, keys)] = sent
    hashes = seq.block_hashes
    assert kind == "prefetch" and keys == [tier_key(0, h) for h in hashes] + [tier_key(1, h) for h in hashes[8:]]
    # A swapped-out sequence comes back with the window group's given-back entries still FREED.
    assert not bm.resume(9, [0, 5], 17 * 4)  # 17 blocks: more than the full group's 16
    assert bm.resume(9, [0, 5], 10 * 4)
    full, window = bm.group_tables(9)
    assert FREED not in full and len(full) == 10 and window[:5] == [FREED] * 5 and FREED not in window[5:]
    bm.check_invariants()
    bm.free(9)
    assert bm.num_used_blocks == 0


def test_an_aborted_swapped_request_gives_its_swap_space_back(tiny_llama):
    engine = make_engine(tiny_llama, swap_space=0.01, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(conversations()):
        engine.add_request(f"r{i}", p, params)
    for _ in range(500):
        engine.step()
        swapped = [s for s in engine.scheduler.waiting if s.swapped is not None]
        if swapped:
            break
    assert swapped, "nothing was swapped out"
    assert engine.get_stats().kv_swap_used_bytes > 0
    for i in range(6):
        engine.abort_request(f"r{i}")
    engine.step()
    stats = engine.get_stats()
    assert stats.kv_swap_used_bytes == 0 and stats.num_swapped == 0
    assert not engine.has_unfinished_requests()
    assert_no_leak(engine)
    assert len(engine.executor.offloader.stores[1]) == 0  # the host copies are gone too
    engine.close()


def test_without_a_tier_nothing_is_hooked(tiny_llama):
    with make_engine(tiny_llama) as engine:
        assert engine.offload is None and engine.executor.offloader is None
        assert engine.scheduler.offload is None
        assert engine.block_manager.tier_lookup is None and engine.block_manager.on_evict is None


# -- warm restarts and namespaces ----------------------------------------------------------------
def test_warm_restart_finds_the_prefixes_and_other_namespaces_never_read_them(tiny_llama, tiny_model_factory,
                                                                                reference, tmp_path):
    prompts = conversations()
    with make_engine(tiny_llama, kv_offload_bytes=1 << 24, kv_offload_dir=str(tmp_path)) as first:
        assert run(first, prompts) == reference["first"]
    # A new engine on the same directory: every prompt's blocks come back from the files.
    with make_engine(tiny_llama, kv_offload_bytes=1 << 24, kv_offload_dir=str(tmp_path)) as warm:
        assert run(warm, prompts) == reference["again"]
        stats = warm.get_stats()
        assert stats.kv_offload_hit_tokens_total == stats.prefix_cache_hits_total == len(prompts) * 39
        assert_no_leak(warm)
    # Anything else that shapes the bytes is another namespace: nothing is found, nothing read.
    other_weights = tiny_model_factory("llama", seed=1)
    for model, kw in [(tiny_llama, dict(block_size=8)), (tiny_llama, dict(dtype="bfloat16")),
                      (tiny_llama, dict(kv_cache_dtype="fp8")), (other_weights, {})]:
        with make_engine(model, kv_offload_bytes=1 << 24, kv_offload_dir=str(tmp_path), **kw) as cold:
            run(cold, prompts[:2])
            stats = cold.get_stats()
            assert stats.kv_offload_hit_tokens_total == 0 and stats.kv_offload_loaded_bytes_total == 0, kw
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 5  # one directory per namespace


def test_namespace_covers_every_field():
    from dataclasses import replace

    from kvserve.runtime.kv_offload.namespace import Namespace

    base = Namespace("m", "w", "float32", "float32", 16, (0, 2), "l")
    variants = [replace(base, **{f: v}) for f, v in [("model_id", "n"), ("weights", "x"), ("dtype", "bfloat16"),
                                                    ("kv_cache_dtype", "fp8"), ("block_size", 32),
                                                    ("heads", (0, 1)), ("heads", (2, 4)), ("layout", "k"),
                                                    ("copy", 1)]]
    digests = {v.digest for v in variants} | {base.digest}
    assert len(digests) == len(variants) + 1
    assert base.for_heads((2, 4)) == replace(base, heads=(2, 4))


def test_weights_fingerprint_tells_revisions_apart(tmp_path):
    from kvserve.runtime.kv_offload.namespace import weights_fingerprint

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(random.Random(0).randbytes(1 << 20))
    a = weights_fingerprint(str(model))
    assert weights_fingerprint(str(model)) == a
    # Another revision of the same size (a fine-tune changes weights everywhere; the fingerprint samples them).
    (model / "model.safetensors").write_bytes(random.Random(1).randbytes(1 << 20))
    assert weights_fingerprint(str(model)) != a
    (model / "config.json").write_text('{"x": 1}')  # and config.json is read whole
    b = weights_fingerprint(str(model))
    (model / "config.json").write_text("{}")
    assert weights_fingerprint(str(model)) != b


# -- the file store: crashes and corruption never read back ---------------------------------------
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from kvserve.runtime.engine.sequence import SequenceStatus  # noqa: E402
from kvserve.runtime.kv_offload.namespace import Namespace  # noqa: E402
from kvserve.runtime.kv_offload.store import STALE_TMP_SECONDS, FileStore  # noqa: E402

NS = Namespace("m", "w", "float32", "float32", 16, (0, 1), "l")


def test_a_writer_killed_between_write_and_rename_leaves_nothing_readable(tmp_path):
    # A real process, killed (SIGKILL) after its bytes are written and fsynced, before the rename.
    code = textwrap.dedent(f"""
        import os, signal, torch
        from kvserve.runtime.kv_offload.namespace import Namespace
        from kvserve.runtime.kv_offload.store import FileStore
        store = FileStore({str(tmp_path)!r}, Namespace(*{tuple(NS.__dict__.values())!r}))
        store.put(b"k-done", torch.arange(64, dtype=torch.uint8))
        store.put(b"k-torn", torch.arange(64, dtype=torch.uint8),
                  _before_rename=lambda: os.kill(os.getpid(), signal.SIGKILL))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    leftovers = list((tmp_path / NS.dirname).glob("*.tmp"))
    assert len(leftovers) == 1  # the torn write exists only under its temporary name
    store = FileStore(tmp_path, NS)  # a restart: the temporary file is young, maybe another server's
    assert list(store.dir.glob("*.tmp")) == leftovers
    assert [k for k, _ in store.scan()] == [b"k-done"]
    assert store.get(b"k-torn") is None
    assert torch.equal(store.get(b"k-done"), torch.arange(64, dtype=torch.uint8))
    store.close()
    old = time.time() - STALE_TMP_SECONDS - 60
    os.utime(leftovers[0], (old, old))
    FileStore(tmp_path, NS).close()  # a start once it is stale: a crashed writer's, deleted
    assert not list(store.dir.glob("*.tmp"))


def test_two_servers_sharing_a_directory_never_clash_or_delete_each_others_writes(tmp_path, monkeypatch):
    """Two stores on one directory (two pods on a ReadWriteMany PVC), in containers where both
    writers have PID 1: their temporary names differ, one's start leaves the other's write in
    flight alone, and both writing the same block leaves that block whole."""
    monkeypatch.setattr(os, "getpid", lambda: 1)
    a, b = FileStore(tmp_path, NS, fsync=False), FileStore(tmp_path, NS, fsync=False)
    block = torch.arange(256, dtype=torch.uint8).repeat(64)
    in_flight, go_on = threading.Event(), threading.Event()

    def paused():
        in_flight.set()
        assert go_on.wait(30)
        FileStore(tmp_path, NS).close()  # a third server starts while a's write is in flight

    writer = threading.Thread(target=a.put, args=(b"same", block), kwargs=dict(_before_rename=paused))
    writer.start()
    assert in_flight.wait(30)
    b.put(b"same", block)  # b writes the same block meanwhile
    go_on.set()
    writer.join(30)
    assert not writer.is_alive() and not list(a.dir.glob("*.tmp"))
    assert torch.equal(a.get(b"same"), block) and torch.equal(b.get(b"same"), block)

    # Racing writers and readers of the same keys: a read is the whole block or nothing.
    blocks = {bytes([i]): torch.full((4096 + i,), i, dtype=torch.uint8) for i in range(16)}
    bad, stop = [], threading.Event()

    def write(store):
        for _ in range(15):
            for key, data in blocks.items():
                store.put(key, data)

    def read():
        while not stop.is_set():
            for key, data in blocks.items():
                got = a.get(key)
                if got is not None and not torch.equal(got, data):
                    bad.append(key)

    threads = [threading.Thread(target=write, args=(s,)) for s in (a, b)]
    reader = threading.Thread(target=read)
    for t in [*threads, reader]:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    reader.join(60)
    assert not bad and sorted(k for k, _ in a.scan()) == sorted([*blocks, b"same"])
    assert not list(a.dir.glob("*.tmp"))
    a.close()
    b.close()


def _write_blocks_in_a_loop(root) -> None:
    store = FileStore(root, NS, fsync=False)
    for _ in range(20):
        for i in range(16):
            store.put(bytes([i]), torch.full((8192 + i,), i, dtype=torch.uint8))


def test_two_processes_writing_and_reading_one_directory_never_read_a_partial_block(tmp_path):
    """Another server (a real process, forked: no second import) writes the same blocks while this
    one writes and reads them."""
    import multiprocessing

    other = multiprocessing.get_context("fork").Process(target=_write_blocks_in_a_loop, args=(str(tmp_path),))
    other.start()
    ours = FileStore(tmp_path, NS, fsync=False)
    blocks = {bytes([i]): torch.full((8192 + i,), i, dtype=torch.uint8) for i in range(16)}
    bad, rounds = [], 0
    while other.is_alive() or rounds == 0:
        rounds += 1
        for key, data in blocks.items():
            ours.put(key, data)
            got = ours.get(key)
            if got is None or not torch.equal(got, data):
                bad.append(key)
    other.join(60)
    assert other.exitcode == 0 and not bad
    assert sorted(k for k, _ in ours.scan()) == sorted(blocks) and not list(ours.dir.glob("*.tmp"))
    ours.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "other-namespace", "renamed"])
def test_a_damaged_file_is_never_read_and_is_deleted(tmp_path, damage):
    store = FileStore(tmp_path, NS)
    data = torch.arange(200, dtype=torch.uint8)
    store.put(b"key", data)
    path = store.path(b"key")
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(raw[:-7])
    elif damage == "flip":
        raw[-3] ^= 0x10
        path.write_bytes(raw)
    elif damage == "other-namespace":
        other = FileStore(tmp_path, Namespace(*{**NS.__dict__, "block_size": 32}.values()))
        other.put(b"key", data)
        path.write_bytes(other.path(b"key").read_bytes())
    else:
        store.put(b"other", data)
        store.path(b"other").replace(path)  # the content of another key under this name
    assert store.get(b"key") is None
    assert not path.exists()
    if damage != "flip":  # a scan checks headers and sizes; a flipped payload byte is the checksum's job
        store.put(b"key2", data)
        path2 = store.path(b"key2")
        path2.write_bytes(path2.read_bytes()[:-1])
        assert store.scan() == [] and not path2.exists()


def _ns(**changes) -> Namespace:
    return Namespace(*{**NS.__dict__, **changes}.values())


def test_a_start_over_budget_deletes_other_namespaces_oldest_first_never_a_live_or_kept_one(tmp_path):
    import os

    block = torch.arange(250, dtype=torch.uint8).repeat(40)  # 10,000 bytes a file
    stale = {}
    for age, name in enumerate(["w-oldest", "w-old", "w-live", "w-rank1"]):
        s = FileStore(tmp_path, _ns(weights=name, heads=(1, 2)) if name == "w-rank1" else _ns(weights=name))
        for i in range(3):
            s.put(bytes([i]), block)
        stale[name] = s
        when = 1_000_000 + age * 1000  # written long ago, "w-oldest" first
        for f in [*s.dir.iterdir(), s.dir]:
            os.utime(f, (when, when))
        if name != "w-live":
            s.close()  # those servers are gone; "w-live" still runs (it keeps its lock)
    unrelated = tmp_path / "notes"  # not a namespace: never counted or touched
    unrelated.mkdir()
    (unrelated / "big").write_bytes(b"x" * 100_000)
    # Four namespaces of ~30 KB, a budget of ~2.5: only the oldest must go to fit.
    ours = FileStore(tmp_path, NS, root_budget_bytes=100_000, keep=frozenset({_ns(weights="w-rank1", heads=(1, 2)).dirname}))
    assert not stale["w-oldest"].dir.exists()
    assert all(stale[n].dir.exists() for n in ("w-old", "w-live", "w-rank1")) and (unrelated / "big").exists()
    ours.close()
    # A budget of nothing: every namespace that is neither live, kept nor ours goes.
    ours = FileStore(tmp_path, NS, root_budget_bytes=0, keep=frozenset({_ns(weights="w-rank1", heads=(1, 2)).dirname}))
    assert not stale["w-old"].dir.exists()
    assert stale["w-live"].dir.exists() and stale["w-rank1"].dir.exists() and ours.dir.exists()
    assert len(stale["w-live"].scan()) == 3 and (unrelated / "big").exists()
    stale["w-live"].close()  # its server stopped: the next start over budget may delete it
    FileStore(tmp_path, NS, root_budget_bytes=0).close()
    assert not stale["w-live"].dir.exists()


def _age(directory, when):
    import os

    for f in [*directory.iterdir(), directory]:
        os.utime(f, (when, when))


@pytest.mark.parametrize("budget, live, deleted", [
    (10**6, (), ()),  # room for all: the old TP 2 shards stay and are read
    (70_000, (), ("tp2-rank0",)),  # over budget: the least recently written goes first
    (0, ("tp2-rank1",), ("tp2-rank0", "other-model")),  # a live store's directory never goes
    (0, ("tp2-rank0",), ("tp2-rank1", "other-model")),
    (0, (), ("tp2-rank0", "tp2-rank1", "other-model")),
])
def test_other_tp_layouts_of_the_model_count_toward_the_root_budget(tmp_path, budget, live, deleted):
    from kvserve.runtime.kv_offload.heads import HeadGeometry

    geo = HeadGeometry(num_kv_heads=2, segments=(4,), block_size=4, value_bytes=8)
    tp1 = _ns(heads=(0, 2))
    block = torch.arange(256, dtype=torch.uint8).repeat(40)  # ~10 KB a file
    dirs = {"tp2-rank0": tp1.for_heads((0, 1)), "tp2-rank1": tp1.for_heads((1, 2)),
            "other-model": _ns(weights="w2", heads=(0, 2))}
    stores = {}
    for age, (name, ns) in enumerate(dirs.items()):  # oldest first
        stores[name] = FileStore(tmp_path, ns)
        for i in range(3):
            stores[name].put(bytes([0, i]), block)
        _age(stores[name].dir, 1_000_000 + age * 1000)
        if name not in live:
            stores[name].close()
    ours = FileStore(tmp_path, tp1, root_budget_bytes=budget, geometry=geo)
    try:
        assert {n for n, s in stores.items() if not s.dir.exists()} == set(deleted)
        # What is left of the old layout is read; a partial set of shards is not.
        whole = not {"tp2-rank0", "tp2-rank1"} & set(deleted)
        assert len(ours.sources) == whole and len(ours.readable_keys()) == 3 * whole
    finally:
        ours.close()
        for s in stores.values():
            s.close()


import itertools  # noqa: E402

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_TRIM_DIRS = st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), min_size=1, max_size=6)


_trim_examples = itertools.count()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dirs=_TRIM_DIRS, budget_files=st.integers(0, 18))
def test_trim_deletes_only_the_oldest_unheld_namespaces_and_only_while_over_budget(tmp_path, dirs, budget_files):
    """dirs: (files in it, held by a live store, named in keep), oldest first."""
    import os

    from kvserve.runtime.kv_offload.store import hold_lock, trim_root

    root = tmp_path / str(next(_trim_examples))
    fds, names = [], []
    for age, (files, held, _) in enumerate(dirs):
        store = FileStore(root, _ns(weights=f"w{age}"))
        for i in range(files):
            store.put(bytes([i]), torch.zeros(1000, dtype=torch.uint8))
        store.close()
        if held:
            fds.append(hold_lock(store.dir))
        _age(store.dir, 1_000_000 + age * 1000)
        names.append(store.dir.name)
    (root / "notes").mkdir()  # not a namespace: never counted nor touched

    def size(name):
        return sum(e.stat().st_size for e in os.scandir(root / name))

    sizes = {n: size(n) for n in names}
    keep = {n for n, (_, _, kept) in zip(names, dirs) if kept}
    budget = budget_files * 1100
    try:
        gone = trim_root(root, budget, keep)
    finally:
        for fd in fds:
            os.close(fd)
    assert (root / "notes").is_dir()
    assert set(gone) == {n for n in names if not (root / n).exists()}
    protected = {n for n, (_, held, kept) in zip(names, dirs) if held or kept}
    assert not protected & set(gone)
    deletable_left = [i for i, n in enumerate(names) if n not in protected and n not in gone]
    if deletable_left:  # it stopped early: the root fits, and nothing it deleted is newer
        assert sum(sizes[n] for n in names if n not in gone) <= budget
        assert all(names.index(n) < deletable_left[0] for n in gone)


# -- another tensor-parallel layout: blocks keyed by KV-head range ---------------------------------
def test_head_ranges_follow_the_attention_sharding_and_every_layout_covers_every_range():
    from kvserve.runtime.kv_offload.heads import covers, head_copy, head_range, layouts

    assert [head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # copies
    assert [head_copy(2, 4, r) for r in range(4)] == [0, 1, 0, 1] and head_copy(4, 2, 1) == 0
    assert layouts(4, 8) == [((0, 4),), ((0, 2), (2, 4)), ((0, 1), (1, 2), (2, 3), (3, 4))]
    assert layouts(1) == [((0, 1),)]  # MLA: one latent every rank holds whole
    assert covers((0, 4), 4, 8) == [((0, 2), (2, 4)), ((0, 1), (1, 2), (2, 3), (3, 4))]
    assert covers((2, 3), 4, 8) == [((0, 4),), ((2, 4),)]
    assert covers((0, 1), 1) == []


@pytest.mark.parametrize("heads, segments", [(2, (2,)), (4, (6, 2)), (8, (4,))])
def test_a_block_sliced_and_joined_across_layouts_is_the_same_bytes(heads, segments):
    from kvserve.runtime.kv_offload.heads import HeadGeometry, assemble, covers, layouts

    geo = HeadGeometry(num_kv_heads=heads, segments=segments, block_size=4, value_bytes=12)
    for group, n in enumerate(segments):
        full = torch.randint(0, 256, (n, 4, heads, 12), dtype=torch.uint8)

        def payload(r):
            return full[:, :, r[0]:r[1], :].contiguous().reshape(-1)

        for ranges in layouts(heads):
            for want in ranges:
                for pieces in covers(want, heads):
                    got = assemble([(r, payload(r)) for r in pieces], want, geo, group)
                    assert torch.equal(got, payload(want)), (want, pieces)
        assert assemble([((0, heads), payload((0, 1)))], (0, 1), geo, group) is None  # wrong size


def test_a_store_reads_its_heads_from_another_layouts_files_and_never_a_partial_set(tmp_path):
    from kvserve.runtime.kv_offload.heads import HeadGeometry

    geo = HeadGeometry(num_kv_heads=2, segments=(4,), block_size=4, value_bytes=8)
    full = {k: torch.randint(0, 256, (4, 4, 2, 8), dtype=torch.uint8) for k in (b"\0a", b"\0b", b"\0c")}

    def part(key, r):
        return full[key][:, :, r[0]:r[1], :].contiguous().reshape(-1)

    tp1 = _ns(heads=(0, 2))
    # A TP 2 server wrote its two shards; then a TP 1 server starts on the directory.
    halves = [FileStore(tmp_path, tp1.for_heads(r)) for r in ((0, 1), (1, 2))]
    for key in full:
        for store, r in zip(halves, ((0, 1), (1, 2))):
            if not (key == b"\0c" and r == (1, 2)):  # one shard of c never made it to disk
                store.put(key, part(key, r))
    other_model = FileStore(tmp_path, _ns(weights="w2", heads=(0, 1)))
    other_model.put(b"\0d", part(b"\0a", (0, 1)))
    joined = FileStore(tmp_path, tp1, geometry=geo)
    assert {k for k, _ in joined.scan()} == {b"\0a", b"\0b"}  # c is incomplete, d another model's
    assert joined.readable_keys() == {b"\0a", b"\0b"}
    assert torch.equal(joined.get(b"\0a"), part(b"\0a", (0, 2)))
    assert joined.get(b"\0c") is None and joined.get(b"\0d") is None and not joined.has_own(b"\0a")
    # A damaged shard is a miss (and deleted), never half a block.
    path = halves[1].path(b"\0b")
    path.write_bytes(path.read_bytes()[:-1])
    assert joined.get(b"\0b") is None and not path.exists()
    # Back to TP 2: each rank slices its head out of the TP 1 server's files.
    joined.put(b"\0e", part(b"\0a", (0, 2)))
    upper = FileStore(tmp_path, tp1.for_heads((1, 2)), geometry=geo)
    assert torch.equal(upper.get(b"\0e"), part(b"\0a", (1, 2)))
    assert torch.equal(upper.get(b"\0a"), part(b"\0a", (1, 2)))  # its own file first
    # TP 4 on 2 heads: the second copy of head 1 has its own directory and reads the first copy's.
    second = FileStore(tmp_path, tp1.for_heads((1, 2), copy=1), geometry=geo)
    assert second.dir != upper.dir and torch.equal(second.get(b"\0a"), part(b"\0a", (1, 2)))
    for s in [*halves, other_model, joined, upper, second]:
        s.close()


def test_a_prefetched_block_is_loaded_from_memory_and_a_missing_one_is_still_reported(tmp_path):
    import time

    from kvserve.runtime.kv_offload.offloader import TIER, KVOffloader

    pools = [(torch.zeros(4, 8), torch.zeros(4, 8)), (torch.zeros(4, 8), torch.zeros(4, 8))]
    for layer in pools:
        for pool in layer:
            pool[1] = torch.randn(8)
    off = KVOffloader(pools, [[0, 1]], {TIER: FileStore(tmp_path, NS)})
    try:
        off.apply([("save", TIER, 0, 1, b"k")])
        assert off.flush(timeout=30)
        off.apply([("prefetch", TIER, [b"k", b"absent"])])
        deadline = time.monotonic() + 30
        while (TIER, b"k") not in off._staged and time.monotonic() < deadline:
            time.sleep(0.01)
        off.stores[TIER].path(b"k").unlink()  # from here on only the read-ahead bytes have it
        assert off.apply([("load", TIER, 0, 2, b"k"), ("load", TIER, 0, 3, b"absent")]) == [b"absent"]
        assert off.prefetched_loads == 1 and not off._staged
        assert all(torch.equal(pool[2], pool[1]) and not pool[3].any() for layer in pools for pool in layer)
    finally:
        off.close()


def test_a_corrupted_tier_file_is_recomputed_not_read(tiny_llama, reference, tmp_path):
    prompts = conversations()
    with make_engine(tiny_llama, kv_offload_bytes=1 << 24, kv_offload_dir=str(tmp_path)) as first:
        run(first, prompts)
    files = sorted((p for p in tmp_path.rglob("*.kvb")), key=lambda p: p.name)
    for p in files[::2]:  # damage half of the blocks
        raw = bytearray(p.read_bytes())
        raw[-1] ^= 0xFF
        p.write_bytes(raw)
    with make_engine(tiny_llama, kv_offload_bytes=1 << 24, kv_offload_dir=str(tmp_path)) as warm:
        assert run(warm, prompts) == reference["again"]
        stats = warm.get_stats()
        assert stats.kv_offload_failed_loads_total > 0 and stats.kv_offload_hit_tokens_total > 0
        assert_no_leak(warm)


# -- pure policy -----------------------------------------------------------------------------------
def test_tier_index_is_an_lru_with_a_byte_budget():
    from kvserve.runtime.kv_offload.index import TierIndex

    idx = TierIndex(100)
    assert idx.add(b"a", 40) == [] and idx.add(b"b", 40) == []
    assert idx.touch(b"a") and not idx.touch(b"zz")
    assert idx.add(b"c", 40) == [b"b"]  # b is the least recently used
    assert idx.keys() == [b"a", b"c"] and idx.used_bytes == 80
    assert idx.add(b"d", 50, pinned=[b"a"]) == [b"c"]  # a is about to be read: kept
    assert idx.add(b"e", 200) is None and b"e" not in idx  # larger than the whole budget
    assert idx.add(b"f", 60, pinned=[b"a", b"d"]) is None  # no room without a pinned key
    assert idx.remove(b"a") and not idx.remove(b"a") and idx.used_bytes == 50
    assert idx.add(b"d", 50) == [] and len(idx) == 1  # re-adding a held key only touches it


@pytest.mark.parametrize("tokens, swap_bytes, free, prefill, transfer, expected", [
    (1000, 10_000_000, 1 << 30, 2000.0, 2e9, "swap"),  # 10 ms of copies vs 0.5 s of prefill
    (1000, 10_000_000, 1 << 30, 1e7, 2e9, "recompute"),  # a very fast device recomputes
    (1000, 10_000_000, 5_000_000, 2000.0, 2e9, "recompute"),  # no room in the swap space
    (0, 0, 1 << 30, 2000.0, 2e9, "recompute"),  # nothing computed yet
    (16, 4096, 1 << 30, 0.0, 2e9, "swap"),  # prefill rate unknown: copies are cheaper
    (16, 4096, 1 << 30, 2000.0, 0.0, "recompute"),  # no transfer path
    (100, 1_000_000, 1 << 30, 1000.0, 2e7, "recompute"),  # 0.1 s both ways: a tie recomputes
])
def test_preemption_choice(tokens, swap_bytes, free, prefill, transfer, expected):
    from kvserve.runtime.kv_offload.index import preemption_choice

    assert preemption_choice(num_computed_tokens=tokens, swap_bytes=swap_bytes, swap_free_bytes=free,
                             prefill_tokens_per_s=prefill, transfer_bytes_per_s=transfer) == expected


def test_pipeline_stages_store_and_reload_their_own_layers(tiny_llama, reference, tmp_path):
    """PP=2 with the file tier and swap: greedy output equals the big pool's, prefix hits come
    back from the tier, and each stage wrote its own layers' part of every block (one namespace
    per stage, the same keys), stage 1's included."""
    prompts = conversations()
    with make_engine(tiny_llama, pipeline_parallel_size=2, kv_offload_bytes=1 << 24,
                     kv_offload_dir=str(tmp_path), swap_space=0.001) as engine:
        assert run(engine, prompts) == reference["first"]
        assert run(engine, prompts) == reference["again"]
        stats = engine.get_stats()
        assert stats.kv_offload_hit_tokens_total > 0 and stats.kv_offload_failed_loads_total == 0
        assert_no_leak(engine)
    names = [{p.name for p in d.glob("*.kvb")} for d in sorted(p for p in tmp_path.iterdir() if p.is_dir())]
    assert len(names) == 2 and names[0] and names[0] == names[1]


@pytest.mark.parametrize("tier, medium", [("memory", "CPU"), ("file", "DISK")])
def test_tier_stores_and_removals_are_kv_events_with_their_medium(tiny_llama, tmp_path, tier, medium):
    from kvserve.runtime.kv_events.events import BlockRemoved, BlockStored, KVEventSink

    extra = dict(kv_offload_dir=str(tmp_path)) if tier == "file" else {}
    # A tier of 40 blocks (of 2 KiB: 2 layers x K and V x 4 tokens x 2 heads x 16 x 4 bytes) for
    # 60 blocks of prompts: the tier evicts too.
    with make_engine(tiny_llama, kv_offload_bytes=40 * 2048, **extra) as engine:
        assert engine.executor.offloader.block_bytes == [2048]
        sink = KVEventSink(4)
        engine.block_manager.events = sink  # the wiring kv_events_config does, without a publisher
        engine.offload.events = sink
        prompts = conversations()
        run(engine, prompts)
        run(engine, prompts)
        events = sink.take()
        held_now = {k[1:] for k in engine.offload.tier.keys()}
    tier_stored = [h for e in events if isinstance(e, BlockStored) and e.medium == medium for h in e.block_hashes]
    tier_removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes]
    pool_stored = {h for e in events if isinstance(e, BlockStored) and e.medium == "GPU" for h in e.block_hashes}
    assert tier_stored and tier_removed
    assert set(tier_stored) <= pool_stored  # the tier only ever holds what the pool computed
    # A tier BlockStored carries the block's parent hash and token ids exactly as the pool's did
    # (an indexer that rehashes tokens, like llm-d's, needs both).
    pool_meta = {}
    for e in events:
        if isinstance(e, BlockStored) and e.medium == "GPU":
            for j, h in enumerate(e.block_hashes):
                pool_meta[h] = (e.parent_block_hash if j == 0 else e.block_hashes[j - 1],
                                e.token_ids[j * e.block_size:(j + 1) * e.block_size])
    for e in events:
        if isinstance(e, BlockStored) and e.medium == medium:
            assert len(e.block_hashes) == 1 and len(e.token_ids) == e.block_size == 4
            assert (e.parent_block_hash, e.token_ids) == pool_meta[e.block_hashes[0]]
    # What the tier holds now is exactly what its events say it holds.
    held: set[bytes] = set()  # replayed in order, as a subscriber's index does
    for e in events:
        if e.medium == medium:
            held = held | set(e.block_hashes) if isinstance(e, BlockStored) else held - set(e.block_hashes)
    assert held == held_now


def test_tier_events_name_the_adapter_of_the_block_as_the_pools_event_did():
    """An adapter's block evicted to the tier is announced with the pool event's lora_id and
    lora_name, even after its int id was given to another adapter; a base block has none."""
    from kvserve.runtime.engine.block_manager import BlockManager
    from kvserve.runtime.engine.prefix_cache import block_hashes
    from kvserve.runtime.kv_events.events import BlockStored, KVEventSink
    from kvserve.runtime.kv_offload.manager import OffloadManager

    identities = {7: (123, "chat")}  # the engine's adapter registry (LoRAManager.identity)
    bm = BlockManager(4, 2, enable_caching=True)
    sink = KVEventSink(2, lora_identity=identities.get)
    offload = OffloadManager(apply=lambda ops: [], block_bytes=[1], block_size=2, tier_bytes=100, swap_bytes=0)
    bm.events, offload.events = sink, sink
    bm.on_evict = offload.on_evict(0, bm.stored_meta.get)

    def compute(seq_id, tokens, lora_int_id):
        bm.allocate_slots(seq_id, 0, len(tokens))
        bm.register(seq_id, block_hashes(tokens, 2), tokens, lora_int_id)
        bm.free(seq_id)

    compute(1, [1, 2, 3, 4], 7)
    identities[7] = (456, "other")  # the adapter was removed and its int id reused
    compute(2, [5, 6, 7, 8], 0)
    compute(3, [9, 10, 11, 12], 0)  # a pool of 4: evicts the adapter's two blocks
    compute(4, [13, 14, 15, 16], 0)  # then the first base blocks
    events = [e for e in sink.take() if isinstance(e, BlockStored)]
    pool = {h: (e.lora_id, e.lora_name) for e in events if e.medium == "GPU" for h in e.block_hashes}
    tier = {h: (e.lora_id, e.lora_name) for e in events if e.medium == "CPU" for h in e.block_hashes}
    assert len(tier) == 4 and tier == {h: pool[h] for h in tier}
    assert sorted(tier.values(), key=str) == [(123, "chat")] * 2 + [(None, None)] * 2


def test_a_persistent_tier_found_at_a_start_is_announced_as_kv_events(tiny_llama, tmp_path):
    """A restart (or a reshape's new engines) on a persistent tier announces every block it found,
    medium DISK, through an engine's own events and through the server's stream alike."""
    from kvserve.runtime.kv_events.config import KVEventsConfig
    from kvserve.runtime.kv_events.events import BlockStored
    from kvserve.runtime.kv_events.stream import ServerEventStream

    tier = dict(kv_offload_bytes=1 << 24, kv_offload_dir=str(tmp_path / "tier"))
    with make_engine(tiny_llama, **tier) as first:
        run(first, conversations(n=2))
    endpoint = f"ipc://{tmp_path}/events"
    with make_engine(tiny_llama, kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint},
                     **tier) as warm:
        held = [k[1:] for k in warm.offload.tier.keys()]
        announced = warm.kv_event_sink.take()  # before any step: the start's announcement
    assert len(held) >= 2 * 10  # both conversations' prompt blocks at least
    assert all(isinstance(e, BlockStored) and e.medium == "DISK" and e.parent_block_hash is None
               and not e.token_ids for e in announced)
    assert [h for e in announced for h in e.block_hashes] == held
    stream = ServerEventStream(KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": endpoint}))
    try:
        with make_engine(tiny_llama, **tier) as reshaped:
            stream.attach([reshaped])
            assert [h for e in reshaped.kv_event_sink.take() for h in e.block_hashes] == held
    finally:
        stream.close()


def test_a_reshape_announces_the_tiers_blocks_after_the_clear(tiny_llama, tmp_path):
    """2 x TP1 -> 1 x TP2 on a persistent tier: the old engines' pools go to the tier at their
    close, the stream says AllBlocksCleared, and the new engine announces what it found there
    (its ranks read the TP1 files' heads; medium DISK) before it publishes anything else."""
    from kvserve.runtime.config import EngineConfig
    from kvserve.runtime.engine.data_parallel import DataParallelEngine
    from kvserve.runtime.kv_events.events import BlockStored

    config = EngineConfig.from_args(model=str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64,
                                    max_model_len=128, kv_offload_bytes=1 << 24, kv_offload_dir=str(tmp_path),
                                    kv_events_config={"enable_kv_cache_events": True,
                                                      "endpoint": f"ipc://{tmp_path}/events"})
    with DataParallelEngine(config, 2) as engine:
        for i, prompt in enumerate(conversations(n=2)):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        engine.reshape(1, 2)
        for new in engine.engines:
            held = [k[1:] for k in new.offload.tier.keys() if k[0] == 0]
            announced = new.kv_event_sink.take()
            assert len(held) >= 2 * 9  # both prompts' blocks, saved from the old pool at its close
            assert all(isinstance(e, BlockStored) and e.medium == "DISK" for e in announced)
            assert [h for e in announced for h in e.block_hashes] == held


# -- the server: flags to metrics ------------------------------------------------------------------
def test_server_with_a_file_tier_reports_hits_in_vllm_and_kvserve_metrics(tiny_llama, tmp_path):
    import openai
    from server_helpers import http, m, metrics, wait_until

    from kvserve.runtime.server.main import ServerThread

    def start():
        srv = ServerThread([str(tiny_llama), "--served-model-name", "tiny", "--port", "0", "--block-size", "4",
                            "--num-kv-blocks", "24", "--max-model-len", "128", "--kv-offload-bytes", str(1 << 24),
                            "--kv-offload-dir", str(tmp_path), "--swap-space", "0.001"])
        srv.start()
        wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
        return srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)

    def complete(client, prompts):
        return [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0).choices[0].text
                for p in prompts]

    prompts = conversations()
    srv, client = start()
    try:
        texts = [complete(client, prompts) for _ in range(2)]
        assert texts[0] == texts[1]
        snap = metrics(srv.url)
        assert m(snap, "vllm:external_prefix_cache_hits_total") > 0
        assert m(snap, "vllm:external_prefix_cache_queries_total") >= m(snap, "vllm:external_prefix_cache_hits_total")
        assert m(snap, "kvserve:kv_offload_hits_total") > 0 and m(snap, "kvserve:kv_offload_loaded_bytes_total") > 0
        assert ("kvserve:kv_offload_prefetched_blocks_total", ()) in snap  # exported (its value is timing's)
        assert m(snap, "kvserve:kv_offload_capacity_bytes") == 1 << 24
        assert 0 < m(snap, "kvserve:kv_offload_used_bytes") <= 1 << 24
        assert m(snap, "kvserve:kv_offload_load_seconds_count") > 0
        assert m(snap, "vllm:num_requests_swapped") == 0 and m(snap, "vllm:cpu_cache_usage_perc") == 0
        fresh = conversations(seed=9, n=1)
        answer = complete(client, fresh)  # its blocks are only in the pool when the server stops
    finally:
        assert srv.stop() == 0  # SIGTERM's path: the pool's cached blocks are written to the tier
    srv, client = start()
    try:
        assert complete(client, fresh) == answer
        assert m(metrics(srv.url), "vllm:external_prefix_cache_hits_total") == 39
    finally:
        assert srv.stop() == 0


# -- KV cache groups and tensor parallelism --------------------------------------------------------
def test_hybrid_groups_reload_each_groups_blocks_bit_exact(tiny_model_factory, tmp_path):
    """Gemma 3 (local and global layers): each group's blocks go to the tier under their own keys,
    and a hit loads the full group's prefix but only the window group's live blocks."""
    model = tiny_model_factory("gemma3", sliding_window=8, max_position_embeddings=512, num_hidden_layers=3,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    prompts = conversations(seed=5)
    ref = make_engine(model, num_kv_blocks=400)
    want = run(ref, prompts)
    ref.close()
    with make_engine(model, kv_offload_bytes=1 << 24, kv_offload_dir=str(tmp_path)) as engine:
        assert engine.kv_groups is not None and len(engine.executor.offloader.block_bytes) == 2
        assert run(engine, prompts) == want
        before = engine.get_stats()
        assert run(engine, prompts) == want
        after = engine.get_stats()
        assert after.kv_offload_hit_tokens_total > before.kv_offload_hit_tokens_total
        assert after.prefix_cache_hits_total - before.prefix_cache_hits_total == len(prompts) * 39
        assert_no_leak(engine)
    keys = [p.name for p in tmp_path.rglob("*.kvb")]
    assert {k[:2] for k in keys} == {"00", "01"}  # both groups' blocks, each under its group byte


def test_tensor_parallel_shards_reload_at_the_same_and_at_another_tp_degree(tiny_llama, reference, tmp_path):
    prompts = conversations()
    with make_engine(tiny_llama, tensor_parallel_size=2, kv_offload_bytes=1 << 24,
                     kv_offload_dir=str(tmp_path), swap_space=0.001) as engine:
        assert run(engine, prompts) == reference["first"]
        assert run(engine, prompts) == reference["again"]
        stats = engine.get_stats()
        assert stats.kv_offload_hit_tokens_total > 0 and stats.kv_offload_failed_loads_total == 0
        assert_no_leak(engine)
    # Each rank wrote its own shard, in its own namespace: the same keys, half the heads each.
    dirs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(dirs) == 2
    names = [{p.name for p in d.glob("*.kvb")} for d in dirs]
    assert names[0] and names[0] == names[1]
    # A restart at TP 1 joins the two shards of every block: all prefixes found, the same output.
    others = conversations(seed=1)
    with make_engine(tiny_llama, kv_offload_bytes=1 << 24, kv_offload_dir=str(tmp_path)) as tp1:
        assert run(tp1, prompts) == reference["again"]
        stats = tp1.get_stats()
        assert stats.kv_offload_hit_tokens_total == len(prompts) * 39 and stats.kv_offload_failed_loads_total == 0
        want = run(tp1, others)  # new prefixes, stored by TP 1 only
        assert_no_leak(tp1)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 3  # heads [0, 1), [1, 2) and [0, 2)
    # Back at TP 2 (a warm restart of the first layout): its own blocks, and each rank slices its
    # head out of what TP 1 stored.
    with make_engine(tiny_llama, tensor_parallel_size=2, kv_offload_bytes=1 << 24,
                     kv_offload_dir=str(tmp_path)) as warm:
        assert run(warm, prompts) == reference["again"]
        assert run(warm, others) == want
        stats = warm.get_stats()
        assert stats.kv_offload_hit_tokens_total == (len(prompts) + len(others)) * 39
        assert stats.kv_offload_failed_loads_total == 0


def test_tensor_parallel_shutdown_saves_every_ranks_shard_of_the_pool(tiny_llama, reference, tmp_path):
    """A pool large enough that nothing is evicted: every block reaches the tier only through the
    shutdown save, which must reach rank 1 too (its ops ride the shutdown message)."""
    prompts = conversations()
    with make_engine(tiny_llama, tensor_parallel_size=2, num_kv_blocks=400, kv_offload_bytes=1 << 24,
                     kv_offload_dir=str(tmp_path)) as engine:
        assert run(engine, prompts) == reference["first"]
        assert engine.get_stats().kv_offload_stored_bytes_total == 0  # nothing evicted yet
    names = [{p.name for p in d.glob("*.kvb")} for d in sorted(p for p in tmp_path.iterdir() if p.is_dir())]
    assert len(names) == 2 and names[0] and names[0] == names[1]
    with make_engine(tiny_llama, tensor_parallel_size=2, kv_offload_bytes=1 << 24,
                     kv_offload_dir=str(tmp_path)) as warm:
        assert run(warm, prompts[:3]) == {f"r{i}": reference["again"][f"r{i}"] for i in range(3)}
        assert warm.get_stats().kv_offload_hit_tokens_total == 3 * 39
        # After the start's scan, rank 1 loses blocks that rank 0 still reads (another server on
        # the directory deleted one, another's checksum fails there only): each such block is
        # recomputed on every rank, the rest of the prefix still comes from the tier.
        rank1 = tmp_path / warm.executor.driver_worker.offload_namespace(1).dirname
        damaged = sorted(rank1.glob("*.kvb"))[::4]
        damaged[0].unlink()
        for p in damaged[1:]:
            raw = bytearray(p.read_bytes())
            raw[-1] ^= 0xFF
            p.write_bytes(raw)
        assert run(warm, prompts[3:], ids=[f"r{i}" for i in range(3, len(prompts))]) == {
            f"r{i}": reference["again"][f"r{i}"] for i in range(3, len(prompts))}
        stats = warm.get_stats()
        assert 0 < stats.kv_offload_failed_loads_total
        assert 0 < stats.kv_offload_hit_tokens_total - 3 * 39 < 3 * 39  # shorter prefixes, not none
        assert_no_leak(warm)


# -- the block manager with the tier: a property test of the bookkeeping ---------------------------

SEQ_OPS = st.lists(st.one_of(st.tuples(st.just("admit"), st.integers(0, 2), st.integers(1, 6)),
                             st.tuples(st.just("request"), st.integers(0, 2), st.integers(4, 6)),
                             st.tuples(st.just("request"), st.integers(0, 2), st.integers(4, 6)),
                             st.tuples(st.just("free"), st.integers(0, 20), st.just(0)),
                             st.tuples(st.just("corrupt"), st.integers(0, 50), st.just(0))),
                   min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=SEQ_OPS, tier_blocks=st.integers(0, 12))
@example(ops=[("request", 0, 6), ("request", 1, 6), ("request", 0, 6)], tier_blocks=12)  # a tier hit
@example(ops=[("request", 0, 6), ("request", 1, 6), ("corrupt", 3, 0), ("request", 0, 6), ("request", 2, 6),
              ("request", 1, 4)], tier_blocks=6)  # an unreadable block, and the tier's own evictions
def test_pool_and_tier_never_lose_or_mix_up_a_block(ops, tier_blocks):
    """Blocks hold "content" (the hash they were computed for). Whatever the admissions, frees,
    evictions and unreadable tier entries, every block a sequence holds has the right content,
    every block saved to the tier is saved before it is overwritten, and nothing leaks."""
    from kvserve.runtime.engine.block_manager import BlockManager
    from kvserve.runtime.engine.prefix_cache import block_hashes
    from kvserve.runtime.kv_offload.manager import OffloadManager

    bm = BlockManager(10, 2, enable_caching=True)
    content: dict[int, bytes | None] = {}
    stored: dict[bytes, bytes] = {}
    unreadable: set[bytes] = set()

    def apply(batch):
        failed = []
        for op in batch:
            if op[0] == "save":
                _, _, _, block, key = op
                assert content.get(block) == key[1:], "a block was overwritten before it was saved"
                stored[key] = content[block]
            elif op[0] == "load":
                _, _, _, block, key = op
                if key in unreadable or key not in stored:
                    failed.append(key)
                else:
                    content[block] = stored[key]
            else:
                stored.pop(op[2], None)
        return failed

    offload = OffloadManager(apply=apply, block_bytes=[1], block_size=2, tier_bytes=tier_blocks, swap_bytes=0)
    from kvserve.runtime.engine.scheduler import Scheduler, SchedulerConfig
    from kvserve.runtime.engine.sequence import Sequence

    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), bm)
    bm.tier_lookup, bm.on_evict, sched.offload = offload.tier_lookup(0), offload.on_evict(0), offload
    families = [[f * 100 + i for i in range(12)] for f in range(4)]  # shared prefixes within a family
    live: list[Sequence] = []
    for kind, a, b in ops:
        if kind in ("admit", "request"):  # a request finishes at once; an admitted sequence stays
            seq = Sequence(f"s{len(live)}", families[a][: 2 * b + 1], max_tokens=1)
            sched.add(seq)
            out = sched.schedule()
            for item in out.scheduled:  # the forward pass: computed positions get their content
                s = item.seq
                if any(s is x for x in live):
                    continue  # already computed (it stays running until freed here)
                table = bm.get_block_table(s.seq_id)
                hashes = block_hashes(s.token_ids, 2)
                for i in range(item.start // 2, (item.start + item.num_new_tokens) // 2):
                    content[table[i]] = hashes[i]
                s.num_computed_tokens += item.num_new_tokens
                s.block_hashes = hashes
                bm.register(s.seq_id, hashes)
                live.append(s)
            while sched.waiting:  # not admitted (no room): it leaves
                sched.finish(sched.waiting[0], SequenceStatus.FINISHED_ABORTED)
            if kind == "request" and live and live[-1] is seq:
                sched.finish(live.pop(), SequenceStatus.FINISHED_STOPPED)
        elif kind == "free" and live:
            s = live.pop(a % len(live))
            sched.finish(s, SequenceStatus.FINISHED_STOPPED)
        elif kind == "corrupt" and offload.tier is not None and len(offload.tier):
            unreadable.add(offload.tier.keys()[a % len(offload.tier)])
        bm.check_invariants()
        for s in live:  # every full block a live sequence holds has its content
            table = bm.get_block_table(s.seq_id)
            for i, h in enumerate(block_hashes(s.token_ids, 2)[: s.num_computed_tokens // 2]):
                assert content.get(table[i]) == h
        assert offload.tier is None or offload.tier.used_bytes <= tier_blocks
    for s in live:
        sched.finish(s, SequenceStatus.FINISHED_STOPPED)
    bm.check_invariants()
    assert bm.num_used_blocks == 0
