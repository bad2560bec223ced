"""EAGLE and EAGLE-3 draft heads: one decoder layer fed by the target's own hidden features.

A draft slot at position p pairs the target's feature at p (what gave token p+1) with the
embedding of token p+1, and predicts token p+2. After every target step the sequence's slots for
the positions that step computed are written (their K/V go into the head's own one-layer pools,
indexed by the target's block ids, so prefix-cache hits and copy-on-write copies carry them); the
last slot's output gives the first draft, and k-1 more chain steps each feed the head's own output
back as the next feature. Chain K/V are kept in temporaries only: the next target step writes
those positions with the target's real features, so no block beyond the verified length is ever
written.

Two published layouts load:
- EAGLE-1 (``pytorch_model.bin`` or ``model.safetensors``): ``fc.weight`` [H, 2H] (+ ``fc.bias``)
  over concat(embedding, target's final hidden state), ``layers.0.*`` a Llama decoder layer whose
  input norm is usually absent; logits come from the target's lm_head, with no final norm;
- EAGLE-3: ``fc.weight`` [H, 3H] fusing a low, a middle and a high target layer, ``midlayer.*``
  whose attention reads concat(input_layernorm(embedding), hidden_norm(feature)) [2H], ``norm``,
  its own ``lm_head`` over ``draft_vocab_size`` tokens and ``d2t`` (draft id + d2t[id] = target
  id). Target layers follow vLLM's ``eagle_aux_hidden_state_layer_ids`` (the residual stream
  entering those layers), by default (2, L // 2, L - 3).
A ``model.`` prefix on the names (vLLM-converted checkpoints) is accepted, and an EAGLE-1 file may
carry its own ``lm_head`` over a truncated vocabulary with ``d2t`` (kvserve's trained heads do).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if weight is None:
        return x
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE ([rows, heads, dim]) from the target's cos|sin cache rows."""
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half].to(x.dtype), cos_sin[:, None, half:].to(x.dtype)
    rot = 2 * half
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class EagleHead(nn.Module):
    """The draft layer's weights and its pure forward pieces (no cache management)."""

    def __init__(self, *, eagle3: bool, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, rms_norm_eps: float, fc_bias: bool = False, input_norm: bool = False,
                 num_features: int = 3, draft_vocab_size: int | None = None, dtype=torch.float32,
                 device="cpu") -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        H = hidden_size
        self.eagle3 = eagle3
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = H, num_heads, num_kv_heads, head_dim
        self.eps = rms_norm_eps
        self.num_features = num_features if eagle3 else 1
        self.fc = nn.Linear(H * (num_features if eagle3 else 2), H, bias=fc_bias, **kw)
        attn_in = 2 * H if eagle3 else H
        self.q_proj = nn.Linear(attn_in, num_heads * head_dim, bias=False, **kw)
        self.k_proj = nn.Linear(attn_in, num_kv_heads * head_dim, bias=False, **kw)
        self.v_proj = nn.Linear(attn_in, num_kv_heads * head_dim, bias=False, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, H, bias=False, **kw)
        self.gate_proj = nn.Linear(H, intermediate_size, bias=False, **kw)
        self.up_proj = nn.Linear(H, intermediate_size, bias=False, **kw)
        self.down_proj = nn.Linear(intermediate_size, H, bias=False, **kw)
        self.post_attention_layernorm = nn.Parameter(torch.ones(H, **kw))
        self.input_layernorm = nn.Parameter(torch.ones(H, **kw)) if eagle3 or input_norm else None
        self.hidden_norm = nn.Parameter(torch.ones(H, **kw)) if eagle3 else None
        self.norm = nn.Parameter(torch.ones(H, **kw)) if eagle3 else None
        # Own embedding / head: None means the target's (EAGLE-1 always reads the target's head).
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False, **kw) if draft_vocab_size else None
        self.register_buffer("d2t", None)

    # -- the layer, in pieces (the proposer interleaves them with its cache) -------------------------
    def layer_input(self, embeds: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) from token embeddings and features ([rows, H] for a chain
        step, [rows, H * features] for a target feature, which the fc fuses first)."""
        embeds = embeds.to(self.fc.weight.dtype)
        feature = feature.to(self.fc.weight.dtype)
        if not self.eagle3:
            x = self.fc(torch.cat((embeds, feature), dim=-1))
            return _rms(x, self.input_layernorm, self.eps), x
        if feature.shape[-1] != self.hidden_size:
            feature = self.fc(feature)
        attn_in = torch.cat((_rms(embeds, self.input_layernorm, self.eps), _rms(feature, self.hidden_norm, self.eps)),
                            dim=-1)
        return attn_in, feature

    def qkv(self, attn_in: torch.Tensor, cos_sin: torch.Tensor):
        n = attn_in.shape[0]
        q = _rotate(self.q_proj(attn_in).view(n, self.num_heads, self.head_dim), cos_sin)
        k = _rotate(self.k_proj(attn_in).view(n, self.num_kv_heads, self.head_dim), cos_sin)
        v = self.v_proj(attn_in).view(n, self.num_kv_heads, self.head_dim)
        return q, k, v

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj + MLP with their residuals: the head's output feature (before any final norm)."""
        h = self.o_proj(attn.reshape(attn.shape[0], -1)) + residual
        x = _rms(h, self.post_attention_layernorm, self.eps)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleProposer:
    """A loaded head bound to the target (its embedding, lm_head, rope) with its own K/V pools."""

    def __init__(self, head: EagleHead, target, *, num_blocks: int, block_size: int,
                 aux_layers: tuple[int, ...] = (), model_dir=None) -> None:
        self.head = head
        self.target = target
        # At tensor parallelism the target's embedding and lm_head are sharded and every use is a
        # collective the other ranks would not join; at pipeline parallelism rank 0's stage has
        # no lm_head (the last stage holds it): the head (on rank 0 alone) reads whole copies
        # from the target's checkpoint instead.
        self.full_embed = self.full_head = None
        layer_end = getattr(target, "layer_end", None)  # None: a whole model, no pipeline stages
        split = getattr(target, "tp_size", 1) > 1 or (layer_end is not None and layer_end < target.config.num_layers)
        if split and (head.embed_tokens is None or head.lm_head is None):
            self.full_embed, self.full_head = full_vocab_weights(model_dir, device=head.fc.weight.device,
                                                                 dtype=head.fc.weight.dtype)
        self.block_size = block_size
        self.aux_layers = aux_layers  # EAGLE-3: the target's residual streams it reads (hook numbering)
        dev, dt = head.fc.weight.device, head.fc.weight.dtype
        shape = (num_blocks * block_size, head.num_kv_heads, head.head_dim)
        self.k_pool = torch.zeros(shape, dtype=dt, device=dev)
        self.v_pool = torch.zeros(shape, dtype=dt, device=dev)

    def copy_blocks(self, copies) -> None:
        bs = self.block_size
        for src, dst in copies:
            for pool in (self.k_pool, self.v_pool):
                pool[dst * bs:(dst + 1) * bs] = pool[src * bs:(src + 1) * bs]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.head.embed_tokens is not None:
            return self.head.embed_tokens(tokens)
        if self.full_embed is not None:
            return F.embedding(tokens, self.full_embed)
        return self.target.embed_tokens(tokens)

    def _logits_argmax(self, out: torch.Tensor) -> torch.Tensor:
        head = self.head
        if head.lm_head is None:
            x = out if head.norm is None else _rms(out, head.norm, head.eps)
            if self.full_head is not None:
                return (x.to(self.full_head.dtype) @ self.full_head.T).argmax(-1)
            return self.target.compute_logits(x.to(self.target.dtype)).argmax(-1)
        best = head.lm_head(_rms(out, head.norm, head.eps)).argmax(-1)
        return best + head.d2t[best] if head.d2t is not None else best

    def _logits_topk(self, out: torch.Tensor, k: int) -> torch.Tensor:
        """[rows, k] target token ids, best first (the tree's branches)."""
        head = self.head
        if head.lm_head is None:
            x = out if head.norm is None else _rms(out, head.norm, head.eps)
            if self.full_head is not None:
                return (x.to(self.full_head.dtype) @ self.full_head.T).topk(k, dim=-1).indices
            return self.target.compute_logits(x.to(self.target.dtype)).topk(k, dim=-1).indices
        best = head.lm_head(_rms(out, head.norm, head.eps)).topk(k, dim=-1).indices
        return best + head.d2t[best] if head.d2t is not None else best

    def _slots(self, table: list[int], positions) -> torch.Tensor:
        bs = self.block_size
        t = torch.as_tensor(table, dtype=torch.long).clamp(min=0)
        pos = torch.as_tensor(positions, dtype=torch.long)
        return t[pos // bs] * bs + pos % bs

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One query row [heads, dim] over [ctx, kv_heads, dim] (GQA)."""
        rep = self.head.num_heads // self.head.num_kv_heads
        k = keys.repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, ctx, dim]
        v = values.repeat_interleave(rep, dim=1).transpose(0, 1)
        return F.scaled_dot_product_attention(q[:, None, :], k, v)[:, 0, :]

    @torch.inference_mode()
    def step(self, fills: list[tuple[list[int], list[int], list[int], torch.Tensor]],
             num_drafts: list[int], tree=None) -> list[list[int]]:
        """`fills[i]` = (block table, positions, next tokens, target features [n, F]) of one
        sequence: writes those slots, then proposes `num_drafts[i]` tokens (0: write only), or
        with `tree` (a TreeLayout) the tokens of the tree's nodes 1..T, in node order."""
        head, target = self.head, self.target
        if not fills:
            return []
        positions = torch.tensor([p for f in fills for p in f[1]], dtype=torch.long)
        tokens = torch.tensor([t for f in fills for t in f[2]], dtype=torch.long, device=self.k_pool.device)
        features = torch.cat([f[3] for f in fills])
        slots = torch.cat([self._slots(f[0], f[1]) for f in fills]).to(self.k_pool.device)
        cos_sin = target.cos_sin_cache[positions.to(target.cos_sin_cache.device)]
        attn_in, residual = head.layer_input(self._embed(tokens), features)
        q, k, v = head.qkv(attn_in, cos_sin)
        self.k_pool[slots] = k.to(self.k_pool.dtype)
        self.v_pool[slots] = v.to(self.v_pool.dtype)

        # Only each proposing sequence's last slot needs its output.
        want = [i for i, n in enumerate(num_drafts) if n > 0 and fills[i][1]]
        if not want:
            return [[] for _ in fills]
        ends = torch.tensor([len(f[1]) for f in fills]).cumsum(0) - 1
        ctx = []
        rows = []
        for i in want:
            table, pos = fills[i][0], fills[i][1]
            ctx_slots = self._slots(table, range(pos[-1] + 1)).to(self.k_pool.device)
            ctx.append((self.k_pool[ctx_slots], self.v_pool[ctx_slots]))
            rows.append(int(ends[i]))
        attn = torch.stack([self._attend(q[r], kc, vc) for r, (kc, vc) in zip(rows, ctx)])
        out = head.finish(attn, residual[rows])
        last_pos = [fills[i][1][-1] for i in want]
        if tree is not None:
            nodes = self._grow_tree(tree, out, ctx, last_pos)
            result = [[] for _ in fills]
            for a, i in enumerate(want):
                result[i] = nodes[a]
            return result
        drafts = [[t] for t in self._logits_argmax(out).tolist()]
        for j in range(1, max(num_drafts[i] for i in want)):
            live = [a for a, i in enumerate(want) if num_drafts[i] > j]
            if not live:
                break
            idx = torch.tensor(live)
            tok = torch.tensor([drafts[a][-1] for a in live], dtype=torch.long, device=self.k_pool.device)
            pos = torch.tensor([last_pos[a] + j for a in live], dtype=torch.long)
            attn_in, residual = head.layer_input(self._embed(tok), out[idx])
            q, k, v = head.qkv(attn_in, target.cos_sin_cache[pos.to(target.cos_sin_cache.device)])
            att = []
            for r, a in enumerate(live):
                kc, vc = ctx[a]
                ctx[a] = (torch.cat((kc, k[r:r + 1].to(kc.dtype))), torch.cat((vc, v[r:r + 1].to(vc.dtype))))
                att.append(self._attend(q[r], *ctx[a]))
            new_out = head.finish(torch.stack(att), residual)
            for r, t in enumerate(self._logits_argmax(new_out).tolist()):
                drafts[live[r]].append(t)
            out = out.clone()
            out[idx] = new_out
        result: list[list[int]] = [[] for _ in fills]
        for a, i in enumerate(want):
            result[i] = drafts[a][:num_drafts[i]]
        return result

    def _grow_tree(self, layout, root_out: torch.Tensor, ctx: list, last_pos: list[int]) -> list[list[int]]:
        """Tree drafting (EAGLE-2's expansion over a static tree, vLLM's speculative_token_tree):
        depth by depth, every frontier node that has children runs the layer on (its parent's
        output, its own token) at position last + depth, attending to the sequence's slots and to
        its own ancestors' chain K/V only (the tree mask), and its children are its top-k guesses
        by rank. Returns, per proposing sequence, the tokens of nodes 1..T."""
        head, target = self.head, self.target
        W, n = root_out.shape[0], layout.num_nodes
        tokens = torch.zeros(W, n, dtype=torch.long)
        outs = {0: root_out}
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        dev = self.k_pool.device

        def branch(nodes: list[int]) -> None:
            """Fills the children's tokens of `nodes` (whose outputs are known)."""
            for node in nodes:
                children = layout.children[node]
                top = self._logits_topk(outs[node], 1 + max(layout.ranks[c] for c in children)).cpu()
                for c in children:
                    tokens[:, c] = top[:, layout.ranks[c]]

        branch([0])
        for depth in range(1, layout.depth):
            level = [c for c in range(n) if layout.depths[c] == depth and layout.children[c]]
            if not level:
                break
            tok = tokens[:, level].T.reshape(-1).to(dev)  # rows node-major: (node, sequence)
            feature = torch.cat([outs[layout.parents[c]] for c in level])
            pos = torch.tensor([p + depth for p in last_pos] * len(level), dtype=torch.long)
            attn_in, residual = head.layer_input(self._embed(tok), feature)
            q, k, v = head.qkv(attn_in, target.cos_sin_cache[pos.to(target.cos_sin_cache.device)])
            att = []
            for j, c in enumerate(level):
                kv[c] = (k[j * W:(j + 1) * W], v[j * W:(j + 1) * W])
                path = []
                a = c
                while a > 0:
                    path.append(a)
                    a = layout.parents[a]
                path.reverse()
                for w in range(W):
                    kc, vc = ctx[w]
                    keys = torch.cat([kc] + [kv[a][0][w:w + 1].to(kc.dtype) for a in path])
                    values = torch.cat([vc] + [kv[a][1][w:w + 1].to(vc.dtype) for a in path])
                    att.append(self._attend(q[j * W + w], keys, values))
            new_out = head.finish(torch.stack(att), residual)
            for j, c in enumerate(level):
                outs[c] = new_out[j * W:(j + 1) * W]
            branch(level)
        return tokens[:, 1:].tolist()


def full_vocab_weights(model_dir, *, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, lm_head) of the target, whole, from its safetensors (tied: one tensor)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                if name in f.keys():
                    found[name] = f.get_tensor(name).to(device, dtype)
    if "model.embed_tokens.weight" not in found:
        raise ValueError("speculative_config.model: at tensor_parallel_size or pipeline_parallel_size > 1 an "
                         "EAGLE head without its own embedding and lm_head needs the target's unquantized "
                         "safetensors (model.embed_tokens.weight)")
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed)


