"""Speculative decoding inside a continuously batched step.

Before scheduling, ``plan`` gives every eligible decoding sequence its drafts (n-gram lookup) or
k placeholder slots (draft model); the scheduler then runs 1 + k positions for it, next to other
sequences' prefill chunks and plain decodes. ``execute`` fills draft-model proposals (k batched
draft decodes), runs the target once over the packed batch and verifies each sequence's drafts
with the rejection sampler. The engine appends the accepted tokens and rolls the sequence's
computed length (and any block past it) back to what was verified.

At tensor parallelism the proposer and the draft model run whole on rank 0 (the draft is small,
so its proposals need no collectives); the verification is one ordinary forward pass of the
target, which the executor runs on every rank like any other step.

The draft model keeps its own KV pools with the target's block ids and block tables: it mirrors
every target forward pass (same tokens, same slots) except verifications, whose positions its
proposal decodes already wrote (plus one decode of the last draft), so its cache is complete
wherever the target's is, prefix-cache hits and copy-on-write copies included. On a GPU its
decode steps replay its own decode graphs (``build_draft_graphs``, captured by the executor).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.executor.model_runner import ModelRunner
from kvserve.runtime.kv_cache import allocate_kv_cache, copy_blocks
from kvserve.runtime.sampler import SamplerOutput, SamplingRow, argmax_last
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.spec_decode.config import SpeculativeConfig
from kvserve.runtime.spec_decode.ngram import ngram_propose
from kvserve.runtime.spec_decode.probs import sampling_probs
from kvserve.runtime.spec_decode.rejection import greedy_verify, rejection_sample
from kvserve.runtime.spec_decode.typical import typical_chain
from kvserve.runtime.structured_outputs.manager import apply_grammar_to_drafts


def load_heads(config: SpeculativeConfig, *, hidden_size: int, vocab_size: int, device: torch.device,
               dtype: torch.dtype, num_layers: int | None = None, model_config=None, model_dir=None,
               attention_backend=None, quant_config=None):
    """Medusa heads, or an EAGLE head with the indices of the target's aux_hidden_layers it
    reads (EAGLE-3), or the checkpoint's MTP layer (with no indices), on rank 0; None for the
    other methods. Checked against the target."""
    if config.method == "mtp":
        from kvserve.runtime.spec_decode.mtp import load_mtp_layer

        layer = load_mtp_layer(config.model or model_dir, model_config, attention_backend, dtype=dtype,
                               device=device, quant_config=quant_config)
        return layer, ()
    if config.method in ("eagle", "eagle3"):
        from kvserve.runtime.spec_decode.eagle import default_aux_layers, load_eagle_head

        head, ids = load_eagle_head(config.model, method=config.method, hidden_size=hidden_size,
                                    vocab_size=vocab_size, dtype=dtype, device=device)
        if config.method == "eagle3":
            ids = ids or default_aux_layers(num_layers)
            if min(ids) < 1 or max(ids) > num_layers:
                raise ValueError(f"speculative_config.model: eagle_aux_hidden_state_layer_ids {list(ids)} must lie "
                                 f"in [1, {num_layers}] (the residual stream entering a layer of the target)")
        return head, tuple(ids)
    if config.method != "medusa":
        return None
    from kvserve.runtime.spec_decode.medusa import load_medusa_heads

    heads = load_medusa_heads(config.model, hidden_size=hidden_size, vocab_size=vocab_size, dtype=dtype,
                              device=device)
    if config.num_speculative_tokens > heads.num_heads:
        raise ValueError(f"speculative_config.num_speculative_tokens: the Medusa directory has {heads.num_heads} "
                         f"heads, fewer than {config.num_speculative_tokens}")
    return heads


def load_draft(config: SpeculativeConfig, *, device: torch.device, dtype: torch.dtype, attention_backend,
               vocab_size: int, max_model_len: int):
    """The draft model (None for n-gram), checked against the target. Loaded before the KV pools
    are sized, so that on a GPU the free memory measured afterwards already excludes its weights."""
    if config.method != "draft_model":
        return None
    from kvserve.runtime.model_config import ModelConfig
    from kvserve.runtime.models import load_model

    try:
        cfg = ModelConfig.from_pretrained(config.model)
    except ValueError as exc:  # "model: ..." would point at the target model, not the draft
        raise ValueError(f"speculative_config.{exc}") from None
    if cfg.vocab_size != vocab_size:
        raise ValueError(f"speculative_config.model: vocabulary of {cfg.vocab_size} tokens differs from "
                         f"the target's {vocab_size}; the draft must share the target's tokenizer")
    if cfg.default_max_model_len() < max_model_len:
        raise ValueError(f"speculative_config.model: the draft supports {cfg.default_max_model_len()} "
                         f"positions, fewer than max_model_len {max_model_len}")
    return load_model(config.model, dtype=dtype, device=device, attention_backend=attention_backend, config=cfg)


def split_blocks_with_draft(num_blocks: int, target_shape, draft_shape) -> int:
    """Blocks for a byte budget sized for the target alone, once every block also has a draft
    block (same ids, the draft's own pools): the budget is shared in proportion to their sizes."""
    from kvserve.runtime.capacity import kv_bytes_per_token

    t, d = kv_bytes_per_token(target_shape, 1, 1), kv_bytes_per_token(draft_shape, 1, 1)
    return max(1, num_blocks * t // (t + d))


def _first(tokens) -> int:
    return tokens[0] if isinstance(tokens, list) else tokens


def eligible(params: SamplingParams, seq) -> bool:
    """Requests whose next-token distribution the rejection sampler reproduces exactly (with
    structured outputs, the distribution masked by the grammar at every verified position)."""
    return (not params.needs_penalties and params.logprobs is None
            and seq.num_output_tokens >= params.min_tokens)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, *, num_blocks: int, block_size: int,
                 device: torch.device, kv_cache_dtype: torch.dtype, max_model_len: int,
                 draft_model=None, heads=None, hidden_source=None, aux_source=None, target=None,
                 model_dir=None, max_num_seqs: int = 256, kv_source=None,
                 attention_backend: str | None = None) -> None:
        """`draft_model` comes from ``load_draft`` (required for method draft_model); its KV pools
        take `kv_cache_dtype`, the target's (float8 with kv_cache_dtype fp8). `heads` (Medusa,
        from ``load_heads``) read the hidden states behind each step's logits rows, which
        `hidden_source()` returns (rank 0's worker keeps them); `kv_source()` gives rank 0's KV
        pools (a tree's accepted path is moved into place there at once)."""
        self.config = config
        self.kv_source = kv_source
        self.tree = None
        if config.speculative_token_tree is not None:
            from kvserve.runtime.spec_decode.tree_verify import Tree, unsupported

            self.tree = Tree(config.speculative_token_tree)
            why = unsupported(getattr(target, "config", None), attention_backend, kv_cache_dtype)
            if why is not None:
                raise ValueError(f"speculative_config.speculative_token_tree: {why}")
        # Sequences (ids) whose drafts this step are a tree's nodes, not a chain.
        self._tree_seqs: set[int] = set()
        self.heads = heads
        self.hidden_source = hidden_source
        self.aux_source = aux_source
        self.eagle = None
        # EAGLE / MTP with n > 1: per forked sample (keyed by its SamplingRow), the prompt's last
        # position and the target's feature there, until the sample's first decode step.
        self._fork_slots: dict[int, tuple] = {}
        self._steps = 0
        if config.method == "mtp":
            from kvserve.runtime.spec_decode.mtp import MTPProposer

            if heads is None or hidden_source is None or target is None:
                raise ValueError("speculative_config: the MTP layer was not loaded")
            # Same draft-slot bookkeeping as EAGLE (_eagle_drafts), over the MTP's latent pool.
            self.eagle = MTPProposer(heads[0], target, num_blocks=num_blocks, block_size=block_size,
                                     max_num_seqs=max_num_seqs, num_speculative_tokens=config.num_speculative_tokens,
                                     model_dir=model_dir)
            self.heads = None
        elif config.method in ("eagle", "eagle3"):
            # `heads` is the loaded EagleHead; its proposer owns the one-layer draft KV pools.
            from kvserve.runtime.spec_decode.eagle import EagleProposer

            if heads is None or hidden_source is None or target is None:
                raise ValueError("speculative_config.model: the EAGLE head was not loaded")
            head, aux = heads  # `target` (rank 0's model) lends its embedding, lm_head and RoPE
            self.eagle = EagleProposer(head, target, num_blocks=num_blocks, block_size=block_size, aux_layers=aux,
                                       model_dir=model_dir)
            self.heads = None
        elif config.method == "medusa" and (heads is None or hidden_source is None):
            raise ValueError("speculative_config.model: the Medusa heads were not loaded")
        self.runner = runner
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.draft_model = draft_model
        self.draft_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if config.method == "draft_model":
            if draft_model is None:
                raise ValueError("speculative_config.model: the draft model was not loaded")
            self.draft_kv = allocate_kv_cache(draft_model.config.shape, num_blocks, block_size, kv_cache_dtype,
                                              device)
        # The draft model's decode steps (its k + 1 proposal decodes, and mirrored decode-only
        # steps) replayed from its own CUDA graphs over its own pools; None: eager.
        self.draft_graphs = None

    def build_draft_graphs(self, sizes: list[int], *, max_model_len: int, capture: bool, pool=None) -> None:
        """Decode graphs of the draft model for batch sizes `sizes` (the target's decode buckets),
        in `pool` (the target graphs' memory pool: the draft's temporaries reuse its freed memory).
        capture=False: the padded static-buffer path run eagerly, the CPU twin the tests use. A
        failed capture raises (the caller logs and counts it) and leaves the proposals eager."""
        from kvserve.runtime.executor.cuda_graphs import DecodeGraphs

        if self.draft_model is None or not sizes:
            return
        graphs = DecodeGraphs(self.draft_model, self.draft_kv, block_size=self.block_size, max_model_len=max_model_len,
                              sizes=sizes, device=self.device, capture=capture, pool=pool)
        graphs.capture()
        self.draft_graphs = graphs

    def _draft_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        graphs = self.draft_graphs
        if graphs is not None and meta.is_decode_only and graphs.bucket(input_ids.shape[0]) is not None:
            return graphs.run(input_ids, positions, meta)
        return self.draft_model(input_ids, positions, self.draft_kv, meta)

    def close(self) -> None:
        self.draft_graphs = None
        self.draft_kv = None
        self.draft_model = None

    # -- before scheduling -------------------------------------------------------------------------
    def plan(self, running: list, params_of) -> None:
        """Sets `spec_token_ids` of the running sequences (params_of(seq) -> SamplingParams | None)."""
        cfg = self.config
        self._tree_seqs.clear()
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_uncomputed_tokens != 1:
                continue
            params = params_of(seq)
            if params is None or not eligible(params, seq):
                continue
            # Never past max_tokens (1 + k tokens may come out) nor past max_model_len (k slots).
            k = min(cfg.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens)
            if k < 1:
                continue
            if cfg.method == "ngram":
                seq.spec_token_ids = ngram_propose(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            elif cfg.method in ("medusa", "eagle", "eagle3", "mtp"):
                # The heads' guesses from the previous step, if nothing changed the sequence since.
                made = seq.head_drafts
                if made is None or made[0] != seq.num_tokens:
                    continue
                if self.tree is None:
                    seq.spec_token_ids = list(made[1][:k])
                elif self._branches(params):
                    # The tree cut to k levels and to the slots left below max_model_len.
                    n = min(self.tree.nodes_within(k), self.max_model_len - seq.num_tokens + 1)
                    seq.spec_token_ids = list(made[1][:n - 1])
                    self._tree_seqs.add(seq.seq_id)
                else:
                    seq.spec_token_ids = self.tree.chain_tokens(made[1])[:k]
            else:
                seq.spec_token_ids = [0] * k  # slots; the draft model fills them after scheduling

    # -- the step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: list, block_tables: list[list[int]],
                rows: list[SamplingRow], repeats: list[int] | None = None) -> SamplerOutput:
        runner = self.runner
        spec = [i for i, item in enumerate(scheduled) if item.num_spec]
        if self.eagle is not None:
            for item in scheduled:
                self.eagle.copy_blocks(item.block_copies)
        if not spec and self.draft_model is None:
            out = runner.execute(scheduled, block_tables, rows, repeats)
            if self.heads is not None:
                self._plain_head_drafts(scheduled, repeats)
            if self.eagle is not None:
                self._eagle_drafts(scheduled, block_tables, rows, repeats, out.token_ids)
            return out
        if repeats is None:
            repeats = [1] * sum(1 for item in scheduled if item.samples)
        if self.draft_kv is not None:  # the target's copies travel with its forward pass
            for item in scheduled:
                copy_blocks(self.draft_kv, item.block_copies)

        # Which SamplingRow(s) belong to each scheduled sequence.
        item_rows: list[list[SamplingRow]] = []
        r = s = 0
        for item in scheduled:
            if item.samples:
                item_rows.append(rows[r:r + repeats[s]])
                r += repeats[s]
                s += 1
            else:
                item_rows.append([])

        draft_probs: dict[int, list[torch.Tensor | None]] = {}
        if self.draft_model is not None and spec:
            draft_probs = self._propose(scheduled, block_tables, item_rows, spec)

        # Logits rows: the last one of a plain sampling sequence, the last 1 + k of a verified one.
        select, spans = [], []
        end = 0
        for item in scheduled:
            end += item.num_new_tokens
            if item.samples:
                n = item.num_spec + 1
                spans.append(len(select))
                select.extend(range(end - n, end))
            else:
                spans.append(-1)

        # Medusa trees: sequences whose drafts are a tree's nodes (a prefix that is a chain runs as one).
        trees = {}
        if self.tree is not None:
            trees = {i: self.tree.layout(scheduled[i].num_spec + 1) for i in spec
                     if scheduled[i].seq.seq_id in self._tree_seqs and not self.tree.is_chain(scheduled[i].num_spec + 1)}

        # Pack with the drafts in place (prepare reads token_ids), then put token_ids back.
        for i in spec:
            scheduled[i].seq.token_ids.extend(scheduled[i].seq.spec_token_ids)
        try:
            step = runner.prepare(scheduled, block_tables,
                                  {i: (t.depths, t.masks) for i, t in trees.items()} or None)
        finally:
            for i in spec:
                del scheduled[i].seq.token_ids[-scheduled[i].num_spec:]
        step.logits_rows = select
        logits = runner.forward(step)  # the target's verification, on every rank
        if self.draft_model is not None:
            mirror = [i for i, item in enumerate(scheduled) if not item.num_spec]
            if len(mirror) == len(scheduled):
                local = step.to(self.device)
                self._draft_forward(local.input_ids, local.positions, local.meta)
            elif mirror:
                local = runner.prepare([scheduled[i] for i in mirror], [block_tables[i] for i in mirror])
                local = local.to(self.device)
                self._draft_forward(local.input_ids, local.positions, local.meta)
        if logits is None:
            return SamplerOutput([], [])

        plain = [i for i, item in enumerate(scheduled) if item.samples and not item.num_spec]
        plain_out = None
        if plain:
            idx = torch.tensor([spans[i] for i in plain], device=logits.device)
            reps = torch.tensor([len(item_rows[i]) for i in plain], device=logits.device)
            plain_logits = logits[idx].repeat_interleave(reps, dim=0)
            plain_out = runner.sampler(plain_logits, [row for i in plain for row in item_rows[i]])

        token_ids: list = []
        logprobs: list = []
        paths: dict[int, list[int]] = {}  # tree sequences: their accepted nodes
        p = 0
        for i, item in enumerate(scheduled):
            if not item.samples:
                continue
            if not item.num_spec:
                for _ in item_rows[i]:
                    token_ids.append(plain_out.token_ids[p])
                    logprobs.append(plain_out.logprobs[p])
                    p += 1
                continue
            row = item_rows[i][0]
            drafts = item.seq.spec_token_ids
            span = logits[spans[i]:spans[i] + item.num_spec + 1]
            if row.grammar is not None:
                apply_grammar_to_drafts(span, row.grammar, drafts)
            if i in trees:
                paths[i], tokens = self._verify_tree(trees[i], [item.seq.token_ids[item.start]] + drafts, span, row)
            elif not row.params.greedy and self.config.acceptance_method == "typical_acceptance_sampler":
                generator = row.generator if row.generator is not None else runner.sampler.generator
                tokens = typical_chain(sampling_probs(span, row.params), drafts, self.config.posterior_threshold,
                                       self.config.posterior_alpha, generator)
            elif row.params.greedy:
                tokens = greedy_verify(argmax_last(span).tolist(), drafts)
            else:
                q = draft_probs.get(i)
                generator = row.generator if row.generator is not None else runner.sampler.generator
                tokens = rejection_sample(sampling_probs(span, row.params), drafts,
                                          torch.stack(q) if q else None, generator)
            token_ids.append(tokens)
            logprobs.append(None)
        if paths:
            self._move_paths(scheduled, block_tables, paths)
        if self.heads is not None:
            # The row behind each sequence's newest token: its last plain row, or the verified
            # row whose logits gave the bonus token.
            sources = []
            t = 0
            for i, item in enumerate(scheduled):
                if not item.samples:
                    continue
                emitted = token_ids[t]
                t += len(item_rows[i])
                if len(item_rows[i]) == 1:
                    n = len(emitted) if isinstance(emitted, list) else 1
                    sources.append((item.seq, spans[i] + (paths[i][-1] if i in paths else n - 1), n))
            self._head_drafts(sources)
        for i in spec:
            scheduled[i].seq.spec_token_ids = []
        if self.eagle is not None:
            self._eagle_drafts(scheduled, block_tables, rows, repeats, token_ids, paths)
        return SamplerOutput(token_ids, logprobs)

    # -- Medusa --------------------------------------------------------------------------------------
    def _branches(self, params: SamplingParams) -> bool:
        """Whether a request verifies the tree's branches (else its top-1 chain): greedy ones, and
        sampled ones under typical acceptance; never with structured outputs (one grammar state
        per draft position)."""
        if params.structured_outputs is not None:
            return False
        return params.greedy or self.config.acceptance_method == "typical_acceptance_sampler"

    def _verify_tree(self, layout, tokens: list[int], span: torch.Tensor, row: SamplingRow):
        """(accepted nodes, emitted tokens) of one tree (`tokens`: the root's, then the nodes')."""
        from kvserve.runtime.spec_decode.tree_verify import greedy_path, typical_path

        if row.params.greedy:
            return greedy_path(layout, tokens, argmax_last(span).tolist())
        cfg = self.config
        generator = row.generator if row.generator is not None else self.runner.sampler.generator
        return typical_path(layout, tokens, sampling_probs(span, row.params), cfg.posterior_threshold,
                            cfg.posterior_alpha, generator)

    def _move_paths(self, scheduled: list, block_tables: list, paths: dict[int, list[int]]) -> None:
        """Brings each tree's accepted path's K/V to the slots where its sequence continues: on
        rank 0 now, on the other ranks before their next step (ForwardInput.kv_slot_moves)."""
        from kvserve.runtime.spec_decode.tree_verify import move_slots, path_moves

        moves = [m for i, path in paths.items()
                 for m in path_moves(path, scheduled[i].start, block_tables[i], self.block_size)]
        if moves:
            move_slots(self.kv_source(), moves)
            self.runner.kv_slot_moves.extend(moves)

    def _plain_head_drafts(self, scheduled: list, repeats: list[int] | None) -> None:
        """After a step without drafts: one hidden row per sampling sequence, one new token each."""
        sources = []
        s = 0
        for item in scheduled:
            if not item.samples:
                continue
            if repeats is None or repeats[s] == 1:
                sources.append((item.seq, s, 1))
            s += 1
        self._head_drafts(sources)

    def _head_drafts(self, sources: list[tuple]) -> None:
        """Runs the heads on the given hidden rows (seq, row, tokens this step adds to it) and
        leaves each sequence its guesses for the step after the engine appends those tokens."""
        hidden = self.hidden_source()
        if not sources or hidden is None:
            return
        index = torch.tensor([row for _, row, _ in sources], device=hidden.device)
        if self.tree is not None:  # every node's guess, in node order
            from kvserve.runtime.spec_decode.tree_verify import top_guesses

            guesses = [self.tree.candidates(t) for t in top_guesses(self.heads, hidden[index], self.tree.top_k)]
        else:
            guesses = self.heads.propose(hidden[index], self.config.num_speculative_tokens)
        for (seq, _, added), drafts in zip(sources, guesses):
            seq.head_drafts = (seq.num_tokens + added, drafts)

    # -- EAGLE ---------------------------------------------------------------------------------------
    def _eagle_drafts(self, scheduled: list, block_tables: list[list[int]], rows: list[SamplingRow],
                      repeats: list[int] | None, token_ids: list, paths: dict[int, list[int]] | None = None) -> None:
        """Writes the draft slot of every position this step computed and kept (its next token is
        now known: from the prompt, an accepted draft or the sampled token) and leaves each
        single-sample sequence its next drafts (with a tree: its nodes' tokens). A verified tree's
        kept positions are its accepted path's nodes (`paths`), whose rows lie in node order."""
        hidden = self.hidden_source()
        if hidden is None:
            return
        eagle = self.eagle
        if eagle.aux_layers:
            aux = self.aux_source()
            hidden = torch.cat([aux[j] for j in eagle.aux_layers], dim=-1)
        fills, wants, owners = [], [], []
        row = off = s = r = 0
        k = self.config.num_speculative_tokens
        for index, (item, table) in enumerate(zip(scheduled, block_tables)):
            seq, start, n = item.seq, item.start, item.num_new_tokens
            base = seq.token_ids
            want = 0
            if not item.samples:
                ext, m = base, n
            else:
                reps = 1 if repeats is None else repeats[s]
                emitted = token_ids[r]
                params = rows[row].params
                row += reps
                r += reps
                s += 1
                fork = None
                if reps == 1:
                    emitted = emitted if isinstance(emitted, list) else [emitted]
                    if item.num_spec:
                        ext, m = base[:start + 1] + emitted, len(emitted)
                    else:
                        ext, m = base + emitted, n
                        fork = self._fork_slots.pop(id(rows[row - 1]), None)
                    if eligible(params, seq):
                        want = k
                        owners.append((seq, len(emitted)))
                else:
                    # n > 1: this is sample 0, whose first token fills the prompt's last slot; the
                    # other samples are forked off it after this step (see _fork_slot).
                    ext, m = base + [_first(emitted)], n
                    if eligible(params, seq):
                        want = k
                        owners.append((seq, 1))
                    for other in rows[row - reps + 1:row]:
                        self._fork_slots[id(other)] = (other, start + n - 1, hidden[off + n - 1:off + n].clone(),
                                                   self._steps)
            m = max(0, min(m, len(ext) - 1 - start))
            if m:
                positions = list(range(start, start + m))
                tokens, features = ext[start + 1:start + 1 + m], hidden[off:off + m]
                if paths and index in paths:
                    features = hidden[[off + node for node in paths[index][:m]]]
                if fork is not None and self._fork_slot(fork, rows[row - 1], start, n, table):
                    positions = [start - 1] + positions
                    tokens = [base[start]] + tokens
                    features = torch.cat((fork[2], features))
                fills.append((table, positions, tokens, features))
                wants.append(want)
            elif want:
                owners.pop()
            off += n
        self._steps += 1
        if self._fork_slots:  # a sample that never decoded (finished or preempted at once)
            self._fork_slots = {key: v for key, v in self._fork_slots.items() if self._steps - v[3] < 64}
        proposals = eagle.step(fills, wants, tree=self.tree.full) if self.tree is not None else eagle.step(fills, wants)
        drafts = [d for d, w in zip(proposals, wants) if w]
        for (seq, added), d in zip(owners, drafts):
            seq.head_drafts = (seq.num_tokens + added, d)

    def _fork_slot(self, fork: tuple, row: SamplingRow, start: int, n: int, table: list[int]) -> bool:
        """Whether a forked sample's first decode step rewrites the prompt's last slot with its
        own first token (sample 0's is there): only in the sample's own copy of that block, that
        is when the block is not full (a full one stays shared with the other samples and the
        prefix cache, and keeps sample 0's slot: an approximate draft, never a wrong output)."""
        return (fork[0] is row and n == 1 and start == fork[1] + 1 and start % self.block_size != 0
                and start // self.block_size < len(table))

    def _propose(self, scheduled: list, block_tables: list[list[int]],
                 item_rows: list[list[SamplingRow]], spec: list[int]) -> dict[int, list[torch.Tensor | None]]:
        """k batched draft decodes from each sequence's last token (then one more that only writes
        the last draft's K/V); fills spec_token_ids and returns the draft distributions q (None
        for greedy rows)."""
        bs, dev = self.block_size, self.device
        current = {i: scheduled[i].seq.token_ids[scheduled[i].start] for i in spec}
        probs: dict[int, list[torch.Tensor | None]] = {i: [] for i in spec}
        drafts: dict[int, list[int]] = {i: [] for i in spec}
        for j in range(max(scheduled[i].num_spec for i in spec) + 1):
            active = [i for i in spec if scheduled[i].num_spec >= j]
            positions = [scheduled[i].start + j for i in active]
            tables = [block_tables[i] for i in active]
            width = max(len(t) for t in tables)
            table_np = np.zeros((len(active), width), dtype=np.int32)
            for a, t in enumerate(tables):
                table_np[a, :len(t)] = t
            np.maximum(table_np, 0, out=table_np)  # blocks FREED behind a sliding window are never read
            # A replayed decode copies its inputs from the host straight into the graph's static
            # buffers (one copy each); an eager one needs them on the device first.
            graphed = self.draft_graphs is not None and self.draft_graphs.bucket(len(active)) is not None
            at = torch.device("cpu") if graphed else dev
            meta = AttentionMetadata(
                query_start_loc=torch.arange(len(active) + 1, dtype=torch.int32, device=at),
                seq_lens=torch.tensor([pos + 1 for pos in positions], dtype=torch.int32, device=at),
                block_tables=torch.from_numpy(table_np).to(at),
                slot_mapping=torch.tensor([t[pos // bs] * bs + pos % bs for t, pos in zip(tables, positions)],
                                          dtype=torch.long, device=at),
                max_query_len=1,
                max_seq_len=max(positions) + 1,
                is_decode_only=True,
            )
            ids = torch.tensor([current[i] for i in active], dtype=torch.long, device=at)
            pos_t = torch.tensor(positions, dtype=torch.long, device=at)
            hidden = self._draft_forward(ids, pos_t, meta)
            sampling = [a for a, i in enumerate(active) if scheduled[i].num_spec > j]
            if not sampling:
                break
            if len(sampling) < len(active):
                hidden = hidden[torch.tensor(sampling, device=hidden.device)]
            logits = self.draft_model.compute_logits(hidden)
            greedy_tokens = argmax_last(logits).tolist()
            for r, a in enumerate(sampling):
                i = active[a]
                row = item_rows[i][0]
                if row.params.greedy:
                    token, q = greedy_tokens[r], None
                else:
                    q = sampling_probs(logits[r:r + 1], row.params)[0]
                    generator = row.generator if row.generator is not None else self.runner.sampler.generator
                    token = int(torch.multinomial(q, 1, generator=generator).item())
                drafts[i].append(token)
                probs[i].append(q)
                current[i] = token
        for i in spec:
            scheduled[i].seq.spec_token_ids = drafts[i]
        return {i: q for i, q in probs.items() if q and q[0] is not None}
