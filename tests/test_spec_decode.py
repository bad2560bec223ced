"""Speculative decoding: config, proposers, the rejection sampler's exactness, and the engine.

Exactness is checked two ways: the rejection sampler on synthetic distributions (chi-square over
many draws against the target), and the whole engine with a draft model against the target's
own probabilities (read from the non-speculative engine's logprobs). Greedy output must equal
non-speculative greedy output token for token, inside continuous batching.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from kvserve.runtime import LLMEngine, SamplingParams
from kvserve.runtime.spec_decode import SpeculativeConfig, greedy_verify, ngram_propose, rejection_sample


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """P-value of Pearson's chi-square test; cells expecting < 5 are pooled into one."""
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for o, e in zip(observed, expected):
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            obs.append(o)
            exp.append(e)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# -- config and proposers --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "beam", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
         "prompt_lookup_min"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
        ("{not json", "speculative_config"),
    ],
)
def test_config_errors_name_the_key(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(value)


def test_config_from_json_and_model_implies_draft():
    c = SpeculativeConfig.parse('{"model": "/m", "num_speculative_tokens": 3}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/m", 3)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 2)


@pytest.mark.parametrize(
    "tokens, k, lo, hi, want",
    [
        ([1, 2, 3, 9, 1, 2], 3, 1, 4, [3, 9, 1]),  # tail "1 2" seen before: what followed it
        ([1, 2, 3, 1, 2, 4, 1, 2], 2, 1, 4, [4, 1]),  # the latest match wins
        ([5, 1, 2, 7, 3, 1, 2], 2, 2, 4, [7, 3]),
        ([1, 2, 3, 4], 2, 1, 4, []),  # no repeat
        ([7, 7, 7], 4, 1, 4, [7]),  # what follows the latest earlier "7 7"
        ([4, 5, 6, 4, 5], 1, 3, 3, []),  # needs a 3-gram
        ([9], 2, 1, 4, []),
    ],
)
def test_ngram_propose(tokens, k, lo, hi, want):
    assert ngram_propose(tokens, k, lo, hi) == want


def test_ngram_propose_matches_its_definition_on_random_contexts():
    """Brute force: for n from hi down to lo, the latest window before the tail equal to the
    last n tokens, and the k tokens after it."""
    def brute(tokens, k, lo, hi):
        num = len(tokens)
        for n in range(min(hi, num - 1), lo - 1, -1):
            for w in range(num - 1 - n, -1, -1):
                if k >= 1 and tokens[w:w + n] == tokens[num - n:]:
                    return tokens[w + n:w + n + k]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 8])) for _ in range(rng.randrange(1, 40))]
        k, lo = rng.randrange(0, 6), rng.randrange(1, 5)
        hi = rng.randrange(lo, 6)
        assert ngram_propose(tokens, k, lo, hi) == brute(tokens, k, lo, hi), (tokens, k, lo, hi)


@pytest.mark.parametrize("argmax, drafts, want", [
    ([4, 5, 6], [4, 5], [4, 5, 6]), ([4, 5, 6], [4, 9], [4, 5]), ([4, 5, 6], [1, 5], [4]), ([3], [], [3]),
])
def test_greedy_verify(argmax, drafts, want):
    assert greedy_verify(argmax, drafts) == want


