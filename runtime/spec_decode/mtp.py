"""DeepSeek-V3's multi-token prediction (MTP) layer as a speculative proposer (vLLM's ``mtp``).

A checkpoint with ``num_nextn_predict_layers`` > 0 keeps its MTP module after the decoder layers,
at layer index ``num_hidden_layers``, under the published names::

    model.layers.{L}.enorm.weight, hnorm.weight        RMSNorms of the embedding and the feature
    model.layers.{L}.eh_proj.weight                    [H, 2H], no bias
    model.layers.{L}.self_attn.*, mlp.*, *_layernorm   one decoder block (MLA, MoE from its gate)
    model.layers.{L}.shared_head.norm.weight           the final norm before the head
    model.layers.{L}.shared_head.head.weight           the output head (optional: the target's)
    model.layers.{L}.embed_tokens.weight               the embedding (optional: the target's)

The slot at position p pairs the target's feature h_p (its final, normed hidden state: what gave
token p+1) with the embedding of token p+1 and predicts token p+2:

    x   = eh_proj([enorm(emb(t_{p+1})) ; hnorm(h_p)])
    out = block(x) + x                   (the block's output plus its residual stream)
    p(t_{p+2}) = softmax(head(shared_head.norm(out)))

As in vLLM, the embedding at position 0 is zeroed. Further drafts feed `out` back as the next
feature (one MTP layer chained k times, vLLM's reuse of the first layer).

Other families: the block is the target family's own decoder layer, so the same layout serves a
GQA model too (GLM-4.5's MoE keeps its MTP module under these names), with K and V pools instead
of the latent one. MiMo (Xiaomi's Qwen2-architecture MiMo-7B, `MiMoForCausalLM`, served as Qwen2)
keeps its MTP module under its own names, mapped at load::

    model.mtp_layers.0.token_layernorm   -> enorm        model.mtp_layers.0.hidden_layernorm -> hnorm
    model.mtp_layers.0.input_proj        -> eh_proj      (MiMo concatenates [feature ; embedding]:
                                                          its column halves are swapped into
                                                          DeepSeek's [embedding ; feature] order)
    model.mtp_layers.0.final_layernorm   -> shared_head.norm   (the head is the target's)
    model.mtp_layers.0.{input_layernorm, post_attention_layernorm, self_attn.*, mlp.*}: the block

The block's K/V (DeepSeek: latents) live in pools of the MTP's own, indexed by the target's block ids
(prefix-cache hits and copy-on-write copies carry them), written for every position a target
step computed and kept (the same fills as EAGLE's: spec_decode/worker.py). Chain drafts past
the verified length must not touch blocks the sequence may not own: they run on scratch blocks
past the pool's shared part (the partial last block copied there first), so the paged MLA
attention of the target's own code serves both the fills and the chain. A tree
(``speculative_token_tree``) runs each node's root-to-node path as one causal chunk on its own
scratch set, which is the tree mask without a tree-masked draft attention.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from kvserve.kernels import ops
from kvserve.runtime.attention.backend import AttentionMetadata

# The MTP module's own tensors (besides its decoder block's), under model.layers.{L}.
_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
_OPTIONAL = ("shared_head.head.weight", "embed_tokens.weight")


def mtp_layer_count(hf_config: dict) -> int:
    return int(hf_config.get("num_nextn_predict_layers") or 0)


# MiMo's names for the MTP module's own tensors -> DeepSeek's (its block's names are the same).
_MIMO_PREFIX = "model.mtp_layers.0."
_MIMO_NAMES = {"token_layernorm.weight": "enorm.weight", "hidden_layernorm.weight": "hnorm.weight",
               "input_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}


def _from_mimo(tensors: dict[str, torch.Tensor], pre: str) -> dict[str, torch.Tensor]:
    """MiMo's first MTP module under DeepSeek's names at `pre` (model.layers.{L}.)."""
    out = {}
    for name, t in tensors.items():
        rest = name[len(_MIMO_PREFIX):]
        if rest == "input_proj.weight":  # [feature ; embedding] -> [embedding ; feature]
            h = t.shape[1] // 2
            t = torch.cat((t[:, h:], t[:, :h]), dim=1)
        out[pre + _MIMO_NAMES.get(rest, rest)] = t
    return out


def _block_supported(cfg) -> str | None:
    """Why the target family's decoder layer cannot be an MTP block, or None."""
    if cfg.shape.mla is not None:
        return None
    if cfg.gemma_norms or cfg.layer_norms or cfg.falcon_parallel or cfg.alibi_bias_max is not None:
        return (f"{cfg.architecture}'s decoder layers (sandwich norms, LayerNorms, ALiBi or parallel "
                "attention) have no published MTP layout")
    return None


