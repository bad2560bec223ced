"""Grammar compiles nobody can use to starve the server: a timeout that kills the compile, the
last waiter leaving stops it, one client holds at most workers - 1 workers, bounded queue and
cache. Against SmolLM2's real 49k vocabulary (where big schemas really are slow to compile):
first the compile service on its own, then `kvserve serve` with the openai client and raw HTTP.

The attack (issue 18): two 8,000-branch anyOf schemas kept both compile threads busy ~18 s and
left 1.5 GB behind. Scaled down: the same shape against a 1.5 s timeout."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import threading
import time

import httpx
import openai
import pytest
from server_helpers import http, idle, wait_until

from kvserve.runtime.server.main import ServerThread
from kvserve.runtime.structured_outputs.admission import CompileSettings, GrammarCompileBusy
from kvserve.runtime.structured_outputs.limits import GrammarLimits
from kvserve.runtime.structured_outputs.manager import StructuredOutputManager
from kvserve.runtime.structured_outputs.params import StructuredOutputsParams as P

TIMEOUT_S = 1.5
BIG = GrammarLimits(max_alternatives=100_000, max_schema_bytes=10_000_000)


def heavy(tag: str, n: int = 8000) -> dict:
    """~5 s and a few hundred MB to compile on SmolLM2's vocabulary (2 cores, AVX2)."""
    return {"anyOf": [{"type": "object", "properties": {f"{tag}{i}": {"type": "string"}}, "required": [f"{tag}{i}"]}
                      for i in range(n)]}


def small(tag: str) -> dict:
    return {"type": "object", "properties": {tag: {"type": "integer"}}, "required": [tag], "additionalProperties": False}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.hf_dir)


@pytest.fixture(scope="module")
def vocabulary(tokenizer):
    """xgrammar's scan of the vocabulary (~1 s), done once for all the managers built here."""
    return StructuredOutputManager(tokenizer, 49152, [tokenizer.eos_token_id])._tokenizer_info()


@pytest.fixture
def make_manager(tokenizer, vocabulary):
    made = []

    def make(**settings):
        settings.setdefault("timeout_s", TIMEOUT_S)
        manager = StructuredOutputManager(tokenizer, 49152, [tokenizer.eos_token_id])
        manager._info = vocabulary
        manager.configure(BIG, CompileSettings(**settings))
        made.append(manager)
        wait_until(lambda: len(manager.worker_pids()) == manager.settings.workers, timeout=60)
        manager.compile(P(json=small("warm"))).result(60)  # workers ready: their start is not in any test's time
        return manager

    yield make
    for manager in made:
        manager.close()


def running_pid(manager, key_params) -> int:
    """The pid of the worker compiling ``key_params``, once it runs."""
    def find():
        with manager._lock:
            job = manager._jobs.get(key_params.key())
            return job is not None and job.running and job.pid
    return wait_until(find, timeout=10, interval=0.01)


# -- the compile service ----------------------------------------------------------------------------------


def test_a_compile_past_the_timeout_is_killed_and_refused_again_at_once(make_manager):
    manager = make_manager()
    attack, again = P(json=heavy("t")), P(json=heavy("t"))
    before_pids = set(manager.worker_pids())
    parent_rss, parent_cpu = rss_mib(), sum(os.times()[:2])
    start = time.monotonic()
    ticket = manager.acquire(attack, client="attacker")
    with pytest.raises(ValueError) as exc:
        ticket.future.result(30)
    took = time.monotonic() - start
    ticket.release()
    assert "took longer than the server's limit of 1.5 s (--structured-outputs-compile-timeout)" in str(exc.value)
    assert TIMEOUT_S <= took < TIMEOUT_S + 3.0, took  # uncapped, it compiles for 5 s or more
    killed = before_pids - set(manager.worker_pids())
    assert len(killed) == 1
    wait_until(lambda: not any(alive(pid) for pid in killed), timeout=5)  # its CPU and memory are the OS's again
    # The compile ran in the worker, not here: this process neither computed nor kept it (the
    # limits check, a walk over the schema, is the only work done here).
    assert sum(os.times()[:2]) - parent_cpu < 0.5 * took
    assert rss_mib() - parent_rss < 50
    # A refusal is remembered: the same schema again costs nothing.
    start = time.monotonic()
    with pytest.raises(ValueError, match="--structured-outputs-compile-timeout"):
        manager.acquire(again, client="attacker").future.result(1)
    assert time.monotonic() - start < 0.5
    # ... and the slot has a fresh worker for the next compile.
    wait_until(lambda: len(manager.worker_pids()) == 2, timeout=10)
    assert manager.compile(P(json=small("after"))).result(10) is not None