# -- rejection sampler: exact target distribution -----------------------------------------------------
def _random_dist(gen, vocab, sharp=2.0):
    return torch.softmax(sharp * torch.randn(vocab, generator=gen), dim=0)


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "ngram_one_hot"])
def test_rejection_sampler_output_follows_the_target(one_hot):
    """Per position, the token coming out has the target's distribution (draft tokens drawn from
    q, or fixed as an n-gram proposer would give them), whatever the draft."""
    vocab, k, trials = 6, 2, 6000
    gen = torch.Generator().manual_seed(0)
    target = torch.stack([_random_dist(gen, vocab) for _ in range(k + 1)])
    draft = torch.stack([_random_dist(gen, vocab) for _ in range(k)])
    draft[0, 0] = draft[0, 0] + 3.0  # over-proposes token 0: the residual has to correct for it
    draft = draft / draft.sum(dim=1, keepdim=True)
    first, second = Counter(), Counter()
    lengths = Counter()
    for _ in range(trials):
        if one_hot:
            drafts = [0, 1]
            out = rejection_sample(target, drafts, None, gen)
        else:
            drafts = [int(torch.multinomial(draft[j], 1, generator=gen)) for j in range(k)]
            out = rejection_sample(target, drafts, draft, gen)
        assert 1 <= len(out) <= k + 1 and out[:-1] == drafts[:len(out) - 1]
        lengths[len(out)] += 1
        first[out[0]] += 1
        if len(out) >= 2:
            second[out[1]] += 1
    p1 = chi_square_p([first[t] for t in range(vocab)], [trials * float(p) for p in target[0]])
    n2 = sum(second.values())
    p2 = chi_square_p([second[t] for t in range(vocab)], [n2 * float(p) for p in target[1]])
    assert p1 > 1e-3 and p2 > 1e-3, (p1, p2)
    # Acceptance of the first draft is sum_x min(p, q) (one-hot: p(d)).
    accept = float(target[0, 0]) if one_hot else float(torch.minimum(target[0], draft[0]).sum())
    observed = 1 - lengths[1] / trials
    assert abs(observed - accept) < 4 * math.sqrt(accept * (1 - accept) / trials) + 1e-9


def test_rejection_sampler_identical_draft_accepts_everything():
    gen = torch.Generator().manual_seed(1)
    p = torch.stack([_random_dist(gen, 8) for _ in range(4)])
    for _ in range(50):
        drafts = [int(torch.multinomial(p[j], 1, generator=gen)) for j in range(3)]
        out = rejection_sample(p, drafts, p[:3], gen)
        assert out[:3] == drafts and len(out) == 4


# -- engine ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_dir(tiny_model_factory):
    """A smaller draft (1 layer, its own weights) with the target's tokenizer."""
    return tiny_model_factory("llama", num_hidden_layers=1, seed=1)


def make_engine(model, spec=None, **kw):
    opts = dict(block_size=4, num_kv_blocks=160, max_model_len=256, max_num_batched_tokens=40)
    opts.update(kw)
    return LLMEngine.from_args(model=str(model), speculative_config=spec, **opts)


def grounded_prompts(seed=0, n=8):
    """Prompts that repeat themselves (input-grounded), so n-gram lookup finds proposals."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(3, 512) for _ in range(rng.randrange(4, 12))]
        out.append((base * 4)[: rng.randrange(10, 40)] if i % 4 else [rng.randrange(3, 512) for _ in range(9)])
    return out


def run_checked(engine, prompts, params, arrive_every=2):
    """Continuous batching: requests arrive while others decode. After every step, no running
    sequence holds a block past its tokens (rejected drafts were rolled back)."""
    bm = engine.block_manager
    pending = list(enumerate(prompts))
    final = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % arrive_every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        for seq in engine.scheduler.running:
            assert len(bm.get_block_table(seq.seq_id)) <= bm.blocks_for_tokens(seq.num_tokens)
            assert not seq.spec_token_ids
        bm.check_invariants()
        assert steps < 3000
    assert bm.num_used_blocks == 0 and not bm.block_tables
    return final


def record_accepted_paths(engine) -> list:
    """Every accepted tree path the engine moves K/V for (a list that fills as it runs): tests of
    tree drafting check that some leave the top-1 chain."""
    spec, seen = engine.spec_decoder, []
    real = spec._move_paths

    def spy(scheduled, block_tables, paths):
        seen.extend(paths.values())
        real(scheduled, block_tables, paths)

    spec._move_paths = spy
    return seen


def assert_tree_nodes_are_forced_chains(prop, tree, fills, nodes, *, argmax: str, pick_rank) -> None:
    """Each tree node a proposer drafted (`nodes`, per sequence) equals the last draft of its chain
    drafter forced down the node's path: the chain's j-th guess is the node's j-th rank
    (`pick_rank(logits, r)`, r > 0, replaces the proposer's `argmax` method); and the tree's top-1
    chain is exactly the chain drafter's output."""
    real = getattr(prop, argmax)
    for node, choice in enumerate(tree.choices, 1):
        ranks = iter(choice)

        def forced(out, ranks=ranks):
            r = next(ranks)
            return pick_rank(out, r) if r else real(out)

        setattr(prop, argmax, forced)
        try:
            chain = prop.step(fills, [len(choice)] * len(fills))
        finally:
            setattr(prop, argmax, real)
        for s in range(len(fills)):
            assert chain[s][-1] == nodes[s][node - 1], (s, choice)
    depth = max(len(c) for c in tree.choices)
    assert [tree.chain_tokens(x) for x in nodes] == prop.step(fills, [depth] * len(fills))


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama):
    outs = run_checked(make_engine(tiny_llama), grounded_prompts(), GREEDY)
    return {k: v.outputs[0].token_ids for k, v in outs.items()}


