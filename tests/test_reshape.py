"""Live parallel-layout changes (issue 22) through the real server: G = 2 CPU devices served as
2 x TP1 or 1 x TP2 (real worker processes, real gloo), changed by POST /admin/parallelism under a
load of 32 streaming requests on the official openai client.

Every stream ends on its own connection with the greedy text the server gives without any
reshape, none is lost or fails, and the KV cache is empty afterwards; a worker killed while the
new layout starts rolls the reshape back and the server goes on serving.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import weakref

import openai
import pytest
from server_helpers import http, idle, m, metrics, wait_until
from test_tensor_parallel import tp_worker_pids

from kvserve.runtime.server.main import ServerThread

ADMIN = "admin-secret"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
MODEL = "tiny"
N_STREAMS = 32
MAX_TOKENS = 48
PROMPTS = [f"Request {i}: once upon a time" + " the" * (i % 7) for i in range(N_STREAMS)]


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerThread([str(tiny_llama), "--served-model-name", MODEL, "--port", "0", "--device", "cpu",
                        "--data-parallel-size", "2", "--admin-api-key", ADMIN, "--block-size", "4",
                        "--num-kv-blocks", "1024", "--max-model-len", "256", "--max-num-seqs", "32",
                        "--drain-timeout", "5"]).start()
    wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
    yield srv.url
    assert srv.stop() == 0
    assert not tp_worker_pids()


@pytest.fixture(scope="module")
def greedy(server):
    """Each prompt's greedy text from the server with no reshape (2 x TP1)."""
    async def one(client, prompt):
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def run():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    return asyncio.run(run())


def reshape(url: str, dp: int, tp: int, headers=ADMIN_AUTH):
    return http(url, "POST", "/admin/parallelism", {"data_parallel": dp, "tensor_parallel": tp}, headers=headers,
                timeout=120)


async def _stream(client, prompt: str, started: threading.Event, counter: list) -> tuple[str, str | None]:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    text, finish = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            if text:
                counter[0] += 1
                started.set()
    return text, finish


def _load(url: str, prompts: list[str], started: threading.Event, first: int) -> list:
    """Runs the streams: `first` of them at once, the rest only once the first tokens flowed (so
    they arrive while a reshape is under way)."""
    async def run():
        counter = [0]
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            tasks = [asyncio.create_task(_stream(client, p, started, counter)) for p in prompts[:first]]
            # Streams that all failed never set `started`: stop waiting then (a dead server must
            # fail the test, not hang the run at exit).
            deadline = time.monotonic() + 120
            while not started.is_set() and not all(t.done() for t in tasks) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            tasks += [asyncio.create_task(_stream(client, p, started, counter)) for p in prompts[first:]]
            return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(run())


