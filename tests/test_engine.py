"""LLMEngine behaviour: bad input, aborts, streaming outputs, stats, the offline API and chat."""

from __future__ import annotations

import random

import pytest

from kvserve.runtime import LLM, EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_args(model=str(tiny_llama), block_size=4, num_kv_blocks=48,
                               max_model_len=64, max_num_batched_tokens=32)


def drain(engine, max_steps=2000):
    """Steps until idle; returns {request_id: [RequestOutput, ...]} in arrival order."""
    seen: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished_requests()
    return seen


GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("", GREEDY, "prompt"),
        ({"prompt_token_ids": []}, GREEDY, "prompt_token_ids"),
        (list(range(3, 70)), GREEDY, "prompt"),  # 67 tokens > max_model_len 64
        ([5, 6, 7], SamplingParams(max_tokens=62), "max_tokens"),  # 3 + 62 > 64
        ([5, 512], GREEDY, "prompt_token_ids"),  # vocab is 512
        ([5, -1], GREEDY, "prompt_token_ids"),
        ([5, 6], {"temperature": -0.5}, "temperature"),
        ([5, 6], {"top_p": 0.0}, "top_p"),
        ([5, 6], {"top_p": 1.5}, "top_p"),
        ([5, 6], {"max_tokens": 0}, "max_tokens"),
        ([5, 6], {"bogus_field": 1}, "bogus_field"),
        ([5, 6], SamplingParams(stop_token_ids=[600]), "stop_token_ids"),
        (12345, GREEDY, "prompt"),
    ],
)
def test_bad_input_names_the_field_and_the_engine_keeps_serving(engine, prompt, params, field):
    engine.add_request("good-1", [5, 6, 7, 8], GREEDY)
    engine.step()  # good-1 is running when the bad one arrives
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)
    engine.add_request("good-2", "Hello world", GREEDY)
    outs = drain(engine)
    assert set(outs) == {"good-1", "good-2"}
    assert all(o[-1].finished and len(o[-1].outputs[0].token_ids) == 8 for o in outs.values())
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kwargs,field", [
    (dict(n=0), "n"), (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(stop=[""]), "stop"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logprobs=-1), "logprobs"), (dict(temperature="hot"), "temperature"),
    (dict(seed=1.5), "seed"), (dict(ignore_eos="yes"), "ignore_eos"), (dict(unknown=1), "unknown"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=0), "block_size"), (dict(dtype="int4"), "dtype"), (dict(device="tpu"), "device"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(attention_backend="flash"), "attention_backend"), (dict(warp_speed=9), "warp_speed"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
])
def test_engine_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_args(model="/nonexistent", **kwargs)


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("dup", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", [7, 8], GREEDY)
    drain(engine)


def test_mixed_run_with_aborts_leaves_no_block_in_use(engine):
    rng = random.Random(3)
    ids = []
    for i in range(20):
        params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randrange(1, 20),
                                seed=rng.choice([None, i]), top_p=0.9)
        prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))]
        engine.add_request(f"m{i}", prompt, params)
        ids.append(f"m{i}")
    aborted = set()
    finished = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if step in (1, 2, 3, 5, 8):
            # one running (possibly mid-prefill), one waiting, and one unknown id each time
            victims = [s.request_id for s in engine.scheduler.running[:1]]
            victims += [s.request_id for s in list(engine.scheduler.waiting)[-1:]]
            for rid in victims + ["no-such-request"]:
                engine.abort_request(rid)
                aborted.add(rid)
            engine.block_manager.check_invariants()
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out
    assert set(finished) == set(ids)
    got_aborted = {rid for rid, o in finished.items() if o.outputs[0].finish_reason == "abort"}
    assert got_aborted == aborted - {"no-such-request"} and len(got_aborted) >= 5
    stats = engine.get_stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()


def test_streamed_text_extends_and_stats_are_recorded(engine):
    engine.get_stats()  # drain earlier observations
    before = engine.get_stats()
    engine.add_request("s1", "The quick brown fox", SamplingParams(temperature=0, max_tokens=12))
    engine.add_request("s2", [9, 10, 11], SamplingParams(temperature=0, max_tokens=5, stop=["zzz"]))
    outs = drain(engine)
    for stream in outs.values():
        texts = [o.outputs[0].text for o in stream]
        for a, b in zip(texts, texts[1:]):
            assert b.startswith(a)
        pieces = "".join(b[len(a):] for a, b in zip([""] + texts, texts))
        assert pieces == texts[-1]
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        m = stream[-1].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    stats = engine.get_stats()
    assert stats.generation_tokens_total - before.generation_tokens_total == 17
    assert stats.prompt_tokens_total - before.prompt_tokens_total == len(outs["s1"][0].prompt_token_ids) + 3
    assert len(stats.time_to_first_token) == 2 and len(stats.queue_times) == 2
    assert len(stats.e2e_latencies) == 2 and len(stats.inter_token_latencies) == 15
    assert stats.request_success_total["length"] >= 2
    assert stats.kv_blocks_total == 48 and stats.kv_cache_capacity_tokens == 192
    again = engine.get_stats()
    assert again.time_to_first_token == [] and again.generation_tokens_total == stats.generation_tokens_total


def test_llm_generate_strings_ids_and_order(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=8)
    prompts = ["Hello world", {"prompt_token_ids": [5, 6, 7]}, "Once upon a time"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=True)
    assert [o.prompt for o in outs] == ["Hello world", None, "Once upon a time"]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert all(o.finished and o.outputs[0].finish_reason in ("length", "stop") for o in outs)
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("Hello world")
    # a bad prompt among good ones: nothing is queued, and the engine stays usable
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["ok", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_used_blocks == 0
    assert len(llm.generate("again", SamplingParams(max_tokens=2), use_tqdm=False)) == 1


def test_llm_chat_uses_the_template(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=8)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered and rendered.startswith("<s><|user|>")
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids.count(tok.bos_token_id) == 1
    assert len(out.outputs[0].token_ids) >= 1