@pytest.mark.parametrize("kind", ["ngram", "draft", "draft_is_target"])
def test_greedy_equals_non_speculative_greedy(tiny_llama, draft_dir, greedy_reference, kind):
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
            "draft": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3},
            "draft_is_target": {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3},
            }[kind]
    # Small pool: preemption and prefix-cache hits happen along the way.
    engine = make_engine(tiny_llama, spec, num_kv_blocks=48)
    outs = run_checked(engine, grounded_prompts(), GREEDY)
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == greedy_reference
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total > 0
    assert s.spec_decode_num_accepted_tokens_total <= s.spec_decode_num_draft_tokens_total
    if kind == "ngram":
        assert s.spec_decode_num_accepted_tokens_total > 0
    if kind == "draft_is_target":
        assert s.spec_decode_num_accepted_tokens_total == s.spec_decode_num_draft_tokens_total


def test_sampling_with_a_draft_matches_the_target_distribution(tiny_llama, draft_dir):
    """(t0, t1) over 1500 seeded requests: t1 goes through draft + verification; its joint law
    with t0 must be the target's p(t0) p(t1 | t0), computed from the target's own logprobs."""
    prompt = [17, 42, 99, 7, 256, 31]
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    ref = make_engine(tiny_llama)

    def top4(ids):
        ref.add_request("q", ids, SamplingParams(temperature=0, max_tokens=1, logprobs=4))
        out = None
        while ref.has_unfinished_requests():
            out = ref.step() or out
        entry = out[0].outputs[0].logprobs[0]
        best = sorted(entry.items(), key=lambda kv: kv[1].rank or 99)[:4]
        z = sum(math.exp(lp.logprob) for _, lp in best)
        return {t: math.exp(lp.logprob) / z for t, lp in best}

    p0 = top4(prompt)
    joint = {(a, b): pa * pb for a, pa in p0.items() for b, pb in top4(prompt + [a]).items()}

    n = 1500
    engine = make_engine(tiny_llama, {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2},
                         num_kv_blocks=1200, max_num_batched_tokens=2048, max_num_seqs=512)
    for i in range(n):
        engine.add_request(f"s{i}", prompt, params.clone(seed=i))
    counts: Counter = Counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                counts[tuple(out.outputs[0].token_ids[:2])] += 1
    s = engine.get_stats()
    assert s.spec_decode_num_drafts_total >= n and s.spec_decode_num_accepted_tokens_total > 0
    cells = sorted(joint)
    assert sum(counts[c] for c in cells) == n  # nothing outside the target's support
    p = chi_square_p([counts[c] for c in cells], [n * joint[c] for c in cells])
    assert p > 1e-3, p


def test_spec_with_n_and_prefix_caching_leaks_nothing(tiny_llama):
    engine = make_engine(tiny_llama, {"method": "ngram", "num_speculative_tokens": 3}, num_kv_blocks=40)
    params = SamplingParams(n=3, temperature=0.7, seed=4, max_tokens=20, stop_token_ids=[2])
    outs = run_checked(engine, grounded_prompts(seed=5, n=6), params)
    assert all(len(o.outputs) == 3 for o in outs.values())


def test_ineligible_requests_decode_normally(tiny_llama):
    """Penalties and logprobs need the plain sampler: such requests get no drafts."""
    engine = make_engine(tiny_llama, {"method": "ngram", "num_speculative_tokens": 3})
    prompt = grounded_prompts()[1]
    run_checked(engine, [prompt], SamplingParams(temperature=0, max_tokens=10, logprobs=1, repetition_penalty=1.2))
    assert engine.get_stats().spec_decode_num_drafts_total == 0