def test_reshape_under_streaming_load_keeps_every_stream_and_its_text(server, greedy):
    started = threading.Event()
    results: list = []
    loader = threading.Thread(target=lambda: results.extend(_load(server, PROMPTS, started, N_STREAMS // 2)),
                              daemon=True)
    loader.start()
    assert started.wait(60)
    status, _, body = reshape(server, 1, 2)  # the second half of the streams arrives meanwhile
    assert status == 200, body
    first = __import__("json").loads(body)
    assert (first["data_parallel"], first["tensor_parallel"], first["changed"]) == (1, 2, True)
    assert first["resumed_requests"] > 0  # streams were in flight
    status, _, body = reshape(server, 2, 1)
    assert status == 200, body
    loader.join(120)
    assert len(results) == N_STREAMS
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert [finish for _, finish in results] == ["length"] * N_STREAMS
    assert [text for text, _ in results] == greedy
    snap = idle(server)  # KV blocks back to 0
    assert m(snap, "kvserve:data_parallel_size") == 2 and m(snap, "kvserve:tensor_parallel_size") == 1
    assert m(snap, "kvserve:reshape_seconds_count") == 2
    assert m(snap, "vllm:request_success_total", finished_reason="length") >= 2 * N_STREAMS
    status, _, body = http(server, "GET", "/admin/parallelism", headers=ADMIN_AUTH)
    layout = __import__("json").loads(body)
    assert (layout["data_parallel"], layout["tensor_parallel"], layout["devices"]) == (2, 1, 2)
    assert [h["to"]["tensor_parallel"] for h in layout["history"]][-2:] == [2, 1]
    # No tier is configured: the streams' KV moved through a transient one in RAM, since deleted.
    moved = [h["kv"] for h in layout["history"][-2:]]
    assert moved[0]["read_blocks"] > 0, moved
    wait_until(lambda: not any(k.get("transient_dir") and os.path.exists(k["transient_dir"]) for k in moved),
               timeout=10)


def test_worker_killed_mid_reshape_rolls_back_and_keeps_serving(server, greedy):
    before = tp_worker_pids()
    killed: list[int] = []
    stop = threading.Event()

    def kill_new_worker():
        # The new layout's rank 1 is a fresh interpreter: kill it while it starts.
        while not stop.is_set():
            new = tp_worker_pids() - before
            if new:
                pid = new.pop()
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.005)

    started = threading.Event()
    results: list = []
    loader = threading.Thread(target=lambda: results.extend(_load(server, PROMPTS[:8], started, 8)), daemon=True)
    loader.start()
    assert started.wait(60)
    killer = threading.Thread(target=kill_new_worker)
    killer.start()
    try:
        status, _, body = reshape(server, 1, 2)
    finally:
        stop.set()
        killer.join()
    assert killed
    assert status == 500 and b"rolled back" in body, body
    loader.join(120)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert [text for text, _ in results] == greedy[:8]
    status, _, body = http(server, "GET", "/admin/parallelism", headers=ADMIN_AUTH)
    layout = __import__("json").loads(body)
    assert (layout["data_parallel"], layout["tensor_parallel"]) == (2, 1)
    assert "error" in layout["history"][-1]
    assert http(server, "GET", "/health")[0] == 200
    status, _, body = http(server, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True})
    assert status == 200 and __import__("json").loads(body)["choices"][0]["text"] == greedy[3]
    idle(server)
    assert not tp_worker_pids() - before


@pytest.mark.parametrize("body, status, field", [
    ({"data_parallel": 2, "tensor_parallel": 2}, 400, "data_parallel x tensor_parallel"),
    ({"data_parallel": 0, "tensor_parallel": 2}, 400, "data_parallel"),
    ({"data_parallel": 1, "tensor_parallel": "2"}, 400, "tensor_parallel"),
    ({"data_parallel": 1, "tensor_parallel": 2, "pipeline": 1}, 400, "pipeline"),
    ("[1, 2]", 400, "JSON object"),
])
def test_bad_layouts_are_400_naming_the_field(server, body, status, field):
    got, _, text = http(server, "POST", "/admin/parallelism", body, headers=ADMIN_AUTH)
    assert got == status and field.encode() in text, text


def test_parallelism_needs_the_admin_key(server):
    assert reshape(server, 1, 2, headers={})[0] == 401
    assert reshape(server, 1, 2, headers={"Authorization": "Bearer wrong"})[0] in (401, 403)
    assert http(server, "GET", "/admin/parallelism")[0] == 401
    snap = metrics(server)
    assert m(snap, "kvserve:data_parallel_size") == 2


