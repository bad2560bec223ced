"""CUDA graphs for speculative verification steps (runtime/executor/verify_graphs.py, and
DecodeGraphs with query_len > 1): the policy's tables, the static buffers of uniform steps, and
the promise: greedy output with verification steps run on the padded static buffers (the CPU twin
of a replayed graph, ``capture=False``) equals the eager engine's, for an n-gram chain and a Medusa
tree. The `gpu` tests capture real graphs where a GPU exists.

On the CPU the engine normally runs a chain's verification rows as decode rows (ModelRunner's
verify_as_decode_rows); the twin tests turn that off on both sides, so the steps stay the
multi-token steps a GPU runs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_medusa import target_copy_heads  # noqa: E402  (tests/ is on sys.path via conftest)
from test_spec_decode import GREEDY, grounded_prompts, make_engine, run_checked  # noqa: E402

from kvserve.kernels.short_query_attention import uniform_query_len
from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.executor.cuda_graphs import DecodeGraphs
from kvserve.runtime.executor.verify_graphs import verify_capture_sizes, verify_query_lens
from kvserve.runtime.executor.verify_padding import pad_query_len, pad_step, padded_rows
from kvserve.runtime.spec_decode import SpeculativeConfig
from kvserve.runtime.spec_decode.medusa import save_medusa_heads

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]  # 10 nodes, chain depth 3

# ------------------------------------------------------------------------------------- policy


@pytest.mark.parametrize("spec, want", [
    (None, {}),
    ({"method": "ngram", "num_speculative_tokens": 3}, {4: False}),
    ({"method": "draft_model", "model": "/d", "num_speculative_tokens": 5}, {6: False}),
    ({"method": "medusa", "model": "/h", "num_speculative_tokens": 3}, {4: False}),
    ({"method": "medusa", "model": "/h", "speculative_token_tree": TREE}, {4: False, 10: True}),
    # The top-1 chain is only 2 deep: a sampled request verifies 1 + 2 rows.
    ({"method": "medusa", "model": "/h", "speculative_token_tree": [(0,), (1,), (0, 0), (1, 0), (1, 0, 0)]},
     {3: False, 6: True}),
    # A tree that is all top-1 chain verifies as a chain.
    ({"method": "medusa", "model": "/h", "speculative_token_tree": [(0,), (0, 0)]}, {3: False}),
])
def test_query_lengths_follow_the_speculative_config(spec, want):
    assert verify_query_lens(None if spec is None else SpeculativeConfig.parse(spec)) == want


def test_capture_sizes_keep_each_graph_within_max_capture_size_tokens():
    assert verify_capture_sizes([1, 2, 4, 8, 16, 24, 32], 4, 64) == [1, 2, 4, 8, 16]
    assert verify_capture_sizes([1, 2, 4], 10, 8) == []


@pytest.mark.parametrize("tokens, seqs, longest, want", [
    (8, 2, 4, 4), (4, 1, 4, 4), (7, 2, 4, None), (3, 3, 1, None), (0, 0, 0, None), (10, 2, 6, None),
])
def test_a_step_is_uniform_only_when_every_query_has_the_longest_length(tokens, seqs, longest, want):
    assert uniform_query_len(tokens, seqs, longest) == want


# ------------------------------------------------------------------------- padding short queries


@pytest.mark.parametrize("longest, seqs, tree_step, want", [
    (3, 2, False, 4), (1, 2, False, 4), (4, 8, False, 4),
    (4, 9, False, None),  # past the largest bucket
    (5, 2, False, 10),  # a chain longer than the chain family: the tree graph (chain masks) runs it
    (4, 2, True, 10),  # a tree step needs the masks
    (11, 1, False, None),
])
def test_a_short_step_pads_to_the_smallest_captured_query_length_that_holds_it(longest, seqs, tree_step, want):
    families = {4: (False, [1, 2, 4, 8]), 10: (True, [1, 2, 4])}
    assert pad_query_len(longest, seqs, tree_step, families) == want


@pytest.mark.parametrize("query_lens, seq_lens, want", [
    ([4, 1, 2], [10, 7, 20], [0, 1, 2, 3, 4, 8, 9]),
    ([1], [63], None),  # 3 dummy rows would pass max_model_len 64
    ([2], [62], [0, 1]),  # exactly at it
    ([5, 1], [10, 10], None),  # longer than q
])
def test_padded_rows_place_each_query_at_the_start_of_its_q_rows(query_lens, seq_lens, want):
    got = padded_rows(query_lens, seq_lens, 4, 64)
    assert (got is None and want is None) or got.tolist() == want


def _short_step(tree: bool, groups: bool):
    """Two sequences: 3 rows (a tree, with masks, or a chain) and 1 row (no drafts)."""
    from kvserve.runtime.executor.forward_input import ForwardInput

    masks = torch.tensor([1, 3, 5, 0]) if tree else None
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
                             seq_lens=torch.tensor([9, 5], dtype=torch.int32),
                             block_tables=torch.tensor([[3, 4, 0], [6, 0, 0]], dtype=torch.int32),
                             slot_mapping=torch.tensor([12, 13, 14, 20]), max_query_len=3, max_seq_len=9,
                             tree_masks=masks)
    if groups:
        meta = dataclasses.replace(meta, kv_groups={None: meta, 4: dataclasses.replace(
            meta, slot_mapping=torch.tensor([0, 1, 2, 7]))})
    positions = torch.tensor([6, 7, 7, 4]) if tree else torch.tensor([6, 7, 8, 4])
    return ForwardInput(torch.tensor([11, 12, 13, 21]), positions, meta, logits_rows=[0, 1, 2, 3])


@pytest.mark.parametrize("tree", [False, True])
def test_a_padded_step_adds_dummy_rows_that_write_nothing_behind_each_short_query(tree):
    step = _short_step(tree, groups=True)
    padded, keep = pad_step(step, 4, 64)
    assert keep.tolist() == [0, 1, 2, 4]
    assert padded.input_ids.tolist() == [11, 12, 13, 0, 21, 0, 0, 0]
    # real rows keep their positions (a tree's depths); dummy rows continue the sequence
    assert padded.positions.tolist() == [6, 7, 7 if tree else 8, 9, 4, 5, 6, 7]
    meta = padded.meta
    assert meta.slot_mapping.tolist() == [12, 13, 14, -1, 20, -1, -1, -1]
    assert meta.kv_groups[4].slot_mapping.tolist() == [0, 1, 2, -1, 7, -1, -1, -1]
    assert meta.seq_lens.tolist() == [10, 8] and meta.kv_groups[4].seq_lens.tolist() == [10, 8]
    assert meta.query_start_loc.tolist() == [0, 4, 8] and meta.max_query_len == 4 and meta.max_seq_len == 10
    assert uniform_query_len(8, meta.num_seqs, meta.max_query_len) == 4
    assert (meta.tree_masks is None) != tree and (not tree or meta.tree_masks.tolist() == [1, 3, 5, 0, 0, 0, 0, 0])
    assert padded.logits_rows == step.logits_rows  # the hidden states come back in the step's rows first
    assert step.meta.slot_mapping.tolist() == [12, 13, 14, 20]  # the step itself is untouched


def test_steps_that_cannot_pad_are_left_alone():
    step = _short_step(False, groups=False)
    assert pad_step(step, 4, 9) is None  # the first sequence would reach 9 + 1 > max_model_len 9
    assert pad_step(dataclasses.replace(step, lora=object()), 4, 64) is None
    assert pad_step(step, 2, 64) is None  # a 3-row query does not fit 2


# ------------------------------------------------------------------------------ static buffers


def _uniform_step(seqs: list[tuple[int, list[int]]], q: int, block_size: int, tree_masks=None):
    """(input_ids, positions, metadata) of a step of q rows per sequence: (context, block table) each."""
    n = len(seqs)
    width = max(len(t) for _, t in seqs)
    tables = torch.zeros(n, width, dtype=torch.int32)
    ids, pos, slots = [], [], []
    for i, (ctx, table) in enumerate(seqs):
        tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        for p in range(ctx, ctx + q):
            ids.append(100 + i * q + p - ctx)
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    meta = AttentionMetadata(query_start_loc=torch.arange(n + 1, dtype=torch.int32) * q,
                             seq_lens=torch.tensor([c + q for c, _ in seqs], dtype=torch.int32), block_tables=tables,
                             slot_mapping=torch.tensor(slots), max_query_len=q, max_seq_len=max(c for c, _ in seqs) + q,
                             tree_masks=tree_masks)
    return torch.tensor(ids), torch.tensor(pos), meta


@pytest.mark.parametrize("tree", [False, True])
def test_static_buffers_hold_uniform_steps_and_pad_the_rest(tree):
    """Rows of the step's sequences hold its data, the other sequences are dummies of q rows
    (token 0, no KV write, context q over block 0); a tree graph gives padding and chain rows the
    chain's masks (causal) and keeps a tree's own."""
    q, bs = 4, 4
    graphs = DecodeGraphs(None, [], block_size=bs, max_model_len=32, sizes=[1, 2, 4], device=torch.device("cpu"),
                          capture=False, query_len=q, tree=tree)
    chain = torch.tensor([1, 3, 7, 15])
    fork = torch.tensor([1, 3, 5, 11])  # root, two children, a grandchild under the first
    for seqs in ([(5, [2, 3, 4])] * 3, [(0, [6, 7])], [(9, [1, 2, 3, 8]), (2, [5, 6])]):
        s, n = len(seqs), len(seqs) * q
        masks = None
        if tree:  # the first sequence a tree, the others chains (masks 0)
            masks = torch.zeros(n, dtype=torch.long)
            masks[:q] = fork
        ids, pos, meta = _uniform_step(seqs, q, bs, masks)
        size = graphs.bucket(s)
        graphs.load(ids, pos, meta, size)
        assert torch.equal(graphs.input_ids[:n], ids) and torch.equal(graphs.positions[:n], pos)
        assert torch.equal(graphs.slot_mapping[:n], meta.slot_mapping)
        assert torch.equal(graphs.seq_lens[:s], meta.seq_lens)
        width = meta.block_tables.shape[1]
        assert torch.equal(graphs.block_tables[:s, :width], meta.block_tables)
        assert not graphs.block_tables[:s, width:].any()
        assert not graphs.input_ids[n:].any() and (graphs.slot_mapping[n:] == -1).all()
        assert (graphs.seq_lens[s:] == q).all() and not graphs.block_tables[s:].any()
        got = graphs.metadata(size)
        assert got.max_query_len == q and not got.is_decode_only and got.max_seq_len == 32
        assert got.slot_mapping.shape == (size * q,) and got.query_start_loc.tolist() == list(range(0, size * q + 1, q))
        assert got.all_trees == tree and (got.tree_masks is None) != tree
        if tree:
            assert torch.equal(graphs.tree_masks[:q], fork)
            assert torch.equal(graphs.tree_masks[q:], chain.repeat(len(graphs.tree_masks) // q - 1))


@pytest.mark.parametrize("q", [2, 5, 64])
def test_padding_masks_are_the_chains_up_to_a_full_64_node_tree(q):
    from kvserve.runtime.spec_decode.medusa_tree import chain_choices, tree_layout

    graphs = DecodeGraphs(None, [], block_size=4, max_model_len=128, sizes=[2], device=torch.device("cpu"),
                          capture=False, query_len=q, tree=True)
    assert torch.equal(graphs.tree_masks, torch.tensor(tree_layout(chain_choices(q - 1)).masks).repeat(2))


def test_load_refuses_steps_a_verification_graph_cannot_hold():
    graphs = DecodeGraphs(None, [], block_size=4, max_model_len=16, sizes=[2], device=torch.device("cpu"),
                          capture=False, query_len=3)
    ids, pos, meta = _uniform_step([(1, [0, 1])] * 3, 3, 4)
    with pytest.raises(ValueError, match="at most 2 sequences of 3 tokens"):
        graphs.load(ids, pos, meta, 2)
    ids, pos, meta = _uniform_step([(1, [0, 1])], 4, 4)  # 4-token queries
    with pytest.raises(ValueError, match="at most 2 sequences of 3 tokens"):
        graphs.load(ids, pos, meta, 2)
    ids, pos, meta = _uniform_step([(1, [0, 1])], 3, 4, tree_masks=torch.tensor([1, 3, 5]))
    with pytest.raises(ValueError, match="needs a graph captured with tree masks"):
        graphs.load(ids, pos, meta, 2)
    with pytest.raises(ValueError, match="2 to 64 rows"):
        DecodeGraphs(None, [], block_size=4, max_model_len=16, sizes=[2], device=torch.device("cpu"),
                     capture=False, query_len=65, tree=True)


def test_kv_sizing_counts_the_verification_graphs(tiny_llama, monkeypatch):
    """With speculation configured, the KV budget also subtracts the verification graphs, measured
    like the decode graphs (the largest and smallest bucket, captured into the same pool)."""
    from test_executor import _scripted_platform  # noqa: E402

    from kvserve.runtime import LLM

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(str(tiny_llama), num_kv_blocks=16, block_size=4, max_num_seqs=8, max_model_len=64,
             speculative_config=spec, compilation_config={"max_capture_size": 16}) as llm:
        worker = llm.engine.executor.driver_worker
        monkeypatch.setattr(worker, "graph_sizes", lambda: ([1, 2, 4, 8], None))
        real_profile, calls = worker.profile_graphs, []

        def profile_graphs(kv_groups, sizes, *, max_model_len, query_len=1, tree=False):
            calls.append((sizes, query_len, tree))
            return real_profile(kv_groups, sizes, max_model_len=max_model_len, capture=False, query_len=query_len,
                                tree=tree)

        monkeypatch.setattr(worker, "profile_graphs", profile_graphs)
        gib = 2**30
        # free: before profiling; then per family: before / after the largest / after the smallest;
        # then once all is released
        worker.platform = _scripted_platform([6 * gib, 5 * gib, 5 * gib - 1000, 5 * gib - 1010,
                                              5 * gib - 1010, 5 * gib - 3010, 5 * gib - 3030, 6 * gib], 8 * gib)
        budget = worker._profiled_kv_budget(None, 16, 64)
        assert calls == [([1, 2, 4, 8], 1, False), ([1, 2, 4], 4, False)]  # 4 x 4 tokens fit max_capture_size 16
        decode, verify = 1000 + 10 * 3, 2000 + 20 * 2
        assert budget == int(8 * gib * llm.engine.config.gpu_memory_utilization) - 2 * gib - decode - verify


def test_a_failed_verification_capture_leaves_those_steps_eager(tiny_llama):
    """Capture needs CUDA; on the CPU it fails for real (the fault injected here): counted, and
    the decode graphs are not given up for it."""
    from kvserve.runtime import LLM

    with LLM(str(tiny_llama), num_kv_blocks=16, block_size=4, speculative_config={"method": "ngram",
                                                                                  "num_speculative_tokens": 2}) as llm:
        worker = llm.engine.executor.driver_worker
        assert worker.build_verify_graphs([1, 2], max_model_len=64, capture=True) == {}
        assert worker.graph_capture_failures == 1 and llm.engine.get_stats().cuda_graph_capture_failures_total == 1
        assert worker.profile_graphs(None, [1, 2], max_model_len=64, capture=True, query_len=3) == 0
        assert worker._verify_graphs_refused and not worker._graphs_refused
        assert worker.verify_graph_plan([1, 2]) == {}


# ------------------------------------------------------------------------ outputs do not change


def _run(model_dir, spec, *, twin: bool, prompts, arrive_every=2, only_prefill_eager=True, **kw):
    """(outputs, verification steps run on static buffers) of one engine run, verification steps
    kept multi-token; with twin, the verification graphs' CPU twin is installed (and a draft
    model's decode graphs')."""
    engine = make_engine(model_dir, spec, **kw)
    engine.executor.runner.verify_as_decode_rows = False
    worker = engine.executor.driver_worker
    spec_decoder = engine.executor.spec_decoder
    if twin:
        worker.verify_graphs = worker.build_verify_graphs([1, 2, 4, 8], max_model_len=engine.max_model_len,
                                                          capture=False)
        assert worker.verify_graphs
        spec_decoder.build_draft_graphs([1, 2, 4], max_model_len=engine.max_model_len, capture=False)
        eager_steps, execute = [], worker._execute

        def watched(step, graphs, keep=None):  # the multi-token steps that still run eagerly
            if not step.meta.is_decode_only and graphs is None:
                eager_steps.append(step.meta.max_query_len)
            return execute(step, graphs, keep)

        worker._execute = watched
    outs = run_checked(engine, prompts, GREEDY, arrive_every)
    stats = engine.get_stats()
    assert stats.spec_decode_num_drafts_total > 0
    if twin:  # only a step with a prefill in it (a query longer than any graph's) stays eager
        stats.eager_short_steps = sum(longest <= max(worker.verify_graphs) for longest in eager_steps)
        assert stats.eager_short_steps == 0 or not only_prefill_eager, eager_steps
    stats.verify_padded_steps = worker.verify_padded_steps  # read with the replays (not engine stats)
    stats.draft_graph_replays = 0 if spec_decoder.draft_graphs is None else spec_decoder.draft_graphs.replays
    return {k: v.outputs[0].token_ids for k, v in outs.items()}, worker.verify_graph_replays, stats


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.mark.parametrize("arch, overrides, method, arrivals", [
    pytest.param("llama", {}, "ngram", (25, 2), id="llama-ngram"),
    # KV cache groups (per-window slot mappings and block tables), a window and soft-capping; the
    # target as its own draft (this tiny model repeats one token, so n-gram finds one draft only)
    pytest.param("gemma2", dict(attn_logit_softcapping=2.0), "draft_is_target", (25, 2),
                 id="gemma2-groups-window-softcap-draft"),
])
def test_chain_verification_on_static_buffers_gives_the_same_greedy_outputs(tiny_model_factory, arch, overrides,
                                                                            method, arrivals):
    """The n-gram lookup gives a sequence k drafts, fewer or none: at batch 1 (requests 25 steps
    apart) and with overlapping requests, its short queries are padded with dummy rows to 1 + k
    (runtime/executor/verify_padding.py), so verification steps replay; only steps a prefill
    shares stay eager. A draft model's steps are uniform once no prefill shares the step."""
    model = tiny_model_factory(arch, **overrides)
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    prompts = grounded_prompts(n=6)
    for arrive_every in arrivals:
        want, replays, _ = _run(model, spec, twin=False, prompts=prompts, arrive_every=arrive_every)
        assert replays == 0
        got, replays, stats = _run(model, spec, twin=True, prompts=prompts, arrive_every=arrive_every)
        assert got == want
        assert replays > 0
        if method == "ngram":
            assert 0 < stats.verify_padded_steps <= replays
        else:  # the draft's proposal decodes replayed its own decode graphs
            assert stats.draft_graph_replays > 0
    assert stats.spec_decode_num_accepted_tokens_total > 0