def test_a_compile_past_the_memory_limit_is_killed(make_manager):
    manager = make_manager(timeout_s=60.0, max_compile_bytes=8 * 1024 * 1024)
    params = P(json=heavy("m"))
    ticket = manager.acquire(params, client="a")
    pid = running_pid(manager, params)
    with pytest.raises(ValueError) as exc:
        ticket.future.result(30)
    ticket.release()
    assert "more than the server's limit of 8 MiB of memory (--structured-outputs-compile-max-memory)" in str(exc.value)
    wait_until(lambda: not alive(pid), timeout=5)
    assert manager.compile(P(json=small("fine"))).result(10) is not None  # small compiles stay under it


def test_the_last_waiter_leaving_stops_the_compile_and_gives_its_memory_back(make_manager):
    manager = make_manager(timeout_s=60.0)
    first = manager.acquire(P(json=heavy("c")), client="a")
    second = manager.acquire(P(json=heavy("c")), client="b")  # the same schema: one compile, two waiters
    assert second.future is first.future
    pid = running_pid(manager, P(json=heavy("c")))
    time.sleep(0.5)
    compiling_rss = rss_mib(pid)
    first.release()
    time.sleep(0.3)
    assert alive(pid), "another request still waits for it"
    start = time.monotonic()
    second.release()
    wait_until(lambda: not alive(pid), timeout=2, interval=0.01)
    assert time.monotonic() - start < 1.0
    assert first.future.cancelled()
    print(f"worker {pid}: {compiling_rss:.0f} MiB while compiling, gone {time.monotonic() - start:.2f}s after "
          "the last waiter left")
    # Not remembered as a failure: asking again compiles again (and is stopped again).
    again = manager.acquire(P(json=heavy("c")), client="a")
    assert not again.future.done()
    again.release()
    wait_until(lambda: again.future.cancelled(), timeout=2)


def test_one_client_cannot_hold_every_worker(make_manager):
    manager = make_manager(max_per_client=3, timeout_s=60.0)
    schemas = [P(json=heavy(f"f{i}")) for i in range(4)]
    attacks = [manager.acquire(s, client="attacker") for s in schemas[:3]]
    with pytest.raises(GrammarCompileBusy, match="--structured-outputs-max-compiles-per-client"):
        manager.acquire(schemas[3], client="attacker")
    running_pid(manager, schemas[0])
    start = time.monotonic()
    ticket = manager.acquire(P(json=small("user")), client="user")
    assert ticket.future.result(10) is not None
    served_in = time.monotonic() - start
    assert served_in < 1.0, served_in
    with manager._lock:
        assert manager._running["attacker"] == 1  # the others wait for the attacker's own share
    # Joining a compile another client started is free, whoever asks.
    joined = manager.acquire(schemas[1], client="someone else")
    assert joined.future is attacks[1].future
    for t in attacks + [joined, ticket]:
        t.release()
    wait_until(lambda: not manager._jobs, timeout=5)


def test_a_full_queue_answers_busy_and_loses_nothing(make_manager):
    manager = make_manager(workers=2, max_queued=2, max_per_client=8, timeout_s=60.0)
    held = [manager.acquire(P(json=heavy(f"q{i}")), client=f"c{i}") for i in range(2)]  # both workers
    running_pid(manager, P(json=heavy("q1")))
    waiting = [manager.acquire(P(json=small(f"w{i}")), client=f"w{i}") for i in range(2)]
    with pytest.raises(GrammarCompileBusy, match="--structured-outputs-max-queued-compiles"):
        manager.acquire(P(json=small("w2")), client="w2")
    for t in held:
        t.release()
    for t in waiting:
        assert t.future.result(10) is not None
        t.release()
    with manager._lock:
        assert not manager._jobs and not manager._waiting and not manager._owned and not manager._running