def test_spare_workers_and_one_kv_events_endpoint_across_reshapes(tiny_llama, tmp_path):
    """One engine for two checks (each engine start costs seconds of CI). Spare workers: the
    layout's tensor-parallel rank is a spare started while 2 x TP1 ran, the text is the same, and
    nothing outlives the engine. KV events: the server's one publisher outlives both reshapes, so
    a subscriber that connected once gets every layout's events, numbered on without a gap; each
    reshape says AllBlocksCleared for the whole pod first, and a router index fed the stream
    follows (it ends holding the last layout's blocks only)."""
    import zmq

    from kvserve.runtime.config import EngineConfig
    from kvserve.runtime.engine.data_parallel import DataParallelEngine
    from kvserve.runtime.executor.multiproc import spare_worker_pids
    from kvserve.runtime.kv_events import AllBlocksCleared, BlockStored, decode_batch
    from kvserve.runtime.router.kv_index import PodKVIndex
    from kvserve.runtime.sampling_params import SamplingParams

    endpoint = f"ipc://{tmp_path}/kv-events"
    config = EngineConfig.from_args(model=str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=256,
                                    max_model_len=256, enable_prefix_caching=True,
                                    kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    got: list = []  # (seq, batch) in arrival order

    def drain(until) -> list:
        """Everything that arrives until `until(new batches)` holds (10 s at most): the
        previous layout's batches are read before the next layout's are looked for."""
        start, deadline = len(got), time.monotonic() + 10
        while not until(got[start:]) and sub.poll(max(1, int(1000 * (deadline - time.monotonic())))):
            _, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), decode_batch(payload)))
        return got[start:]

    def cleared_then_stored(batches, ranks) -> bool:
        kinds = [(type(e), b.data_parallel_rank) for _, b in batches for e in b.events]
        return (AllBlocksCleared, None) in kinds and any(
            k == BlockStored and r in ranks for k, r in kinds[kinds.index((AllBlocksCleared, None)):])

    engine = DataParallelEngine(config, 2, spare_workers=True)
    try:
        sub.connect(endpoint)
        time.sleep(0.3)  # the subscription reaches the publisher
        spares = spare_worker_pids()
        assert len(spares) == 1 and set(spares) <= tp_worker_pids()
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8]}, params)
        engine.add_request("other", {"prompt_token_ids": list(range(30, 46))}, params)  # the other engine
        assert sorted(e.get_num_unfinished_requests() for e in engine.engines) == [1, 1]
        before = [o for o in engine.step() if o.request_id == "a"]
        first = drain(lambda new: {b.data_parallel_rank for _, b in new} >= {0, 1})
        assert {b.data_parallel_rank for _, b in first} == {0, 1}  # each engine's prefill, tagged
        # On the CPU the engines of a layout share one copy of the weights (host_weights) ...
        weights = [dict(e.executor.driver_worker.model.named_parameters()) for e in engine.engines]
        assert all(p is weights[1][name] for name, p in weights[0].items())
        old_model = weakref.ref(engine.engines[0].executor.driver_worker.model)
        del weights
        engine.reshape(1, 2)
        # ... and a reshape frees the old layout's without a garbage collection (it runs later).
        assert old_model() is None and engine._collect_due is not None
        assert engine.engines[0].executor.worker_pids == spares and not spare_worker_pids()
        assert engine.engines[0].executor.rank_reports[1]["preloaded"]  # its shard loaded while it waited
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        # 1 x TP2: one engine, untagged; its events arrive on the connection the subscriber has.
        assert cleared_then_stored(drain(lambda new: cleared_then_stored(new, {None})), {None})
        engine.reshape(2, 1)
        assert len(spare_worker_pids()) == 1  # ready for the next reshape
        engine.add_request("b", {"prompt_token_ids": [5, 6, 7, 8]}, params)
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert cleared_then_stored(drain(lambda new: cleared_then_stored(new, {0, 1})), {0, 1})
        assert before and done["a"].outputs[0].token_ids == done["b"].outputs[0].token_ids
        published = engine.get_stats().kv_events_published_total
        drain(lambda new: len(got) >= published)
    finally:
        engine.close()
        sub.close(0)
        context.term()
    assert not spare_worker_pids() and not tp_worker_pids()
    assert [seq for seq, _ in got] == list(range(len(got)))  # one numbering: no restart, no gap
    index = PodKVIndex()
    for seq, batch in got:
        assert index.live(seq, batch, now=1.0) is None  # applied in order, nothing to replay
    last_clear = max(i for i, (_, b) in enumerate(got) if any(isinstance(e, AllBlocksCleared) for e in b.events))
    earlier = {h for _, b in got[:last_clear] for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes}
    later = {h for _, b in got[last_clear:] for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert index.blocks and set(index.blocks) <= later  # the last layout's blocks only
    assert earlier - later and not (earlier - later) & set(index.blocks)  # "other"'s blocks went with the reshape


def test_prefix_keys_and_engine_choice():
    from kvserve.runtime.engine.layout import choose_engine, prefix_keys

    a = list(range(40))
    assert len(prefix_keys(a)) == 2  # two full blocks of 16
    assert prefix_keys(a + [99] * 30)[:2] == prefix_keys(a) and prefix_keys([1] + a)[0] != prefix_keys(a)[0]
    assert prefix_keys({"prompt_token_ids": a}) == prefix_keys(a) and prefix_keys("x" * 64) != []
    assert prefix_keys(None) == [] and prefix_keys(a[:15]) == []
    assert choose_engine([3, 1], preferred=0) == 0  # within the slack of 2: its cache wins
    assert choose_engine([4, 1], preferred=0) == 1  # clearly busier: the least loaded
    assert choose_engine([2, 1], preferred=None) == 1


def test_a_conversation_turn_goes_to_the_engine_holding_its_prefix(tiny_llama):
    from kvserve.runtime.config import EngineConfig
    from kvserve.runtime.engine.data_parallel import DataParallelEngine
    from kvserve.runtime.sampling_params import SamplingParams

    config = EngineConfig.from_args(model=str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=128,
                                    max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    history = list(range(5, 45))
    with DataParallelEngine(config, 2) as engine:
        engine.add_request("turn-1", {"prompt_token_ids": history}, params)
        engine.add_request("other", {"prompt_token_ids": list(range(100, 140))}, params)
        first = engine._owner["turn-1"]
        assert engine._owner["other"] is not first  # least outstanding
        engine.add_request("turn-2", {"prompt_token_ids": history + [7, 8, 9] * 6}, params)
        assert engine._owner["turn-2"] is first  # its prefix ran there
        while engine.has_unfinished_requests():
            engine.step()


def test_parallel_samples_seeds_stop_strings_and_logprobs_survive_reshapes(tiny_llama):
    """n > 1 with a seed, a seeded sample, a stop string and logprobs: the same outputs with two
    reshapes mid-generation as without (the requests carry their samplers' state across)."""
    from kvserve.runtime.config import EngineConfig
    from kvserve.runtime.engine.data_parallel import DataParallelEngine
    from kvserve.runtime.sampling_params import SamplingParams

    config = EngineConfig.from_args(model=str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=256,
                                    max_model_len=256)

    def run(reshapes: dict) -> dict:
        out = {}
        with DataParallelEngine(config, 2) as engine:
            engine.add_request("n2", {"prompt_token_ids": list(range(5, 30))},
                               SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=16, ignore_eos=True))
            engine.add_request("seeded", {"prompt_token_ids": list(range(40, 60))},
                               SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True))
            engine.add_request("stop", "hello world", SamplingParams(temperature=0, max_tokens=20, stop=["zz"]))
            engine.add_request("logprobs", {"prompt_token_ids": list(range(70, 80))},
                               SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True))
            steps = 0
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        out[o.request_id] = [(c.token_ids, c.text, c.finish_reason,
                                              [sorted(lp) for lp in c.logprobs or []]) for c in o.outputs]
                steps += 1
                if steps in reshapes:
                    engine.reshape(*reshapes[steps])
            assert engine.get_stats().kv_blocks_used == 0
        return out

    assert run({3: (1, 2), 7: (2, 1)}) == run({})