def test_a_query_that_cannot_pad_past_max_model_len_runs_eagerly(tiny_llama):
    """Requests that end exactly at max_model_len: near the end their drafts are cut short, and
    padding them would put dummy rows past max_model_len (no block table room), so those steps
    run eagerly; the outputs, and the block accounting, stay the eager engine's."""
    prompts = grounded_prompts(n=6)
    limit = max(len(p) for p in prompts) + GREEDY.max_tokens
    want, _, _ = _run(tiny_llama, NGRAM, twin=False, prompts=prompts, arrive_every=25, max_model_len=limit)
    got, replays, stats = _run(tiny_llama, NGRAM, twin=True, prompts=prompts, arrive_every=25, max_model_len=limit,
                               only_prefill_eager=False)
    assert got == want
    assert replays > 0 and stats.verify_padded_steps > 0 and stats.eager_short_steps > 0


def test_draft_model_proposals_replay_the_drafts_own_decode_graphs(tiny_llama):
    """The draft model's k + 1 proposal decodes per step run on its own decode graphs (the CPU
    twin) over its own pools, in batches of 1 to 6 sequences (past the largest draft bucket, 4,
    they stay eager). The target is its own draft, so the eager engine accepts every draft: a
    graphed proposal that differed would show as rejected drafts (greedy output alone would not
    tell, the verification corrects any draft)."""
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    prompts = grounded_prompts(n=6)
    want, _, eager = _run(tiny_llama, spec, twin=False, prompts=prompts)
    got, replays, stats = _run(tiny_llama, spec, twin=True, prompts=prompts)
    assert got == want
    assert replays > 0 and stats.draft_graph_replays > 0
    accepted = (eager.spec_decode_num_accepted_tokens_total, stats.spec_decode_num_accepted_tokens_total)
    assert accepted[0] == accepted[1] == stats.spec_decode_num_draft_tokens_total > 0


