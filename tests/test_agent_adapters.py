"""The agent's LoRA adapter sync: the desired list parsed whole, the pure load/unload plan (table
tests), adapter fetch checks, and the sync loop over real files against a runtime that loads,
refuses and is unreachable in turn."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvserve.runtime.agent.adapters import (
    FAILED,
    LOADED,
    PENDING,
    AdapterState,
    AdapterSync,
    Desired,
    LoadRefused,
    Unreachable,
    backoff,
    parse_desired,
    plan,
    report,
)
from kvserve.runtime.agent.fetch import FetchError, check_adapter_dir, fetch


def make_adapter(path, rank=4, peft_type="LORA"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type, "r": rank,
                                                          "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(rank, 8)},
              str(path / "adapter_model.safetensors"))
    return path


@pytest.mark.parametrize("text, error", [
    ("{}", "must be a JSON list"),
    ("[1]", "adapters[0]: must be an object"),
    ('[{"name": "../x", "uri": "/a"}]', "adapters[0].name"),
    ('[{"name": "a", "uri": ""}]', "adapters[0].uri"),
    ('[{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]', "listed twice"),
    (json.dumps([{"name": f"a{i}", "uri": "/a"} for i in range(300)]), "at most 256"),
    ("not json", "not JSON"),
])
def test_parse_desired_refuses_the_whole_list(text, error):
    with pytest.raises(ValueError) as info:
        parse_desired(text)
    assert error in str(info.value)


def test_parse_desired():
    assert parse_desired("") == []
    assert parse_desired('[{"name": "sql", "uri": "hf://org/sql-lora"}]') == [Desired("sql", "hf://org/sql-lora")]


A, B = Desired("a", "/src/a"), Desired("b", "/src/b")


@pytest.mark.parametrize("desired, state, engine, load, unload", [
    ([A, B], {}, None, [A, B], []),
    ([A], {"a": AdapterState("/src/a", LOADED)}, None, [], []),
    ([A], {"a": AdapterState("/src/a", LOADED)}, ["a"], [], []),
    # the runtime restarted and lost it: load again
    ([A], {"a": AdapterState("/src/a", LOADED)}, [], [A], []),
    # dropped from the list
    ([], {"a": AdapterState("/src/a", LOADED)}, None, [], ["a"]),
    # uri changed: unload, then load from the new uri
    ([Desired("a", "/new")], {"a": AdapterState("/src/a", LOADED)}, None, [Desired("a", "/new")], ["a"]),
    # refused by the runtime: final for this uri
    ([A], {"a": AdapterState("/src/a", FAILED, "rank 64 > 16")}, None, [], []),
    # a fetch failure: again once its backoff has passed
    ([A], {"a": AdapterState("/src/a", FAILED, "fetch", retry_at=5.0)}, None, [A], []),
    ([A], {"a": AdapterState("/src/a", FAILED, "fetch", retry_at=50.0)}, None, [], []),
    ([A], {"a": AdapterState("/src/a", PENDING)}, None, [A], []),
])
def test_plan_table(desired, state, engine, load, unload):
    assert plan(desired, state, 10.0, engine) == (load, unload)


@pytest.mark.parametrize("seen_at, load", [
    (8.0, []),  # the list was asked for before the load was confirmed: it cannot show it yet
    (9.0, []),
    (9.5, [A]),  # asked for after: the runtime really lost it (it restarted)
])
def test_plan_ignores_a_scrape_older_than_the_load(seen_at, load):
    state = {"a": AdapterState("/src/a", LOADED, loaded_at=9.0)}
    assert plan([A], state, 10.0, [], seen_at) == (load, [])


def test_backoff_grows_and_is_capped():
    assert [backoff(n) for n in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert backoff(100) == 300.0


def test_report():
    assert report(None, {}, None) is None
    state = {"a": AdapterState("/a", LOADED), "b": AdapterState("/b", FAILED, "rank 64 > 16")}
    r = report([A, B, Desired("c", "/c")], state, None)
    assert r == {"desired": 3, "loaded": ["a"], "failed": {"b": "rank 64 > 16"}, "pending": ["c"],
                 "synced": False, "error": None}


def test_adapter_fetch_checks(tmp_path):
    good = make_adapter(tmp_path / "src" / "good")
    assert check_adapter_dir(good) == []
    out = fetch(str(good), str(tmp_path / "dest" / "good"), adapter=True)
    assert out["action"] == "fetched" and check_adapter_dir(tmp_path / "dest" / "good") == []
    bad = make_adapter(tmp_path / "src" / "ia3", peft_type="IA3")
    assert any("IA3" in p for p in check_adapter_dir(bad))
    (tmp_path / "src" / "empty").mkdir()
    with pytest.raises(FetchError, match="adapter_config.json: missing"):
        fetch(str(tmp_path / "src" / "empty"), str(tmp_path / "dest" / "empty"), adapter=True)
    with pytest.raises(FetchError, match="not a .gguf"):
        fetch("hf://org/name/x.gguf", str(tmp_path / "dest" / "x"), adapter=True)


class Runtime:
    """The runtime's admin routes as the sync sees them: refuses a rank above 8, can be down."""

    def __init__(self):
        self.loaded: dict[str, str] = {}
        self.down = False

    async def load(self, name, path):
        if self.down:
            raise Unreachable("connection refused")
        rank = json.loads((Path(path) / "adapter_config.json").read_text())["r"]
        if rank > 8:
            raise LoadRefused(f"HTTP 400: LoRA rank {rank} is above --max-lora-rank 8")
        self.loaded[name] = path

    async def unload(self, name):
        if self.down:
            raise Unreachable("connection refused")
        if self.loaded.pop(name, None) is None:
            raise LoadRefused("HTTP 404: not loaded")


