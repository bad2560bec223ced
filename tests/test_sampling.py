"""Sampling: seeds reproducible whatever the batch, top_k=1 is greedy, stops, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.sampler import Sampler, SamplingRow


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), block_size=4, num_kv_blocks=128, max_num_batched_tokens=64)


PROMPT = {"prompt_token_ids": [17, 250, 33, 98, 4, 400, 77]}


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_same_seed_same_output_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    alone = tokens(llm, [PROMPT], seeded)[0]
    others = [{"prompt_token_ids": [5 + i] * (3 + 7 * i)} for i in range(6)]
    noisy = [SamplingParams(temperature=1.3, max_tokens=5 + 3 * i, top_k=50) for i in range(6)]
    mixed = tokens(llm, others[:3] + [PROMPT] + others[3:], noisy[:3] + [seeded] + noisy[3:])
    assert mixed[3] == alone
    assert tokens(llm, [PROMPT, PROMPT], [seeded, seeded]) == [alone, alone]
    other_seed = tokens(llm, [PROMPT], seeded.clone(seed=99))[0]
    assert other_seed != alone  # the seed does matter (16 draws at temperature 1)


def test_top_k_1_equals_greedy(llm):
    greedy = tokens(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
    top1 = tokens(llm, [PROMPT], SamplingParams(temperature=0.9, top_k=1, max_tokens=12))[0]
    assert top1 == greedy


def test_stop_strings_are_excluded_and_stop_tokens_end_the_request(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    # a stop string starting a few characters in, made of complete characters
    start = next(i for i in range(3, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    idx = text.index(stop)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:idx] and out.finish_reason == "stop" and out.stop_reason == stop
    assert base.token_ids[: len(out.token_ids)] == out.token_ids
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                                                include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[: idx + len(stop)]

    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_min_tokens_holds_back_eos(llm):
    eos = 2
    banned = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, stop_token_ids=[eos])
    row = SamplingRow(banned, [1, 2, 3], 3, None, [eos])
    logits = torch.zeros(1, 512)
    logits[0, eos] = 10.0
    assert Sampler()(logits, [row]).token_ids[0] != eos
    row.params = SamplingParams(temperature=0, max_tokens=8)
    assert Sampler()(logits, [row]).token_ids[0] == eos


def test_penalties_match_definitions():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    history = [4, 7, 7, 9, 30, 30, 30]  # prompt = first 2 tokens
    captured = {}

    class Capture(Sampler):
        def _sample(self, logits, rows):
            captured["logits"] = logits.clone()
            return super()._sample(logits, rows)

    def processed(params):
        rows = [SamplingRow(params, list(history), 2, None, []) for _ in range(3)]
        Capture()(logits.clone(), rows)
        return captured["logits"]  # divided by temperature 1.0: the penalized logits

    rep = processed(SamplingParams(temperature=1.0, repetition_penalty=1.7))
    ids = torch.tensor([history] * 3)
    assert torch.allclose(rep, RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone()))

    pf = processed(SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25))
    expected = logits.clone()
    for t, count in {7: 1, 9: 1, 30: 3}.items():  # output tokens only (after the 2 prompt ones)
        expected[:, t] -= 0.5 + 0.25 * count
    assert torch.allclose(pf, expected)


def test_top_p_and_min_p_masks():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    gen = torch.Generator().manual_seed(0)
    seen_top_p, seen_min_p = set(), set()
    for _ in range(200):
        row = SamplingRow(SamplingParams(temperature=1.0, top_p=0.75), [0], 1, gen, [])
        seen_top_p.add(Sampler()(logits, [row]).token_ids[0])
        row = SamplingRow(SamplingParams(temperature=1.0, min_p=0.35), [0], 1, gen, [])
        seen_min_p.add(Sampler()(logits, [row]).token_ids[0])
    assert seen_top_p == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert seen_min_p == {0, 1}  # tokens under 0.35 x 0.5 = 0.175 are cut


def test_logprobs_equal_log_softmax_of_transformers_logits(llm, tiny_llama):
    import transformers

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    ids = PROMPT["prompt_token_ids"] + out.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    n = len(PROMPT["prompt_token_ids"])
    cumulative = 0.0
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[n - 1 + i]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == 1  # greedy
        top = row.topk(3)
        assert set(entry) == set(top.indices.tolist())
        for v, t in zip(top.values.tolist(), top.indices.tolist()):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
            assert entry[t].decoded_token is not None
        cumulative += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(cumulative, abs=1e-4)
    assert not math.isnan(out.cumulative_logprob)


def test_sampling_on_the_last_pipeline_stage_is_rank_0s_draw():
    """runtime/executor/stage_sampling.py: the rows described, sampled elsewhere (through the wire
    format) and taken back give rank 0's tokens and logprobs, and leave each seeded generator
    where rank 0's draw would have."""
    from kvserve.runtime.executor import stage_sampling as ss

    vocab = 300
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    specs = [SamplingParams(temperature=0.9, top_p=0.9, seed=5, logprobs=3),
             SamplingParams(temperature=0.7, top_k=20, seed=6, presence_penalty=0.5, repetition_penalty=1.3,
                            min_tokens=4, n=2),
             SamplingParams(temperature=0, logprobs=0)]
    repeats = [1, 2, 1]

    def rows():
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in specs]
        out = [SamplingRow(specs[0], [1, 2, 3, 9], 3, gens[0]),
               SamplingRow(specs[1], [4, 4, 7, 8, 8], 3, gens[1], [0, 1]),
               SamplingRow(specs[1], [4, 4, 7, 8, 8], 3, torch.Generator().manual_seed(7), [0, 1]),
               SamplingRow(specs[2], [5], 1, None)]
        return out

    want_rows = rows()
    want = Sampler(torch.Generator())(logits.repeat_interleave(torch.tensor(repeats), dim=0), want_rows)
    got_rows = rows()
    shipped = ss.stage_rows(got_rows, repeats)
    sample = ss.decode(ss.encode(ss.sample_on_stage(logits.clone(), shipped, Sampler(torch.Generator()))))
    got = ss.take_stage_sample(sample, got_rows)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    for w, g in zip(want_rows, got_rows):
        if w.generator is not None:
            assert torch.equal(w.generator.get_state(), g.generator.get_state())
    # Only rows whose penalties or min_tokens read them carry their tokens.
    assert [len(r.token_ids) for r in shipped.rows] == [0, 5, 5, 0]
