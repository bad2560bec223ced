"""Every feature at tensor_parallel_size 2: greedy output equals tensor_parallel_size 1.

Real worker processes and real gloo collectives on CPU, tiny random-weight models. Each case runs
one workload on a tp=1 engine and a tp=2 engine built from the same options, checks the feature
really ran at tp=2 (drafts verified, prefix hits, KV groups, ...) and compares every token. The
tp=2 path runs the same Worker on both ranks, so a case failing here means a feature that reads
or writes something only rank 0 has.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvserve.runtime import LLM, SamplingParams, StructuredOutputsParams

BLOCK_SIZE = 4
BASE = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_kv_blocks=96, max_model_len=256,
            max_num_batched_tokens=32, seed=0)


def _random_prompts(seed: int, vocab: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _greedy(max_tokens, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw) for n in max_tokens]


def _mixed():
    return _random_prompts(1, 512, (5, 17, 40, 3, 29)), _greedy((12, 7, 10, 14, 5))


def _shared_prefixes():
    prefix = _random_prompts(2, 512, (21,))[0]  # 5 full blocks and a partial one
    tails = _random_prompts(3, 512, (2, 1, 5, 0))
    prompts = [prefix + t for t in tails] + _random_prompts(4, 512, (6,))
    params = _greedy((8, 6, 9, 7, 5))
    params[1] = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)  # a fork: copy-on-write
    return prompts, params


def _long_prompts():
    return _random_prompts(5, 512, (45, 23, 60, 9)), _greedy((8, 10, 6, 12))


def _grounded():
    """Prompts that repeat themselves, so n-gram lookup finds proposals."""
    rng = random.Random(6)
    prompts = []
    for n in (5, 7, 4, 9):
        base = [rng.randrange(3, 512) for _ in range(n)]
        prompts.append((base * 5)[: 4 * n])
    return prompts, _greedy((16, 12, 20, 10))


def _structured():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"]}
    kinds = [dict(json=schema), dict(regex=r"[0-9]{2}-[a-z]{2,3}"), dict(choice=["alpha", "beta", "gamma"])]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(**k))
              for k in kinds]
    return ["Hello world", "The cat sat", "One two three"], params


def _spec_ran(llm: LLM) -> None:
    assert llm.engine.get_stats().spec_decode_num_drafts_total > 0


def _accepted(llm: LLM) -> None:
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens_total > 0


def _prefix_hit(llm: LLM) -> None:
    assert llm.engine.get_stats().prefix_cache_hits_total > 0


def _kv_groups(llm: LLM) -> None:
    assert llm.engine.executor.kv_groups is not None and len(llm.engine.executor.kv_groups) == 2


def _fp8_pools(llm: LLM) -> None:
    import torch

    assert llm.engine.executor.kv_caches[0][0].dtype == torch.float8_e4m3fn


def _overlapped(llm: LLM) -> None:
    assert llm.engine.executor.supports_overlap and llm.engine.config.async_scheduling


@dataclass
class Case:
    arch: str = "llama"
    model: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    workload: Callable = _mixed
    ran: Callable[[LLM], None] | None = None  # checks, at tp=2, that the feature was really used
    warm: bool = False  # run the workload once first (prefix caching: the second run hits)
    draft: dict[str, Any] | None = None  # a draft model: tiny_model_factory(**draft)
    medusa: bool = False  # Medusa heads built on the model (its own lm_head per head) as the spec model
    eagle3: bool = False  # a random EAGLE-3 head (reads two of the model's layers) as the spec model
    eagle_copy: bool = False  # an EAGLE head that guesses the target's token again (drafts accepted)
    mtp: bool = False  # the model gets a random MTP layer (DeepSeek-V3's layout) in its checkpoint
    mtp_copy: bool = False  # ... a copying one instead (drafts, and tree branches, get accepted)
    exact: bool = True  # False: the same tokens up to the first near-tie, the same logprobs


CASES = {
    "prefix-caching": Case(engine=dict(enable_prefix_caching=True), workload=_shared_prefixes, ran=_prefix_hit,
                           warm=True),
    "chunked-prefill": Case(engine=dict(max_num_batched_tokens=8, enable_chunked_prefill=True),
                            workload=_long_prompts),
    "ngram-spec-decode": Case(engine=dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_max": 3}),
                              workload=_grounded, ran=_spec_ran),
    "draft-spec-decode": Case(engine=dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 2}),
                              draft=dict(arch="llama", num_hidden_layers=1, seed=1), workload=_grounded,
                              ran=_spec_ran),
    # The heads run on rank 0 from the hidden states behind its logits rows.
    "medusa-spec-decode": Case(engine=dict(speculative_config={"method": "medusa", "num_speculative_tokens": 3}),
                               medusa=True, workload=_grounded, ran=_spec_ran),
    # A Medusa tree: rank 0 moves each accepted path's K/V into place at once, rank 1 before its
    # next step (ForwardInput.kv_slot_moves); a rank that missed one would diverge.
    "medusa-tree-spec-decode": Case(engine=dict(speculative_config={
        "method": "medusa", "speculative_token_tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}),
        medusa=True, workload=_grounded, ran=_spec_ran),
    # EAGLE-3 on rank 0 reads layers' residual streams there (the other ranks keep the fast path).
    "eagle3-spec-decode": Case(engine=dict(speculative_config={"method": "eagle3", "num_speculative_tokens": 3}),
                               eagle3=True, workload=_grounded, ran=_spec_ran),
    # EAGLE tree drafting: accepted branches off the top-1 chain move K/V on every rank.
    "eagle-tree-spec-decode": Case(engine=dict(speculative_config={
        "method": "eagle", "speculative_token_tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}),
        eagle_copy=True, workload=_grounded, ran=_spec_ran),
    # The MTP layer runs unsharded on rank 0, with its own copies of the embedding and head.
    "mtp-spec-decode": Case(arch="deepseek_v3", engine=dict(speculative_config={"method": "mtp",
                                                                                "num_speculative_tokens": 2}),
                            mtp=True, workload=_grounded, ran=_spec_ran),
    # MTP tree drafting on rank 0; the verified tree's accepted path moves K/V on every rank.
    "mtp-tree-spec-decode": Case(arch="deepseek_v3", engine=dict(speculative_config={
        "method": "mtp", "speculative_token_tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}),
        mtp=True, mtp_copy=True, workload=_grounded, ran=_accepted),
    "structured-outputs": Case(model=dict(vocab_size=640), workload=_structured),
    # Gemma 2 alternates local (window 8) and global layers: two KV cache groups, two block tables.
    "hybrid-kv-groups": Case(arch="gemma2", model=dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5),
                             workload=_long_prompts, ran=_kv_groups),
    "fp8-kv-cache": Case(engine=dict(kv_cache_dtype="fp8"), ran=_fp8_pools),
    # int4 groups never straddle a shard, so each rank's quantized shard is bit for bit tp=1's.
    "int4-weights": Case(model=dict(hidden_size=256, intermediate_size=512), engine=dict(quantization="int4")),
    # int8 scales are per output row: a row-parallel shard (o_proj, down_proj) takes the absmax of
    # its half row, so tp=2 quantizes a little differently and only near-ties may flip.
    "int8-weights": Case(model=dict(hidden_size=128, intermediate_size=256), engine=dict(quantization="int8"),
                         workload=lambda: (_mixed()[0], _greedy((12, 7, 10, 14, 5), logprobs=2)),
                         exact=False),
    "moe": Case(arch="qwen2_moe"),
    "mla": Case(arch="deepseek_v3"),
    "async-scheduling": Case(engine=dict(async_scheduling=True), ran=_overlapped),
}
SLOW = {"draft-spec-decode", "structured-outputs", "hybrid-kv-groups", "int4-weights"}


def _run(model_dir, case: Case, draft_dir, tp: int):
    kw = {**BASE, **case.engine}
    if draft_dir is not None:
        kw["speculative_config"] = {**kw["speculative_config"], "model": str(draft_dir)}
    prompts, params = case.workload()
    with LLM(str(model_dir), tensor_parallel_size=tp, **kw) as llm:
        if case.warm:
            llm.generate(prompts, params, use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        if tp == 2 and case.ran is not None:
            case.ran(llm)
        assert llm.engine.block_manager.num_used_blocks == 0 or case.warm
    if not case.exact:
        return [c.logprobs for o in outs for c in o.outputs]
    return [[(list(c.token_ids), c.text, c.finish_reason) for c in o.outputs] for o in outs]


def _assert_close_until_a_near_tie(want, got, tie: float = 0.05, atol: float = 0.05) -> None:
    """Per output, token by token: the chosen token's logprob agrees within `atol` and the tokens
    are equal, until tp=1's best two tokens are within `tie` of each other (then either may win
    and the continuations may part). At least half of all positions must be compared."""
    compared = total = 0
    for w_steps, g_steps in zip(want, got, strict=True):
        total += len(w_steps)
        for w, g in zip(w_steps, g_steps):
            best = sorted(w.values(), key=lambda lp: -lp.logprob)
            if len(best) > 1 and best[0].logprob - best[1].logprob < tie:
                break
            (w_token,) = [t for t, lp in w.items() if lp.rank == 1]
            assert w_token in g and g[w_token].rank == 1, (w, g)
            assert abs(g[w_token].logprob - w[w_token].logprob) < atol, (w, g)
            compared += 1
    assert compared >= total // 2, (compared, total)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_tp2_matches_tp1(tiny_model_factory, name):
    case = CASES[name]
    model_dir = tiny_model_factory(case.arch, **case.model)
    draft_dir = None
    if case.draft is not None:
        draft = dict(case.draft)
        draft_dir = tiny_model_factory(draft.pop("arch"), **draft)
    if case.medusa:
        from test_medusa import target_copy_heads

        from kvserve.runtime.spec_decode.medusa import save_medusa_heads

        draft_dir = save_medusa_heads(target_copy_heads(model_dir), model_dir.parent / f"{model_dir.name}-medusa")
    if case.eagle3:
        from test_eagle import base_config, random_head

        from kvserve.runtime.spec_decode.eagle import save_eagle_head

        draft_dir = save_eagle_head(random_head(True, draft_vocab=200), model_dir.parent / f"{model_dir.name}-eagle3",
                                    base_config=base_config(), aux_layers=(1, 2, 2))
    if case.eagle_copy:
        from test_eagle import base_config, target_copy_head

        from kvserve.runtime.spec_decode.eagle import save_eagle_head

        draft_dir = save_eagle_head(target_copy_head(), model_dir.parent / f"{model_dir.name}-eagle-copy",
                                    base_config=base_config())
    if case.mtp:
        from test_mtp import add_mtp_layer

        mtp_dir = model_dir.parent / f"{model_dir.name}-mtp{'-copy' if case.mtp_copy else ''}"
        model_dir = mtp_dir if mtp_dir.is_dir() else add_mtp_layer(model_dir, mtp_dir, copy=case.mtp_copy)
    want = _run(model_dir, case, draft_dir, 1)
    got = _run(model_dir, case, draft_dir, 2)
    if case.exact:
        assert got == want
    else:
        _assert_close_until_a_near_tie(want, got)


def _twin_graphs(self, *, max_model_len):
    """Worker.compile_and_capture building the CPU twin of CUDA graphs (padded static buffers,
    run eagerly)."""
    self.graphs = self.build_graphs([1, 2, 4, 8], max_model_len=max_model_len, capture=False)


# The same, in the worker processes (sitecustomize runs at their start).
_TWIN_GRAPHS = '''
from kvserve.runtime.executor.worker import Worker
def compile_and_capture(self, *, max_model_len):
    self.graphs = self.build_graphs([1, 2, 4, 8], max_model_len=max_model_len, capture=False)
Worker.compile_and_capture = compile_and_capture
'''


def test_tp2_decode_graphs_replay_in_step_on_every_rank(tiny_model_factory, tmp_path, monkeypatch):
    """CUDA graphs at tp=2, through their CPU twin on both ranks (installed in the worker process
    through sitecustomize): a replayed step pads to its bucket, so its all-reduces have the
    bucket's shape; a rank taking the other path would mismatch the collective. Equal tokens
    mean every rank chose the same path for every step."""
    from kvserve.runtime.executor.worker import Worker

    (tmp_path / "sitecustomize.py").write_text(_TWIN_GRAPHS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(Worker, "compile_and_capture", _twin_graphs)
    model_dir = tiny_model_factory("llama")
    prompts, params = _mixed()
    kw = {**BASE, "max_num_seqs": 8}
    with LLM(str(model_dir), **kw, enforce_eager=True) as llm:
        llm.engine.executor.driver_worker.graphs = None
        want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(model_dir), tensor_parallel_size=2, **kw) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.executor.driver_worker.graphs.replays > 0
    assert got == want