# -- checkpoints ----------------------------------------------------------------------------------------
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "q_proj", "self_attn.k_proj.weight": "k_proj", "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj", "mlp.gate_proj.weight": "gate_proj", "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
_NORMS = ("input_layernorm", "post_attention_layernorm", "hidden_norm")


def _read(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").is_file():
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"speculative_config.model: {str(path)!r} has no model.safetensors or pytorch_model.bin")
    return {k.removeprefix("model."): v for k, v in tensors.items()}


def _checkpoint_tensors(head, prefix: str) -> dict:
    """The head's tensors under their checkpoint names (what loading fills and saving writes)."""
    out = {"fc.weight": head.fc.weight}
    if head.fc.bias is not None:
        out["fc.bias"] = head.fc.bias
    for name, attr in _LAYER_NAMES.items():
        out[prefix + name] = getattr(head, attr).weight
    for norm in _NORMS:
        if getattr(head, norm) is not None:
            out[f"{prefix}{norm}.weight"] = getattr(head, norm)
    if head.norm is not None:
        out["norm.weight"] = head.norm
    if head.lm_head is not None:
        out["lm_head.weight"] = head.lm_head.weight
    return out


def load_eagle_head(path, *, method: str, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[EagleHead, tuple[int, ...]]:
    """(head, the target layers EAGLE-3 reads in vLLM's numbering) from a directory, checked
    against the target; bad layouts raise ValueError naming speculative_config.model."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"speculative_config.model: {str(path)!r} is not a directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config.model: config.json unreadable ({exc})") from None
    t = _read(path)
    eagle3 = method == "eagle3"
    prefix = "midlayer." if eagle3 else "layers.0."
    if "fc.weight" not in t or f"{prefix}self_attn.q_proj.weight" not in t:
        other = "layers.0.*" if eagle3 else "midlayer.*"
        hint = f" (it looks like the other layout, {other})" if any(k.startswith(other[:-1]) for k in t) else ""
        raise ValueError(f"speculative_config.model: no {method} head in {str(path)!r}: expected fc.weight and "
                         f"{prefix}* tensors{hint}")
    H = t["fc.weight"].shape[0]
    if H != hidden_size:
        raise ValueError(f"speculative_config.model: the head's hidden size is {H}, the target's {hidden_size}")
    num_heads = int(config.get("num_attention_heads", 0)) or None
    if num_heads is None:
        raise ValueError("speculative_config.model: config.json lacks num_attention_heads")
    head_dim = int(config.get("head_dim") or H // num_heads)
    num_kv = t[f"{prefix}self_attn.k_proj.weight"].shape[0] // head_dim
    features = t["fc.weight"].shape[1] // H
    # EAGLE-3's own head over a truncated vocabulary; an EAGLE-1 file may carry one too (with
    # d2t; our trained heads do, to keep each draft's projection small on a CPU).
    draft_vocab = t["lm_head.weight"].shape[0] if "lm_head.weight" in t else None
    head = EagleHead(eagle3=eagle3, hidden_size=H, num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim,
                     intermediate_size=t[f"{prefix}mlp.gate_proj.weight"].shape[0],
                     rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), fc_bias="fc.bias" in t,
                     input_norm=f"{prefix}input_layernorm.weight" in t, num_features=features,
                     draft_vocab_size=draft_vocab, dtype=dtype, device=device)
    want = _checkpoint_tensors(head, prefix)
    with torch.no_grad():
        for name, param in want.items():
            if name not in t:
                raise ValueError(f"speculative_config.model: tensor {name!r} missing")
            if tuple(t[name].shape) != tuple(param.shape):
                raise ValueError(f"speculative_config.model: tensor {name!r} has shape {tuple(t[name].shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.copy_(t[name])
        if "embed_tokens.weight" in t:
            emb = t["embed_tokens.weight"]
            if emb.shape != (vocab_size, H):
                raise ValueError(f"speculative_config.model: embed_tokens has shape {tuple(emb.shape)}, the target's "
                                 f"is {(vocab_size, H)}")
            head.embed_tokens = nn.Embedding(vocab_size, H, _weight=emb.to(device, dtype))
    if draft_vocab is not None:
        if "d2t" in t:
            d2t = t["d2t"].to(torch.long)
            if d2t.shape != (draft_vocab,):
                raise ValueError(f"speculative_config.model: d2t must hold {draft_vocab} offsets")
            ids = torch.arange(draft_vocab) + d2t
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise ValueError(f"speculative_config.model: d2t maps outside the target's {vocab_size} tokens")
            head.d2t = d2t.to(device)
        elif draft_vocab != vocab_size:
            raise ValueError(f"speculative_config.model: the head's vocabulary is {draft_vocab} tokens, the "
                             f"target's {vocab_size}, and there is no d2t map")
    aux: tuple[int, ...] = ()
    if eagle3:
        ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        aux = tuple(int(i) for i in ids) if ids else ()
        if aux and len(aux) != features:
            raise ValueError(f"speculative_config.model: {len(aux)} aux layers for an fc over {features} features")
    return head.eval().requires_grad_(False), aux


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's EAGLE-3 default: the residual streams entering layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def aux_hook_layers(ids: tuple[int, ...]) -> tuple[int, ...]:
    """The target's aux_hidden_layers for vLLM-numbered ids: the stream entering layer i is
    the output of layer i - 1."""
    return tuple(sorted({i - 1 for i in ids}))


def eagle3_target_layers(config, num_layers: int) -> tuple[int, ...]:
    """What every rank's target model keeps for an EAGLE-3 head (read from the head's
    config.json only), so that at tensor parallelism every rank takes the same forward path
    (keeping layers turns the native decode stack off). Empty for other methods or an
    unreadable directory (rank 0's full load then reports the problem)."""
    spec = getattr(config, "speculative_config", None)
    if spec is None or spec.method != "eagle3":
        return ()
    try:
        cfg = json.loads((Path(spec.model) / "config.json").read_text())
    except (OSError, ValueError):
        return ()
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_layers)
    ids = tuple(int(i) for i in ids)
    return aux_hook_layers(ids) if min(ids) >= 1 and max(ids) <= num_layers else ()


def save_eagle_head(head: EagleHead, path, *, base_config: dict, aux_layers: tuple[int, ...] = ()) -> Path:
    """Writes the published layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    prefix = "midlayer." if head.eagle3 else "layers.0."
    out = _checkpoint_tensors(head, prefix)
    if head.d2t is not None:
        out["d2t"] = head.d2t
    save_file({k: v.detach().contiguous().cpu() for k, v in out.items()}, str(path / "model.safetensors"))
    config = dict(base_config, num_attention_heads=head.num_heads, num_key_value_heads=head.num_kv_heads,
                  head_dim=head.head_dim, hidden_size=head.hidden_size, num_hidden_layers=1,
                  architectures=["LlamaForCausalLMEagle3" if head.eagle3 else "EagleLlamaForCausalLM"])
    if head.lm_head is not None:
        config["draft_vocab_size"] = head.lm_head.out_features
    if aux_layers:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