class MTPLayer(nn.Module):
    """enorm, hnorm, eh_proj, the decoder block and shared_head of one MTP module."""

    def __init__(self, cfg, backend, *, moe: bool, dtype: torch.dtype, device, quant_config=None) -> None:
        super().__init__()
        from kvserve.runtime.models.llama import DecoderLayer

        L = cfg.num_layers
        H = cfg.hidden_size
        block_cfg = cfg
        shape = cfg.shape
        if shape.moe is not None:  # the block is an expert layer when its checkpoint has a router
            layers = tuple(i for i in shape.moe.moe_layers if i != L) + ((L,) if moe else ())
            block_cfg = dataclasses.replace(cfg, shape=dataclasses.replace(
                shape, moe=dataclasses.replace(shape.moe, moe_layers=layers)))
        elif moe:
            raise ValueError("speculative_config: the MTP layer has an expert router but the model has no experts")
        # The block runs whole on rank 0 (tp_size 1) at any tensor-parallel degree: its weights
        # come unsharded from the checkpoint, so it needs no collectives.
        self.block = DecoderLayer(block_cfg, backend, layer=L, tp_rank=0, tp_size=1, dtype=dtype,
                                  device=torch.device(device), quant_config=quant_config)
        kw = dict(dtype=dtype, device=device)
        self.enorm = nn.Parameter(torch.ones(H, **kw), requires_grad=False)
        self.hnorm = nn.Parameter(torch.ones(H, **kw), requires_grad=False)
        self.eh_proj = nn.Parameter(torch.zeros(H, 2 * H, **kw), requires_grad=False)
        self.shared_norm = nn.Parameter(torch.ones(H, **kw), requires_grad=False)
        self.head: torch.Tensor | None = None  # [vocab, H]; None: the target's
        self.embed: torch.Tensor | None = None
        self.eps = cfg.rms_norm_eps
        self.index = L
        self.hidden_size = H

    def fuse(self, embeds: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """eh_proj([enorm(embedding) ; hnorm(feature)])."""
        e = ops.rms_norm(embeds.to(self.eh_proj.dtype).contiguous(), self.enorm, self.eps)
        h = ops.rms_norm(feature.to(self.eh_proj.dtype).contiguous(), self.hnorm, self.eps)
        return F.linear(torch.cat((e, h), dim=-1), self.eh_proj)

    def run_block(self, positions, x, pools, meta, cos_sin) -> torch.Tensor:
        hidden, residual = self.block(positions, x, None, pools, meta, cos_sin)
        return hidden + residual

    def normed(self, out: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(out.contiguous(), self.shared_norm, self.eps)

    def checkpoint_params(self) -> dict[str, tuple[torch.Tensor, object]]:
        pre = f"model.layers.{self.index}."
        out: dict[str, tuple[torch.Tensor, object]] = {}
        block = self.block
        out.update(block.self_attn.checkpoint_params(f"{pre}self_attn."))
        out.update(block.mlp.checkpoint_params(pre + block.mlp_prefix))
        for name in block.norm_names:
            out[f"{pre}{name}.weight"] = (getattr(block, name).weight, None)
        return out


def _checkpoint_files(model_dir: Path) -> list[Path]:
    from kvserve.runtime.models.loader import checkpoint_files

    try:
        return checkpoint_files(model_dir)
    except ValueError as exc:
        raise ValueError(f"speculative_config.{exc}") from None


def load_mtp_layer(model_dir, cfg, backend, *, dtype: torch.dtype, device, quant_config=None) -> MTPLayer:
    """The first MTP module of a checkpoint (the target's own directory, or a separate one with
    the same names), checked; problems raise ValueError naming speculative_config."""
    from safetensors import safe_open

    from kvserve.runtime.models.layers import LinearBase
    from kvserve.runtime.models.quantization import QuantizationConfig, resolve_quantization

    if not isinstance(quant_config, QuantizationConfig):  # a format name, or the checkpoint's own
        quant_config = resolve_quantization(quant_config, cfg.hf_config)
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"speculative_config.model: {str(model_dir)!r} is not a directory")
    L = cfg.num_layers
    why = _block_supported(cfg)
    if why is not None:
        raise ValueError(f"speculative_config.method: 'mtp' needs a DeepSeek-V3, GLM-4.5 or MiMo-style MTP "
                         f"layer; {why}")
    try:
        own_config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        own_config = {}
    if own_config and not mtp_layer_count(own_config) and not mtp_layer_count(cfg.hf_config):
        raise ValueError(f"speculative_config.method: {str(model_dir)!r} has no MTP layer "
                         "(config.json: num_nextn_predict_layers is 0 or absent)")
    pre = f"model.layers.{L}."
    tensors: dict[str, torch.Tensor] = {}
    mimo: dict[str, torch.Tensor] = {}
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.startswith(pre):
                    tensors[name] = f.get_tensor(name)
                elif name.startswith(_MIMO_PREFIX):
                    mimo[name] = f.get_tensor(name)
    if not tensors and mimo:
        tensors = _from_mimo(mimo, pre)
    if not tensors:
        raise ValueError(f"speculative_config.model: no MTP weights (model.layers.{L}.* or {_MIMO_PREFIX}*) in "
                         f"{str(model_dir)!r}")
    missing = [pre + n for n in _OWN if pre + n not in tensors]
    if missing:
        raise ValueError(f"speculative_config.model: the MTP layer lacks {', '.join(missing)}")
    layer = MTPLayer(cfg, backend, moe=f"{pre}mlp.gate.weight" in tensors, dtype=dtype, device=device,
                     quant_config=quant_config)
    H, V = cfg.hidden_size, cfg.vocab_size
    targets = layer.checkpoint_params()
    loaded = set()
    with torch.no_grad():
        for name, param in (("enorm.weight", layer.enorm), ("hnorm.weight", layer.hnorm),
                            ("eh_proj.weight", layer.eh_proj), ("shared_head.norm.weight", layer.shared_norm)):
            t = tensors.pop(pre + name)
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(f"speculative_config.model: {pre}{name} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.copy_(t)
        for name, attr in (("shared_head.head.weight", "head"), ("embed_tokens.weight", "embed")):
            t = tensors.pop(pre + name, None)
            if t is None:
                continue
            if tuple(t.shape) != (V, H):
                raise ValueError(f"speculative_config.model: {pre}{name} has shape {tuple(t.shape)}, "
                                 f"expected {(V, H)}")
            setattr(layer, attr, t.to(device, dtype))
        for name, t in tensors.items():
            if name not in targets:
                raise ValueError(f"speculative_config.model: unexpected MTP tensor {name}")
            param, shard = targets[name]
            param.weight_loader(param, t.to(dtype=getattr(param, "load_dtype", param.dtype)), shard)
            loaded.add(name)
        lacking = sorted(n for n in set(targets) - loaded if not getattr(targets[n][0], "optional", False))
        if lacking:
            raise ValueError(f"speculative_config.model: the MTP layer lacks {', '.join(lacking[:5])}")
        for module in layer.modules():
            if isinstance(module, LinearBase):
                module.process_weights_after_loading()
    return layer.eval()


class MTPProposer:
    """A loaded MTP layer bound to the target (RoPE, and its embedding / head where the layer
    has none of its own), with its own KV pools (one latent pool for MLA, K and V otherwise);
    `step` has EagleProposer's contract."""

    aux_layers: tuple[int, ...] = ()  # reads the target's final hidden state only

    def __init__(self, layer: MTPLayer, target, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 num_speculative_tokens: int, model_dir=None) -> None:
        self.layer = layer
        self.target = target
        self.block_size = block_size
        self.num_blocks = num_blocks
        dev, dt = layer.eh_proj.device, layer.eh_proj.dtype
        # Share the target's embedding / head when the checkpoint's copies equal them (DeepSeek-V3
        # stores the same tensors twice); at tensor parallelism the target's are sharded, and at
        # pipeline parallelism rank 0's stage has no head (the last stage holds it), so the layer
        # keeps whole copies (its own, or the target checkpoint's).
        tp = getattr(target, "tp_size", 1)
        layer_end = getattr(target, "layer_end", None)  # None: a whole model, no pipeline stages
        staged = layer_end is not None and layer_end < target.config.num_layers
        if tp == 1 and not staged:
            # Compared through what the target computes with them (its weights may be repacked
            # for a kernel or quantized): the whole embedding table, and the head on a few probes.
            with torch.inference_mode():
                if layer.embed is not None:
                    ids = torch.arange(layer.embed.shape[0], device=dev)
                    if torch.equal(target.embed_tokens(ids).to(dt), layer.embed):
                        layer.embed = None
                if layer.head is not None:
                    probe = torch.randn(4, layer.hidden_size, generator=torch.Generator().manual_seed(0)).to(dev, dt)
                    theirs = target.compute_logits(probe.to(target.dtype))
                    if torch.allclose(theirs, (probe @ layer.head.T).float(), rtol=1e-3, atol=1e-4):
                        layer.head = None
        elif layer.embed is None or layer.head is None:
            from kvserve.runtime.spec_decode.eagle import full_vocab_weights

            embed, head = full_vocab_weights(model_dir, device=dev, dtype=dt)
            layer.embed = embed if layer.embed is None else layer.embed
            layer.head = head if layer.head is None else layer.head
        # Chain drafts run on scratch blocks: per proposing sequence, its partial last block and
        # the blocks the k - 1 chain positions may reach.
        self.per_seq = 1 + -(-max(0, num_speculative_tokens - 1) // block_size)
        self.capacity = max(1, max_num_seqs)
        # The block runs at tp 1 whatever the target's degree: the whole layer's KV heads.
        count, heads, width = target.config.shape.kv_cache_layout(1)
        self.pools = tuple(torch.zeros((num_blocks + self.capacity * self.per_seq, block_size, heads, width),
                                       dtype=dt, device=dev) for _ in range(count))
        self.pool = self.pools[0]

    def copy_blocks(self, copies) -> None:
        for src, dst in copies:
            for pool in self.pools:
                pool[dst] = pool[src]

    # -- pieces ----------------------------------------------------------------------------------------
    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.layer.embed is not None:
            return F.embedding(tokens, self.layer.embed)
        return self.target.embed_tokens(tokens)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        x = self.layer.normed(out)
        if self.layer.head is not None:
            return x @ self.layer.head.T
        return self.target.compute_logits(x.to(self.target.dtype))

    def _argmax(self, out: torch.Tensor) -> list[int]:
        return self._logits(out).argmax(-1).tolist()

    def _topk(self, out: torch.Tensor, k: int) -> torch.Tensor:
        """[rows, k] token ids, best first (a tree node's children by rank)."""
        return self._logits(out).topk(k, dim=-1).indices

    def _forward(self, tables: list[list[int]], starts: list[int], counts: list[int], tokens: torch.Tensor,
                 features: torch.Tensor) -> torch.Tensor:
        """The layer over packed rows: sequence i's `counts[i]` positions from `starts[i]`,
        whose slots its block table `tables[i]` addresses."""
        dev, bs = self.pool.device, self.block_size
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
        width = max(len(t) for t in tables)
        table = torch.zeros((len(tables), width), dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.as_tensor(t, dtype=torch.int32)
        table.clamp_(min=0)  # padding of blocks freed behind a window is never read
        seq_ids = torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(counts))
        slots = table[seq_ids, positions // bs].long() * bs + positions % bs
        ends = [s + n for s, n in zip(starts, counts)]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0] + list(torch.tensor(counts).cumsum(0).tolist()), dtype=torch.int32,
                                         device=dev),
            seq_lens=torch.tensor(ends, dtype=torch.int32, device=dev), block_tables=table.to(dev),
            slot_mapping=slots.to(dev), max_query_len=max(counts), max_seq_len=max(ends),
            is_decode_only=all(n == 1 for n in counts))
        embeds = self._embed(tokens.to(dev))
        embeds = embeds.masked_fill((positions == 0).to(dev)[:, None], 0)  # vLLM: position 0 sees no token
        x = self.layer.fuse(embeds, features)
        pos = positions.to(dev)
        return self.layer.run_block(pos, x, self.pools, meta, self.target.cos_sin_cache)

    @torch.inference_mode()
    def step(self, fills: list[tuple[list[int], list[int], list[int], torch.Tensor]],
             num_drafts: list[int], tree=None) -> list[list[int]]:
        """`fills[i]` = (block table, positions (consecutive), next tokens, target features) of
        one sequence: writes those slots, then proposes `num_drafts[i]` tokens (0: write only),
        or with `tree` (a TreeLayout) the tokens of the tree's nodes 1..T, in node order."""
        if not fills:
            return []
        tokens = torch.tensor([t for f in fills for t in f[2]], dtype=torch.long)
        out = self._forward([f[0] for f in fills], [f[1][0] for f in fills], [len(f[1]) for f in fills], tokens,
                            torch.cat([f[3] for f in fills]))
        want = [i for i, n in enumerate(num_drafts) if n > 0 and fills[i][1]]
        result: list[list[int]] = [[] for _ in fills]
        if not want:
            return result
        ends = torch.tensor([len(f[1]) for f in fills]).cumsum(0) - 1
        last = out[ends[want].to(out.device)]
        if tree is not None:
            for a, nodes in enumerate(self._grow_tree(fills, want, tree, last)):
                result[want[a]] = nodes
            return result
        for a, t in enumerate(self._argmax(last)):
            result[want[a]].append(t)
        for group in range(0, len(want), self.capacity):
            members = want[group:group + self.capacity]
            self._chain(fills, members, num_drafts, last[group:group + len(members)], result)
        return result

    def _chain(self, fills, members, num_drafts, feature, result) -> None:
        """Drafts 2..k of the `members` sequences, each on its own scratch blocks."""
        k = max(num_drafts[i] for i in members)
        if k < 2:
            return
        tables, first = [], []
        for a, i in enumerate(members):
            table, p = self._scratch(fills[i], a)
            tables.append(table)
            first.append(p)
        live = list(range(len(members)))
        for j in range(1, k):
            live = [a for a in live if num_drafts[members[a]] > j]
            if not live:
                break
            tok = torch.tensor([result[members[a]][-1] for a in live], dtype=torch.long)
            out = self._forward([tables[a] for a in live], [first[a] + j - 1 for a in live], [1] * len(live), tok,
                                feature[live])
            for r, t in enumerate(self._argmax(out)):
                result[members[live[r]]].append(t)
            feature = feature.clone()
            feature[live] = out

    def _scratch(self, fill, a: int) -> tuple[list[int], int]:
        """(block table, first draft position) of a draft run on scratch set `a` (< capacity):
        the sequence's blocks up to its partial last one, whose earlier slots (context) are
        copied into the set's first scratch block, then the set's blocks."""
        table, p = fill[0], fill[1][-1] + 1
        scratch = [self.num_blocks + a * self.per_seq + b for b in range(self.per_seq)]
        b0 = p // self.block_size
        if b0 < len(table) and table[b0] >= 0:
            for pool in self.pools:
                pool[scratch[0]] = pool[table[b0]]
        return list(table[:b0]) + scratch, p

    def _grow_tree(self, fills, want: list[int], layout, root_out: torch.Tensor) -> list[list[int]]:
        """Tree drafting (as EagleProposer._grow_tree): the root's top-k give depth 1; then, depth
        by depth, every node with children runs the layer at position last + depth and its
        children are its top-k by rank. A node must see the sequence and its own ancestors only:
        each (sequence, node) pair runs its whole root-to-node path as one causal chunk on its
        own scratch blocks, so the paged attention's causal mask is the tree mask. The path's
        earlier rows recompute what that node's ancestors already computed (a few rows per
        node), which keeps the layer's own paged MLA / GQA attention the only attention code.
        Returns, per proposing sequence, the tokens of nodes 1..T."""
        W, n = root_out.shape[0], layout.num_nodes
        tokens = torch.zeros(W, n, dtype=torch.long)
        outs = {0: root_out}

        def branch(nodes: list[int]) -> None:
            for node in nodes:
                children = layout.children[node]
                top = self._topk(outs[node], 1 + max(layout.ranks[c] for c in children)).cpu()
                for c in children:
                    tokens[:, c] = top[:, layout.ranks[c]]

        def path(c: int) -> list[int]:
            nodes = []
            while c > 0:
                nodes.append(c)
                c = layout.parents[c]
            return nodes[::-1]

        branch([0])
        for depth in range(1, layout.depth):
            level = [c for c in range(n) if layout.depths[c] == depth and layout.children[c]]
            if not level:
                break
            pairs = [(c, a) for c in level for a in range(W)]
            new: dict[tuple[int, int], torch.Tensor] = {}
            for g in range(0, len(pairs), self.capacity):
                group = pairs[g:g + self.capacity]
                tables, starts, toks, feats = [], [], [], []
                for slot, (c, a) in enumerate(group):
                    table, p = self._scratch(fills[want[a]], slot)
                    tables.append(table)
                    starts.append(p)
                    nodes = path(c)
                    toks.append(tokens[a, nodes])
                    feats += [outs[layout.parents[x]][a:a + 1] for x in nodes]
                out = self._forward(tables, starts, [depth] * len(group), torch.cat(toks), torch.cat(feats))
                for r, pair in enumerate(group):
                    new[pair] = out[(r + 1) * depth - 1]
            for c in level:
                outs[c] = torch.stack([new[(c, a)] for a in range(W)])
            branch(level)
        return tokens[:, 1:].tolist()