def test_medusa_tree_verification_on_static_buffers_gives_the_same_greedy_outputs(tiny_llama, tmp_path):
    """At batch 1 too: near max_tokens a tree is cut to the levels left (4 nodes here, a chain's
    length but with tree masks), which pads to the tree graph rather than running eagerly."""
    path = save_medusa_heads(target_copy_heads(tiny_llama), tmp_path / "h")
    spec = {"method": "medusa", "model": str(path), "speculative_token_tree": TREE}
    prompts = grounded_prompts(n=6, seed=1)
    for arrive_every in (25, 2):
        want, _, _ = _run(tiny_llama, spec, twin=False, prompts=prompts, arrive_every=arrive_every)
        got, replays, stats = _run(tiny_llama, spec, twin=True, prompts=prompts, arrive_every=arrive_every)
        assert got == want
        assert replays > 0 and stats.spec_decode_num_accepted_tokens_total > 0


# ------------------------------------------------------------------------------- real graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["ngram", "medusa_tree", "eagle3", "draft_model"])
def test_cuda_graphs_replay_verification_steps_with_the_same_greedy_outputs(tiny_llama, tmp_path, kind):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    if kind == "draft_model":  # the target as its own draft: proposals replay the draft's graphs
        spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    if kind == "medusa_tree":
        path = save_medusa_heads(target_copy_heads(tiny_llama), tmp_path / "h")
        spec = {"method": "medusa", "model": str(path), "speculative_token_tree": TREE}
    elif kind == "eagle3":  # its aux layers come back from the captured graphs
        from test_eagle import base_config, random_head  # noqa: E402

        from kvserve.runtime.spec_decode.eagle import save_eagle_head

        path = save_eagle_head(random_head(True, draft_vocab=200), tmp_path / "e3", base_config=base_config(),
                               aux_layers=(1, 2, 2))
        spec = {"method": "eagle3", "model": str(path), "num_speculative_tokens": 3}
    prompts = grounded_prompts(n=8)
    outs = {}
    # n-gram also with overlapping requests: padded steps of several sequences, some with no drafts
    for eager, arrive_every in [(e, a) for a in ((25, 2) if kind == "ngram" else (25,)) for e in (True, False)]:
        engine = make_engine(tiny_llama, spec, device="cuda", dtype="float32", enforce_eager=eager,
                             compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
        worker = engine.executor.driver_worker
        assert bool(worker.verify_graphs) != eager and worker.graph_capture_failures == 0
        outs[eager, arrive_every] = {k: v.outputs[0].token_ids
                                     for k, v in run_checked(engine, prompts, GREEDY, arrive_every).items()}
        if not eager:
            assert worker.verify_graph_replays > 0, "no verification step replayed a graph"
            assert all(g.graphs for g in worker.verify_graphs.values())  # captured, not the twin
            if kind == "ngram":  # short n-gram queries were padded, and those steps replayed
                assert 0 < worker.verify_padded_steps <= worker.verify_graph_replays
            if kind == "draft_model":
                draft_graphs = engine.executor.spec_decoder.draft_graphs
                assert draft_graphs.graphs and draft_graphs.replays > 0
        engine.close()
    for arrive_every in {a for _, a in outs}:
        assert outs[True, arrive_every] == outs[False, arrive_every]


def test_a_graphed_tree_step_attends_like_the_eager_one_without_reading_the_device(monkeypatch):
    """The Triton backend's all_trees path (what a tree graph captures: the tree kernel over every
    row, a chain's rows with chain masks, the launch sized from max_query_len) gives the rows the
    eager path gives (prefill kernel, tree rows overwritten), and reads nothing back from the
    device (interpreted here; .item() / .tolist() / bool() on a tensor would sync a GPU)."""
    pytest.importorskip("triton")
    from test_medusa_tree import _tree_batch  # noqa: E402

    from kvserve.runtime.attention.selector import get_attention_backend
    from kvserve.runtime.spec_decode.medusa_tree import chain_choices, tree_layout

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    t, q, k_cache, v_cache, qsl, seq_lens, bt, masks, _, _ = _tree_batch(gen)
    n = t.num_nodes
    masks[n:2 * n] = 0  # the second sequence verifies a chain
    base = dict(query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt, max_query_len=n,
                slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.long), max_seq_len=int(seq_lens.max()))
    backend = get_attention_backend("triton", "cpu")
    want = backend.attend(q, None, None, k_cache, v_cache, AttentionMetadata(**base, tree_masks=masks), 0.25)
    chain = torch.tensor(tree_layout(chain_choices(n - 1)).masks)
    graphed = AttentionMetadata(**base, tree_masks=torch.where(masks != 0, masks, chain.repeat(3)), all_trees=True)

    def no_device_read(*_, **__):
        raise AssertionError("the graphed tree step read the device")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__"):
            m.setattr(torch.Tensor, name, no_device_read)
        got = backend.attend(q, None, None, k_cache, v_cache, graphed, 0.25)
        backend.attend(q, None, None, k_cache, v_cache, AttentionMetadata(**base), 0.25)  # a chain step
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_name, tree", [("torch", False), ("triton", False), ("triton", True)])
def test_dummy_rows_leave_the_real_rows_attention_unchanged(monkeypatch, backend_name, tree):
    """A padded step as a graph runs it (block tables as wide as max_model_len, zeros past a
    sequence's blocks; max_seq_len = max_model_len; a tree graph: every row through the tree
    kernel, chain masks for chain and dummy rows): the real rows attend exactly as in the short
    step, and the dummy rows, which read slots past each sequence's end, disturb nothing. The
    Triton kernels run interpreted here, the code a GPU runs."""
    if backend_name == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvserve.runtime.attention.selector import get_attention_backend
    from kvserve.runtime.executor.forward_input import ForwardInput

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, bs, max_model_len = 4, 2, 16, 8, 64
    ctx, query_lens = [13, 0, 30], [4, 1, 2]
    num_blocks = 16
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    tables, free = [], list(range(1, num_blocks))  # block 0: only what a graph's zeroed entries point at
    for c, n in zip(ctx, query_lens):
        tables.append([free.pop() for _ in range(-(-(c + n) // bs))])
    width = max(len(t) for t in tables)
    seq_lens = [c + n for c, n in zip(ctx, query_lens)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 4, 5, 7], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.full((7,), -1, dtype=torch.long), max_query_len=4, max_seq_len=max(seq_lens))
    q = torch.randn(7, heads, dim, generator=gen)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, query_lens)])
    if tree:  # the first sequence verifies a 4-node tree (root, two children, a grandchild)
        meta.tree_masks = torch.tensor([0b1, 0b11, 0b101, 0b1011, 0, 0, 0])
        positions[:4] = torch.tensor([13, 14, 14, 15])
    backend = get_attention_backend(backend_name, "cpu")
    want = backend.attend(q, None, None, k_cache, v_cache, meta, 0.25)

    padded, keep = pad_step(ForwardInput(torch.zeros(7, dtype=torch.long), positions, meta, []), 4, max_model_len)
    wide = torch.zeros(3, max_model_len // bs, dtype=torch.int32)
    wide[:, :width] = meta.block_tables
    graphed = dataclasses.replace(padded.meta, block_tables=wide, max_seq_len=max_model_len)
    if tree:  # as DecodeGraphs.load fills a tree graph's masks
        chain = (1 << (torch.arange(12) % 4 + 1)) - 1
        graphed.tree_masks = torch.where(graphed.tree_masks != 0, graphed.tree_masks, chain)
        graphed.all_trees = True
    q_padded = torch.randn(12, heads, dim, generator=gen) * 100  # dummy rows: anything
    q_padded[keep] = q
    got = backend.attend(q_padded, None, None, k_cache, v_cache, graphed, 0.25)
    torch.testing.assert_close(got[keep], want, rtol=1e-5, atol=1e-5)


def test_eagle3_reads_its_aux_layers_from_the_static_buffers(tiny_llama, tmp_path):
    """EAGLE-3 reads the target's intermediate residual streams (model.aux_hidden): the graphs
    hand back theirs, cut to the step's rows, so decode and verification steps of an EAGLE-3
    target run on the static buffers too, with the eager engine's greedy output."""
    from test_eagle import base_config, random_head  # noqa: E402

    from kvserve.runtime.spec_decode.eagle import save_eagle_head

    path = save_eagle_head(random_head(True, draft_vocab=200), tmp_path / "e3", base_config=base_config(),
                           aux_layers=(1, 2, 2))
    spec = {"method": "eagle3", "model": str(path), "num_speculative_tokens": 3}
    prompts = grounded_prompts(n=4)
    outs, replays = [], []
    for twin in (False, True):
        engine = make_engine(tiny_llama, spec, num_kv_blocks=48)
        engine.executor.runner.verify_as_decode_rows = False
        worker = engine.executor.driver_worker
        if twin:
            worker.graphs = worker.build_graphs([1, 2, 4, 8], max_model_len=engine.max_model_len, capture=False)
            worker.verify_graphs = worker.build_verify_graphs([1, 2, 4, 8], max_model_len=engine.max_model_len,
                                                              capture=False)
            real = worker._execute

            def checked(step, graphs, keep=None, *, real=real, worker=worker):  # the step's aux rows, never padding's
                logits = real(step, graphs, keep)
                rows = step.input_ids.shape[0] if keep is None else keep.shape[0]
                assert all(a.shape[0] == rows for a in worker.last_aux_hidden)
                return logits

            worker._execute = checked
        outs.append({k: v.outputs[0].token_ids for k, v in run_checked(engine, prompts, GREEDY).items()})
        replays.append((worker.graphs.replays if twin else 0, worker.verify_graph_replays))
    assert outs[0] == outs[1]
    assert replays[0] == (0, 0) and replays[1][1] > 0


def _twin_verify_graphs(self, *, max_model_len):
    """Worker.compile_and_capture building the CPU twin of the decode and verification graphs."""
    self.graphs = self.build_graphs([1, 2, 4, 8], max_model_len=max_model_len, capture=False)
    self.verify_graphs = self.build_verify_graphs([1, 2, 4, 8], max_model_len=max_model_len, capture=False)


def test_the_executor_captures_the_drafts_graphs_as_it_captured_the_targets(tiny_llama, monkeypatch):
    """With the target's graphs in place (here their CPU twin), the executor builds the draft
    model's decode graphs the same way (a twin, not a CUDA capture that would fail on the CPU),
    in the target graphs' pool, and the proposals replay them."""
    from kvserve.runtime import LLM
    from kvserve.runtime.executor.worker import Worker

    monkeypatch.setattr(Worker, "compile_and_capture", _twin_verify_graphs)
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    with LLM(str(tiny_llama), num_kv_blocks=64, block_size=4, max_model_len=128, speculative_config=spec) as llm:
        llm.generate([{"prompt_token_ids": p} for p in grounded_prompts(n=2)], GREEDY, use_tqdm=False)
        worker, draft_graphs = llm.engine.executor.driver_worker, llm.engine.executor.spec_decoder.draft_graphs
        assert worker.graph_capture_failures == 0
        assert draft_graphs.sizes == worker.graphs.sizes and not draft_graphs.capture_enabled
        assert draft_graphs.replays > 0


# The same, in the worker processes (sitecustomize runs at their start).
_TWIN_VERIFY_GRAPHS = '''
from kvserve.runtime.executor.worker import Worker
def compile_and_capture(self, *, max_model_len):
    self.graphs = self.build_graphs([1, 2, 4, 8], max_model_len=max_model_len, capture=False)
    self.verify_graphs = self.build_verify_graphs([1, 2, 4, 8], max_model_len=max_model_len, capture=False)
Worker.compile_and_capture = compile_and_capture
'''


def test_tp2_verification_graphs_replay_on_every_rank(tiny_model_factory, tmp_path, monkeypatch):
    """At tensor_parallel_size 2, through the twin on both ranks (installed in the worker process
    through sitecustomize, as tests/test_tp_matrix.py does for decode graphs): a replayed
    verification step pads to its bucket (and a short n-gram query to 1 + k rows), so its
    all-reduces have the bucket's shape, and a rank choosing the other path would mismatch the
    collective. Equal tokens: every rank chose alike."""
    from kvserve.runtime import LLM
    from kvserve.runtime.executor.worker import Worker

    (tmp_path / "sitecustomize.py").write_text(_TWIN_VERIFY_GRAPHS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(Worker, "compile_and_capture", _twin_verify_graphs)
    model_dir = tiny_model_factory("llama")
    kw = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=32, seed=0,
              speculative_config=NGRAM)
    prompts = [{"prompt_token_ids": p} for p in grounded_prompts(n=4)]
    outs, replays = [], []
    for tp in (1, 2):
        with LLM(str(model_dir), tensor_parallel_size=tp, **kw) as llm:
            llm.engine.executor.runner.verify_as_decode_rows = False
            res = llm.generate(prompts, GREEDY, use_tqdm=False)
            outs.append([list(o.outputs[0].token_ids) for o in res])
            worker = llm.engine.executor.driver_worker
            replays.append((worker.verify_graph_replays, worker.verify_padded_steps))
    assert outs[0] == outs[1] and min(replays[0] + replays[1]) > 0