def test_sync_loads_reports_and_unloads(tmp_path):
    make_adapter(tmp_path / "src" / "sql", rank=4)
    make_adapter(tmp_path / "src" / "big", rank=64)
    listing = tmp_path / "list" / "adapters.json"
    listing.parent.mkdir()
    runtime = Runtime()
    sync = AdapterSync(str(listing), str(tmp_path / "adapters"), runtime)

    def write(entries):
        listing.write_text(json.dumps(entries))
        sync._mtime = None  # the test writes faster than the filesystem's mtime resolution

    async def go():
        await sync.sync_once(0.0)
        assert sync.report() == {"desired": 0, "loaded": [], "failed": {}, "pending": [], "synced": True,
                                 "error": None}
        write([{"name": "sql", "uri": str(tmp_path / "src" / "sql")},
               {"name": "big", "uri": str(tmp_path / "src" / "big")},
               {"name": "gone", "uri": str(tmp_path / "src" / "missing")}])
        await sync.sync_once(1.0, engine_loaded=[])
        r = sync.report()
        assert r["loaded"] == ["sql"] and set(r["failed"]) == {"big", "gone"} and sync.settled
        assert "above --max-lora-rank" in r["failed"]["big"] and r["failed"]["gone"].startswith("fetch:")
        assert set(runtime.loaded) == {"sql"}
        # A broken list keeps the last good one, and says so.
        listing.write_text("[{")
        sync._mtime = None
        await sync.sync_once(2.0, engine_loaded=["sql"])
        assert sync.report()["error"].startswith("adapters: not JSON") and runtime.loaded
        # Removing an adapter unloads it and frees its files; the runtime going down leaves it pending.
        write([{"name": "big", "uri": str(tmp_path / "src" / "big")}])
        await sync.sync_once(3.0, engine_loaded=["sql"])
        assert runtime.loaded == {} and not (tmp_path / "adapters" / "sql").exists()
        runtime.down = True
        write([{"name": "sql", "uri": str(tmp_path / "src" / "sql")}])
        await sync.sync_once(4.0, engine_loaded=[])
        assert sync.report()["pending"] == ["sql"] and not sync.settled
        runtime.down = False
        await sync.sync_once(5.0, engine_loaded=[])
        assert sync.report()["loaded"] == ["sql"] and sync.settled

    asyncio.run(go())


def test_a_load_whose_answer_was_lost_is_taken_as_loaded_and_a_failed_unload_blocks_the_reload(tmp_path):
    """The runtime loaded `sql` but the agent never heard (a timeout): the next try's "already
    loaded" means it serves it. A new uri whose unload cannot reach the runtime is not loaded over
    the old one that round."""
    make_adapter(tmp_path / "src" / "sql", rank=4)
    make_adapter(tmp_path / "src" / "sql2", rank=4)
    listing = tmp_path / "adapters.json"
    runtime = Runtime()
    clock = iter(range(100, 200)).__next__
    sync = AdapterSync(str(listing), str(tmp_path / "adapters"), runtime, clock=clock)

    async def already(name, path, load=runtime.load):
        if name in runtime.loaded:
            raise LoadRefused(f"HTTP 400: The lora adapter '{name}' has already been loaded.")
        await load(name, path)

    runtime.load = already

    async def go():
        listing.write_text(json.dumps([{"name": "sql", "uri": str(tmp_path / "src" / "sql")}]))
        runtime.loaded["sql"] = str(tmp_path / "adapters" / "sql")  # loaded, answer lost
        sync.state["sql"] = AdapterState(str(tmp_path / "src" / "sql"), PENDING, "ReadTimeout")
        await sync.sync_once(1.0, engine_loaded=None)
        assert sync.report()["loaded"] == ["sql"] and sync.state["sql"].loaded_at is not None
        # A scrape requested before that confirmation does not list it: no reload, no failure.
        await sync.sync_once(2.0, engine_loaded=[], engine_seen_at=sync.state["sql"].loaded_at - 1)
        assert sync.report()["loaded"] == ["sql"] and not sync.report()["failed"]
        listing.write_text(json.dumps([{"name": "sql", "uri": str(tmp_path / "src" / "sql2")}]))
        sync._mtime = None
        runtime.down = True
        await sync.sync_once(3.0, engine_loaded=["sql"])
        assert sync.state["sql"].uri == str(tmp_path / "src" / "sql")  # kept until the unload works
        runtime.down = False
        await sync.sync_once(4.0, engine_loaded=["sql"])
        assert sync.state["sql"].uri == str(tmp_path / "src" / "sql2") and sync.report()["loaded"] == ["sql"]

    asyncio.run(go())