def cached(manager) -> tuple[int, int]:
    with manager._lock:  # the slot caches a compile under the lock, just after its waiters wake
        return len(manager._futures), manager.cache_bytes


def test_the_cache_is_bounded_by_entries_and_bytes(make_manager):
    manager = make_manager(cache_entries=3)
    for i in range(5):
        manager.compile(P(json=small(f"e{i}"))).result(10)
    entries, size = cached(manager)
    assert entries == 3
    one = size / 3
    manager.close()
    manager = make_manager(cache_bytes=int(2.5 * one))
    for i in range(4):
        manager.compile(P(json=small(f"b{i}"))).result(10)
    entries, size = cached(manager)
    assert entries == 2 and size <= 2.5 * one


def test_no_worker_is_a_server_error_and_not_remembered(tokenizer, monkeypatch):
    from kvserve.runtime.structured_outputs import worker_pool

    def cannot_fork():
        raise OSError("injected: fork failed")

    monkeypatch.setattr(worker_pool._zygote, "fork", cannot_fork)
    manager = StructuredOutputManager(tokenizer, 49152, [tokenizer.eos_token_id])
    try:
        with pytest.raises(RuntimeError, match="no grammar compile worker could be started"):
            manager.compile(P(json=small("nofork"))).result(60)
        monkeypatch.undo()  # the fault passes: the same grammar compiles, it was not refused for good
        assert manager.compile(P(json=small("nofork"))).result(60) is not None
    finally:
        manager.close()


def test_close_kills_the_workers(make_manager):
    manager = make_manager()
    pids = manager.worker_pids()
    ticket = manager.acquire(P(json=heavy("z")), client="a")
    running_pid(manager, P(json=heavy("z")))
    manager.close()
    assert ticket.future.cancelled()
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout=5)


# -- through `kvserve serve` ------------------------------------------------------------------------------

MODEL = "tiny-smol-vocab"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, smollm2, tmp_path_factory):
    """A tiny random Llama over SmolLM2's tokenizer: grammars compile against the real vocabulary."""
    dst = tmp_path_factory.mktemp("smolvocab") / "m"
    shutil.copytree(tiny_model_factory("llama", vocab_size=49152), dst)
    for name in os.listdir(dst):
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            os.remove(dst / name)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2.hf_dir / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread([str(model_dir), "--served-model-name", MODEL, "--max-model-len", "512", "--num-kv-blocks",
                        "64", "--port", "0", "--structured-outputs-compile-timeout", str(TIMEOUT_S),
                        "--structured-outputs-max-alternatives", "100000",
                        "--structured-outputs-max-schema-bytes", "10000000", "--structured-outputs-max-depth", "12",
                        "--max-schema-chars", "10000000"])
    srv.start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
    manager = srv.server.state.engine.structured_outputs
    # Workers start with the first structured request, not with the server.
    assert manager.worker_pids() == []
    ask(client_from(srv, "127.0.0.1"), {"type": "object", "properties": {"warm": {"type": "integer"}}}, max_tokens=2)
    wait_until(lambda: len(manager.worker_pids()) == 2, timeout=60)
    yield srv
    assert srv.stop() == 0


def client_from(server, address: str) -> openai.OpenAI:
    # Another loopback source address is another client to the server.
    http_client = httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, http_client=http_client)


def ask(client, schema, max_tokens=20):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=max_tokens, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


