"""Structured outputs in the engine (xgrammar): every kind, with batching, chunked prefill,
preemption, n > 1, prefix caching and speculative decoding, on tiny random-weight models."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.runtime import LLM, SamplingParams, StructuredOutputsParams
from kvserve.runtime.structured_outputs.manager import _string_lengths_as_patterns

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "admin": {"type": "boolean"}}, "required": ["name", "age", "tags", "admin"]}


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def sp(structured=None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 120)
    kw.setdefault("temperature", 1.0)
    return SamplingParams(structured_outputs=structured, **kw)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    # vocab 640 > the tokenizer's 512 entries: rows 512..639 exist in the logits and must never win.
    with LLM(str(tiny_model_factory("llama", vocab_size=640)), num_kv_blocks=96, max_model_len=512, seed=0) as m:
        yield m


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)  # json.loads refuses raw control characters


# -- params (pure) -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
    ({"json": [1]}, "structured_outputs.json: a JSON schema must be an object"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"grammar": "  "}, "structured_outputs.grammar"),
    ({"json_object": True, "bogus": 1}, "unknown field 'bogus'"),
])
def test_params_refuse_naming_the_field(kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        StructuredOutputsParams(**kw)


def test_params_key_and_coercion():
    a = so(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = so(json='{"type":  "object", "properties": {"x": {"type": "integer"}}}')
    assert a == b and a.key() == b.key() and a.kind == "json"
    assert so(json={"properties": {"b": {}, "a": {}}}) != so(json={"properties": {"a": {}, "b": {}}})
    p = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.clone() == p
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=5)


def test_length_bounded_strings_become_patterns():
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                               "b": {"type": "array", "items": {"type": "string", "minLength": 1}},
                                               "c": {"type": "string", "maxLength": 2, "enum": ["x"]}}}
    out = _string_lengths_as_patterns(schema)
    assert out["properties"]["a"] == {"type": "string", "pattern": "^[^\\x00-\\x1f]{0,3}$"}
    assert out["properties"]["b"]["items"] == {"type": "string", "pattern": "^[^\\x00-\\x1f]{1,}$"}
    assert out["properties"]["c"] == schema["properties"]["c"]
    assert schema["properties"]["a"] == {"type": "string", "maxLength": 3}  # the input is not changed


# -- every kind -------------------------------------------------------------------------------------
def test_every_kind_gives_valid_output(llm):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z] [0-9]?'
    cases = [
        (so(json=PERSON), lambda t: check_json(t, PERSON)),
        (so(json=json.dumps(PERSON), disable_any_whitespace=True), lambda t: check_json(t, PERSON)),
        (so(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) or pytest.fail(t)),
        (so(choice=["yes", "no", "it's \"complicated\""]),
         lambda t: t in ["yes", "no", "it's \"complicated\""] or pytest.fail(t)),
        (so(grammar=grammar), lambda t: re.fullmatch(r"\([a-z][0-9]?(,[a-z][0-9]?)*\)", t) or pytest.fail(t)),
    ]
    params = [sp(s, seed=i, max_tokens=400) for i, (s, _) in enumerate(cases)]
    outs = llm.generate(["Hello world"] * len(cases), params, use_tqdm=False)
    for (_, check), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        assert max(c.token_ids) < 512  # padding rows of the LM head are masked
        check(c.text)

    # Any JSON object: unbounded keys and strings, so a random model need not finish; whatever it
    # wrote is a prefix the grammar accepts, and is valid JSON whenever it did finish.
    import xgrammar as xgr

    anyobj = so(json_object=True)
    for c in llm.generate(["Hello"], sp(anyobj, n=3, seed=5, max_tokens=100), use_tqdm=False)[0].outputs:
        matcher = xgr.GrammarMatcher(llm.engine.structured_outputs.compile(anyobj).result())
        assert matcher.accept_string(c.text), c.text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_bad_grammars_raise_and_leak_nothing(llm):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    for bad, field in [(so(json={"type": "objectx"}), "structured_outputs.json"),
                       (so(regex="(ab"), "structured_outputs.regex"),
                       (so(grammar="root ::= "), "structured_outputs.grammar")]:
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate(["Hello", "world"], [sp(), sp(bad)], use_tqdm=False)
        with pytest.raises(ValueError, match=re.escape(field)):  # cached failure: refused at once
            engine.add_request("direct", "Hello", sp(bad))
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == free


def test_mixed_batch_leaves_free_requests_unchanged(llm):
    prompts = ["The quick brown fox", "Hello world", "Kubernetes schedules pods", "Once upon a time"]
    free = [sp(temperature=0, max_tokens=24, ignore_eos=True),
            sp(temperature=0.8, seed=7, top_k=50, max_tokens=24, ignore_eos=True)]
    alone = llm.generate(prompts[:2], free, use_tqdm=False)
    mixed = llm.generate(prompts, free + [sp(so(json=PERSON, disable_any_whitespace=True), seed=3, max_tokens=400),
                                             sp(so(regex="[a-z]{20}"), seed=4)],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    check_json(mixed[2].outputs[0].text, PERSON)
    assert re.fullmatch("[a-z]{20}", mixed[3].outputs[0].text)


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate(["Hello"], sp(so(json=PERSON), n=4, seed=11, max_tokens=400), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and len({c.text for c in out.outputs}) > 1
    for c in out.outputs:
        check_json(c.text, PERSON)


def test_grammar_survives_preemption_chunked_prefill_and_prefix_cache(tiny_model_factory):
    # 10 blocks of 16 tokens for 4 requests needing ~6 each: preemption by recompute is certain;
    # a 24-token step budget splits every prompt's prefill into chunks.
    path = tiny_model_factory("llama")
    prompt = "Kubernetes schedules pods onto nodes; an operator watches custom resources and reconciles them."
    with LLM(str(path), num_kv_blocks=10, max_num_batched_tokens=24, max_model_len=256) as m:
        params = [sp(so(regex="[a-z]{50,60}"), seed=i, max_tokens=70) for i in range(4)]
        outs = m.generate([prompt] * 4, params, use_tqdm=False)
        assert m.engine.get_stats().num_preemptions_total > 0
        for o in outs:
            assert re.fullmatch("[a-z]{50,60}", o.outputs[0].text), o.outputs[0]
        again = m.generate([prompt], params[:1], use_tqdm=False)[0]
        assert again.num_cached_tokens > 0
        assert again.outputs[0].text == outs[0].outputs[0].text  # seeded: the same despite the cache


def test_speculative_decoding_verifies_drafts_against_the_grammar(tiny_model_factory):
    # Greedy: the verified output must equal plain decoding token for token, drafts or not; the
    # repetitive grammar makes the n-gram proposer draft (and drafts the grammar refuses get cut).
    path = tiny_model_factory("llama")
    prompts = ["ab ab ab ab ab", "Hello world", "The quick brown fox"]
    params = [sp(so(regex="(ab ){3,12}(cd ){3,12}"), temperature=0, max_tokens=60),
              sp(so(json=PERSON, disable_any_whitespace=True), temperature=0, max_tokens=200),
              sp(temperature=0, max_tokens=30, ignore_eos=True)]
    with LLM(str(path), num_kv_blocks=64, max_model_len=512) as m:
        plain = m.generate(prompts, params, use_tqdm=False)
    with LLM(str(path), num_kv_blocks=64, max_model_len=512,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as m:
        spec = m.generate(prompts, params, use_tqdm=False)
        sampled = m.generate(["ab ab ab ab"] * 2, sp(so(regex="(ab ){3,12}(cd ){3,12}"), seed=9, max_tokens=60),
                             use_tqdm=False)  # rejection sampling over the masked distribution
        stats = m.engine.get_stats()
    for o in sampled:
        assert re.fullmatch("(ab ){3,12}(cd ){3,12}", o.outputs[0].text), o.outputs[0]
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert re.fullmatch("(ab ){3,12}(cd ){3,12}", spec[0].outputs[0].text)
    check_json(spec[1].outputs[0].text, PERSON)
    assert stats.spec_decode_num_drafts_total > 0 and stats.spec_decode_num_accepted_tokens_total > 0


def test_waiting_for_a_compile_does_not_hold_other_requests(llm):
    engine = llm.engine
    pending: Future = Future()
    slow = so(json={"type": "object", "properties": {"slow": {"type": "boolean"}}, "required": ["slow"]},
              disable_any_whitespace=True)
    engine.structured_outputs._futures[slow.key()] = pending  # a compilation that has not finished
    # add_requests without waiting (the server's path) admits it to wait in the core.
    engine.add_requests([("slow", "Hello", sp(slow, temperature=0, max_tokens=20))])
    engine.add_request("free", "Hello", sp(temperature=0, max_tokens=5, ignore_eos=True))
    finished = {}
    for _ in range(10):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert "free" in finished and "slow" not in finished
    assert engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == 0
    pending.set_result(engine.structured_outputs._compile(slow))
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert json.loads(finished["slow"].outputs[0].text) in ({"slow": True}, {"slow": False})

    engine.structured_outputs._futures[slow.key()] = Future()
    engine.add_requests([("aborted", "Hello", sp(slow))])
    engine.abort_request("aborted")
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
    assert not engine.has_unfinished_requests()
    del engine.structured_outputs._futures[slow.key()]


def test_a_direct_add_request_waits_for_its_grammar_all_or_nothing(llm):
    """LLMEngine.add_request settles a grammar still compiling before queueing: one that fails
    raises ValueError naming the field, and nothing is queued or held."""
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    key_params = so(json={"type": "object", "properties": {"late": {"type": "integer"}}})
    for outcome in ("fails", "compiles"):
        pending: Future = Future()
        engine.structured_outputs._futures[key_params.key()] = pending

        def settle(pending=pending, outcome=outcome):
            time.sleep(0.2)
            if outcome == "fails":
                pending.set_exception(ValueError("structured_outputs.json: failed while compiling (injected)"))
            else:
                pending.set_result(engine.structured_outputs._compile(key_params))

        threading.Thread(target=settle, daemon=True).start()
        if outcome == "fails":
            with pytest.raises(ValueError, match=r"structured_outputs\.json: failed while compiling"):
                engine.add_request("late", "Hello", sp(key_params, max_tokens=8))
            assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == free
        else:
            engine.add_request("late", "Hello", sp(key_params, temperature=0, max_tokens=8))
            while engine.has_unfinished_requests():
                engine.step()
        del engine.structured_outputs._futures[key_params.key()]


def test_stats_count_requests_and_compile_times(llm):
    before = llm.engine.get_stats().structured_output_requests_total
    schema = {"type": "object", "properties": {"stats_probe": {"type": "integer"}}}
    llm.generate(["a", "b"], [sp(so(json=schema), max_tokens=30)] * 2, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.structured_output_requests_total == before + 2
    assert len(stats.grammar_compile_times) == 1  # one schema, compiled once, cached for the second


# -- property: random schemas, random weights --------------------------------------------------------
def _schemas(depth: int = 0):
    scalar = st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda vals: {"enum": vals}, st.lists(st.one_of(st.integers(-3, 3), st.sampled_from(["x", "y z", "é"])),
                                                        min_size=1, max_size=3, unique=True)),
    )
    if depth >= 2:
        return scalar

    def obj(props, required_mask):
        names = list(props)
        return {"type": "object", "properties": props,
                "required": [n for n, r in zip(names, required_mask) if r]}

    nested = _schemas(depth + 1)
    objects = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), nested, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(lambda m: obj(props, m)))
    arrays = st.builds(lambda items, hi: {"type": "array", "items": items, "maxItems": hi}, nested, st.integers(0, 3))
    return st.one_of(scalar, objects, arrays)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(schema=_schemas(), seed=st.integers(0, 2**16), compact=st.booleans())
def test_property_random_schemas_always_give_valid_json(llm, schema, seed, compact):
    out = llm.generate(["Hello"], sp(so(json=schema, disable_any_whitespace=compact), seed=seed, max_tokens=400),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", (schema, out)
    check_json(out.text, schema)


def test_llm_chat_passes_tools_to_the_template(llm):
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}"
                "<|end|>{% endfor %}<|assistant|>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = llm.chat(messages, sp(max_tokens=2), chat_template=template, tools=tools, use_tqdm=False)[0]
    assert out.prompt.startswith("[tool get_weather]<|user|>weather?")
    assert "<call get_weather Paris>" in out.prompt and "<|tool|>sunny" in out.prompt


@pytest.mark.parametrize("vocab", [64, 1000, 49152, 50001])
def test_native_bitmask_masks_exactly_what_xgrammar_masks(vocab):
    """The native AVX2 bitmask kernel against xgrammar's own CPU kernel: every kind of word (all
    allowed, none, random bits), a vocabulary that ends mid-word, a padded logits row, a subset
    of the rows."""
    import torch
    import xgrammar as xgr

    from kvserve.kernels.cpu import native

    if not native.available():
        pytest.skip(f"native CPU kernels: {native.status()}")
    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    mask = torch.randint(-2**31, 2**31 - 1, (6, words), dtype=torch.int32, generator=gen)
    mask[0] = -1  # every token allowed
    mask[1] = 0  # none
    mask[2, ::2] = -1
    logits = torch.randn(6, vocab + 7, generator=gen)  # LM head wider than the vocabulary
    rows = [0, 1, 2, 4, 5]
    expected, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(expected, mask, vocab_size=vocab, indices=rows)
    native.apply_token_bitmask(got, mask, rows, vocab)
    assert torch.equal(got, expected)
    assert torch.equal(got[3], logits[3])  # a row not listed is untouched
    with pytest.raises(ValueError, match="rows"):
        native.apply_token_bitmask(got, mask, [6], vocab)