def test_with_a_file_tier_resumed_requests_read_their_kv_across_the_reshape(tiny_llama, tmp_path):
    """With --kv-offload-dir the retired engines write their cached blocks to the tier, and the new
    layout reads them at its own TP degree (sliced or joined heads): the requests a reshape
    resumes, and a conversation's next turn, find their KV there instead of recomputing it; the
    greedy output is the one without a reshape."""
    from kvserve.runtime.config import EngineConfig
    from kvserve.runtime.engine.data_parallel import DataParallelEngine
    from kvserve.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = {f"r{i}": list(range(5 + 20 * i, 5 + 20 * i + 24)) for i in range(2)}

    def run(reshape_at: int | None, tier) -> tuple[dict, int]:
        config = EngineConfig.from_args(model=str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=128,
                                        max_model_len=256, enable_prefix_caching=True,
                                        kv_offload_bytes=1 << 22, kv_offload_dir=str(tier))
        out: dict = {}
        with DataParallelEngine(config, 2) as engine:
            for rid, ids in prompts.items():
                engine.add_request(rid, {"prompt_token_ids": ids}, params)
            steps = 0
            while engine.has_unfinished_requests():
                out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
                steps += 1
                if steps == reshape_at:
                    hits = engine.get_stats().kv_offload_hit_tokens_total
                    engine.reshape(1, 2)
            hits = engine.get_stats().kv_offload_hit_tokens_total - (hits if reshape_at else 0)
        return out, hits

    want, _ = run(None, tmp_path / "plain")
    got, hits = run(4, tmp_path / "tier")
    assert got == want
    # each request had 24 prompt + 3 generated tokens: its 6 whole blocks came back from the tier
    # (the last, partial block is recomputed)
    assert hits >= 2 * 24, hits