def test_bad_draft_model_is_refused(tiny_llama, tiny_model_factory):
    other_vocab = tiny_model_factory("llama", vocab_size=600)
    with pytest.raises(ValueError, match="speculative_config.model"):
        make_engine(tiny_llama, {"method": "draft_model", "model": str(other_vocab), "num_speculative_tokens": 2})


# -- scheduler with drafts -----------------------------------------------------------------------------
def _two_decoding(num_blocks):
    """a: 7 tokens (6 computed, 2 blocks of 4); b: 4 tokens (3 computed, 1 block); budget 6."""
    from kvserve.runtime.engine.block_manager import BlockManager
    from kvserve.runtime.engine.scheduler import Scheduler, SchedulerConfig
    from kvserve.runtime.engine.sequence import Sequence

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64),
                      BlockManager(num_blocks, 4))
    a, b = Sequence("a", [1, 2, 3, 4, 5], 8), Sequence("b", [6, 7, 8], 8)
    sched.add(a)
    sched.add(b)
    for _ in range(2):  # a: prompt then one decode; b: its prompt in two chunks
        out = sched.schedule()
        sched.on_step_done(out)
        for item in out.scheduled:
            if item.samples:
                item.seq.append_token(9)
    assert (a.num_tokens, a.num_computed_tokens, b.num_tokens, b.num_computed_tokens) == (7, 6, 4, 3)
    return sched, a, b


def test_scheduler_runs_1_plus_k_and_trims_drafts_to_the_budget():
    sched, a, b = _two_decoding(num_blocks=8)
    a.spec_token_ids = [1, 2, 3, 4, 5, 6]
    out = sched.schedule()
    item = out.scheduled[0]
    assert (item.seq, item.num_new_tokens, item.num_spec, item.samples) == (a, 6, 5, True)
    assert a.spec_token_ids == [1, 2, 3, 4, 5] and len(out.scheduled) == 1  # budget spent on a
    sched.on_step_done(out)
    a.num_computed_tokens = a.num_tokens - 1  # the engine's rollback when nothing is accepted
    sched.block_manager.truncate(a.seq_id, a.num_tokens)
    assert len(sched.block_manager.get_block_table(a.seq_id)) == 2
    sched.block_manager.check_invariants()


def test_scheduler_drops_drafts_before_preempting_anyone():
    sched, a, b = _two_decoding(num_blocks=3)  # every block in use: drafts for a need a new one
    a.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert not out.preempted and [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 1), (b, 1)]
    assert a.spec_token_ids == []
    sched.block_manager.check_invariants()


def test_draft_pools_share_the_kv_budget(tiny_llama, draft_dir):
    budget = 1 << 20
    plain = LLMEngine.from_args(model=str(tiny_llama), kv_cache_memory_bytes=budget, max_model_len=256)
    spec = LLMEngine.from_args(model=str(tiny_llama), kv_cache_memory_bytes=budget, max_model_len=256,
                               speculative_config={"method": "draft_model", "model": str(draft_dir),
                                                   "num_speculative_tokens": 2})
    pool_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in spec.kv_caches + spec.spec_decoder.draft_kv)
    assert pool_bytes <= budget
    # target 2 layers, draft 1 layer of the same width: two thirds of the blocks
    assert spec.num_kv_blocks == plain.num_kv_blocks * 2 // 3
    assert len(spec.spec_decoder.draft_kv[0][0]) == spec.num_kv_blocks


def test_greedy_speculation_on_the_triton_kernels_equals_torch(tiny_llama, monkeypatch):
    """The GPU path's kernels (interpreted on CPU) verify k + 1 positions over a cached context."""
    pytest.importorskip("triton")
    from kvserve.kernels import ops

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = random.Random(0)
    base = [rng.randrange(3, 512) for _ in range(6)]
    prompts = [base * 3, [rng.randrange(3, 512) for _ in range(9)], base * 2 + base[:3]]
    kw = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=12, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with ops.kernel_mode("torch"):
        want = run_checked(make_engine(tiny_llama, attention_backend="torch", **kw), prompts, params)
    with ops.kernel_mode("triton"):
        engine = make_engine(tiny_llama, {"method": "draft_model", "model": str(tiny_llama),
                                          "num_speculative_tokens": 2}, attention_backend="triton", **kw)
        got = run_checked(engine, prompts, params)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in want.items()}
    assert engine.get_stats().spec_decode_num_accepted_tokens_total > 0
