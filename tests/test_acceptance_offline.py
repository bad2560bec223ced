"""Acceptance regressions for the offline API: bad values raise a ValueError naming the field."""

from __future__ import annotations

import os
import shutil

import pytest

from kvserve.runtime import SamplingParams


@pytest.mark.parametrize("fields, field", [
    (dict(stop=5), "stop"),
    (dict(stop=True), "stop"),
    (dict(seed=2**64), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-2**63 - 1), "seed"),
])
def test_bad_value_names_the_field(fields, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**fields)


def test_edge_values_still_accepted():
    assert SamplingParams(seed=2**63 - 1, n=16).seed == 2**63 - 1
    assert SamplingParams(seed=-2**63).seed == -2**63
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop="a").stop == ["a"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from kvserve.runtime import LLM
    with LLM(model=str(tiny_llama), num_kv_blocks=32) as engine:
        yield engine


@pytest.mark.parametrize("prompts", [None, 5, b"hi"])
def test_generate_non_prompt_is_value_error(llm, prompts):
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.parametrize("messages", ["hi", ["hi"], [[{"role": "user", "content": "a"}], "b"]])
def test_chat_non_message_list_is_value_error(llm, messages):
    with pytest.raises(ValueError, match="^messages:"):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)


def test_rejected_batch_leaves_nothing_and_counts_no_abort(llm):
    aborts = llm.engine.get_stats().request_success_total.get("abort", 0)
    with pytest.raises(ValueError, match="^prompt_token_ids:"):
        llm.generate(["ok", "fine", [5, 10**6]], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.request_success_total.get("abort", 0) == aborts
    assert not llm.engine.has_unfinished_requests()


def test_engine_clean_after_refusals(llm):
    stats = llm.engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("damage, needle", [
    (lambda d: (d / "config.json").write_text("{bad"), "config.json is not readable JSON"),
    (lambda d: (d / "generation_config.json").write_text("[1]"), "generation_config.json must hold a JSON object"),
    (lambda d: (d / "tokenizer.json").unlink(), "no usable tokenizer"),
    (lambda d: os.truncate(d / "model.safetensors", 1000), "model.safetensors is not a readable safetensors file"),
])
def test_damaged_model_dir_is_value_error_naming_the_file(tiny_llama, tmp_path, damage, needle):
    from kvserve.runtime import LLM

    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    damage(model)
    with pytest.raises(ValueError, match=f"^model: .*{needle}"):
        LLM(model=str(model))


@pytest.mark.parametrize("messages, template", [
    ([{"role": "user"}], "{{ messages[0].content.upper() }}"),
    ([{"role": "user", "content": "hi"}], "{{ 1/0 }}"),
])
def test_chat_template_failure_is_value_error(llm, messages, template):
    with pytest.raises(ValueError, match="^messages: the chat template rejected them"):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=template)


def test_missing_draft_model_error_names_speculative_config(tiny_llama, tmp_path):
    from kvserve.runtime import LLM

    with pytest.raises(ValueError, match="^speculative_config.model: no config.json"):
        LLM(model=str(tiny_llama), speculative_config={"method": "draft_model", "model": str(tmp_path),
                                                       "num_speculative_tokens": 2})