def test_attack_two_heavy_schemas_are_stopped_while_another_client_is_served(server):
    attacker, user = client_from(server, "127.0.0.2"), client_from(server, "127.0.0.1")
    ask(user, small("warm"))
    quiet = time.monotonic()
    ask(user, small("quiet"), max_tokens=30)  # the same work with no attack: this machine's pace now
    quiet = time.monotonic() - quiet
    results = {}

    def attack(i):
        try:
            ask(attacker, heavy(f"a{i}"))
        except Exception as exc:  # noqa: BLE001 - inspected below
            results[i] = (time.monotonic(), exc)

    start = time.monotonic()
    threads = [threading.Thread(target=attack, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    manager = server.server.state.engine.structured_outputs
    wait_until(lambda: manager._running.get("127.0.0.2"), timeout=10, interval=0.01)
    asked = time.monotonic()
    answer = ask(user, small("user"), max_tokens=30)
    served = time.monotonic() - asked
    print(f"attack compiling after {asked - start:.2f}s; the other client served in {served:.2f}s "
          f"({quiet:.2f}s with no attack)")
    for t in threads:
        t.join(30)
    # Before issue 18 it waited for both attack compiles (34 s); now only for a share of the CPU.
    assert served < max(TIMEOUT_S, 3 * quiet), f"the other client waited {served:.1f}s ({quiet:.1f}s with no attack)"
    json.loads(answer.choices[0].message.content)  # the grammar held: valid JSON of the small schema
    for i in range(2):
        finished, exc = results[i]
        assert isinstance(exc, openai.BadRequestError), exc
        assert exc.body["param"] == "response_format.json_schema.schema"
        assert "--structured-outputs-compile-timeout" in exc.body["message"]
    # One at a time (the attacker's share is one worker): the second stopped a timeout after the first.
    # (slack for a loaded 2-core machine: a kill and a fresh worker take seconds there)
    assert max(r[0] for r in results.values()) - start < 2 * TIMEOUT_S + 5.0
    assert http(server.url, "GET", "/health")[0] == 200
    idle(server.url)


def test_a_client_that_disconnects_stops_its_compile(server):
    manager = server.server.state.engine.structured_outputs
    schema = heavy("gone")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}

    async def send_then_leave() -> tuple[int, float]:
        async with httpx.AsyncClient(timeout=60) as client:
            request = asyncio.create_task(client.post(server.url + "/v1/chat/completions", json=body))
            pid = await asyncio.to_thread(running_pid, manager, P(json=schema))
            compiling_since = time.monotonic()
            request.cancel()  # the connection closes with the request unanswered
            with pytest.raises(asyncio.CancelledError):
                await request
        return pid, compiling_since

    pid, compiling_since = asyncio.run(send_then_leave())
    wait_until(lambda: not alive(pid), timeout=TIMEOUT_S, interval=0.01)
    stopped_after = time.monotonic() - compiling_since
    assert stopped_after < TIMEOUT_S - 0.5, f"stopped by the timeout ({stopped_after:.2f}s), not by the client leaving"
    with manager._lock:
        assert not manager._jobs and P(json=schema).key() not in manager._futures  # not remembered as refused
    assert http(server.url, "GET", "/health")[0] == 200
    idle(server.url)


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "object", "properties": {"d": {"type": "object", "properties": {"e": {
            "type": "object", "properties": {"f": {"type": "string"}}}}}}}}}}}}},
     "nests deeper than the server's limit of 12 levels (--structured-outputs-max-depth)"),
])
def test_limits_are_400s_naming_field_and_flag(server, schema, message):
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client_from(server, "127.0.0.1"), schema)
    assert exc.value.body["param"] == "response_format.json_schema.schema"
    assert message in exc.value.body["message"]


def test_busy_is_a_429_with_retry_after(server):
    manager = server.server.state.engine.structured_outputs
    schemas = [P(json=heavy(f"busy{i}")) for i in range(4)]
    settings = manager.settings
    manager.settings = dataclasses.replace(settings, timeout_s=60.0)  # held for the whole test, however loaded
    held = [manager.acquire(s, client="127.0.0.1") for s in schemas]
    try:
        status, headers, body = http(server.url, "POST", "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": small("busy")}}})
        assert status == 429, body
        assert headers["retry-after"] == "1"
        error = json.loads(body)["error"]
        assert error["type"] == "rate_limit_error" and "--structured-outputs-max-compiles-per-client" in error["message"]
    finally:
        for t in held:
            t.release()
        manager.settings = settings
    wait_until(lambda: not manager._jobs, timeout=5)
