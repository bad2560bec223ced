"""An EAGLE head for a real model, trained on CPU from the model's own greedy answers.

The data are Medusa's (testing/spec_heads.py `dataset`: the model's answers and its final-norm
hidden states at every answer position, cached under build/spec-heads/). The head is EAGLE-1's
layout: fc(concat(embedding of token p+1, hidden state at p)) into one decoder layer initialised
from the target's last layer. Run causally over each answer with teacher forcing, its output at p
learns both the target's next feature h[p+1] (smooth L1, EAGLE's regression) and the token at
p+2 (cross-entropy). Its projection is the target's lm_head restricted to the tokens the answers
use most, frozen, with a `d2t` map back to target ids: on a CPU a full-vocabulary projection per
draft costs about a fifth of a SmolLM2 decode step, the truncated one a thirtieth.

`ensure_eagle_head(model_dir)` trains once and caches the result under
`build/spec-heads/<model>-<digest>-eagle-v<vocab>/`; `scripts/train_eagle_head.py` is the
command-line form.
"""

from __future__ import annotations

import json
import pathlib
import time

import torch
from torch.nn import functional as F

from kvserve.testing.realmodel import REPO_ROOT
from kvserve.testing.spec_heads import _weights_digest, dataset, prompts


def _causal(head, x_embed, feats, cos_sin):
    """The head over [B, n] rows at once (teacher forcing): outputs [B, n, H]."""
    B, n, H = feats.shape
    attn_in, residual = head.layer_input(x_embed.reshape(B * n, H), feats.reshape(B * n, H))
    q, k, v = head.qkv(attn_in, cos_sin.repeat(B, 1))
    q = q.view(B, n, head.num_heads, -1).transpose(1, 2)
    rep = head.num_heads // head.num_kv_heads
    k = k.view(B, n, head.num_kv_heads, -1).transpose(1, 2).repeat_interleave(rep, dim=1)
    v = v.view(B, n, head.num_kv_heads, -1).transpose(1, 2).repeat_interleave(rep, dim=1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B * n, -1)
    return head.finish(attn, residual).view(B, n, H)


def train(model_dir, out_dir, *, vocab: int = 8192, questions: int = 240, max_tokens: int = 160, epochs: int = 3,
          seed: int = 0, log=print) -> dict:
    """Trains and saves an EAGLE-1 head; returns what was measured (losses, held-out top-1)."""
    from safetensors.torch import load_file

    from kvserve.runtime.model_config import ModelConfig
    from kvserve.runtime.models.rope import rope_cos_sin_cache
    from kvserve.runtime.spec_decode.eagle import EagleHead, save_eagle_head

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    hidden, tokens = dataset(model_dir, prompts(questions), max_tokens)
    t1 = time.perf_counter()
    model_dir = pathlib.Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    mcfg = ModelConfig.from_pretrained(str(model_dir))
    weights = load_file(str(model_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"].float()
    lm_head = weights.get("lm_head.weight", embed).float()
    H = embed.shape[1]
    last = f"model.layers.{cfg['num_hidden_layers'] - 1}."
    nh = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or H // nh
    head = EagleHead(eagle3=False, hidden_size=H, num_heads=nh, num_kv_heads=cfg.get("num_key_value_heads", nh),
                     head_dim=head_dim, intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg["rms_norm_eps"],
                     fc_bias=True, draft_vocab_size=vocab)

    # Sequences as rows: row j of sequence s is position p = j (relative: RoPE sees only offsets).
    seqs, r = [], 0
    for toks in tokens:
        seqs.append((hidden[r:r + len(toks)], torch.tensor(toks)))
        r += len(toks)
    counts = torch.bincount(torch.cat([t[2:] for _, t in seqs]), minlength=embed.shape[0])
    vocab = min(vocab, int((counts > 0).sum()))
    token_map = torch.sort(torch.topk(counts.float(), vocab).indices).values
    to_row = torch.full((embed.shape[0],), -100, dtype=torch.long)
    to_row[token_map] = torch.arange(vocab)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(head, name).weight.copy_(weights[f"{last}self_attn.{name}.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(head, name).weight.copy_(weights[f"{last}mlp.{name}.weight"])
        head.post_attention_layernorm.copy_(weights[f"{last}post_attention_layernorm.weight"])
        head.fc.weight.zero_()
        head.fc.weight[:, H:] = torch.eye(H)  # start from "the feature passes through"
        head.fc.weight[:, :H].normal_(0, 0.01)
        head.fc.bias.zero_()
        head.lm_head = torch.nn.Linear(H, vocab, bias=False)
        head.lm_head.weight.copy_(lm_head[token_map])
    head.lm_head.weight.requires_grad_(False)
    head.d2t = token_map - torch.arange(vocab)
    cos_sin_all = rope_cos_sin_cache(mcfg, max_tokens + 8)

    order = torch.randperm(len(seqs)).tolist()
    held, train_ids = order[: len(seqs) // 10], order[len(seqs) // 10:]

    def batch_tensors(ids):
        n = max(len(seqs[i][1]) for i in ids) - 2
        feats = torch.zeros(len(ids), n, H)
        nxt = torch.zeros(len(ids), n, dtype=torch.long)
        want_h = torch.zeros(len(ids), n, H)
        label = torch.full((len(ids), n), -100, dtype=torch.long)
        mask = torch.zeros(len(ids), n)
        for b, i in enumerate(ids):
            h, t = seqs[i]
            m = len(t) - 2
            feats[b, :m], nxt[b, :m], want_h[b, :m] = h[:m], t[1:m + 1], h[1:m + 1]
            label[b, :m] = to_row[t[2:m + 2]]
            mask[b, :m] = 1
        return feats, nxt, want_h, label, mask, cos_sin_all[:n]

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    bs = 8
    steps = epochs * (len(train_ids) // bs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=max(1, steps))
    losses = []
    for epoch in range(epochs):
        perm = [train_ids[i] for i in torch.randperm(len(train_ids)).tolist()]
        total = 0.0
        for b in range(len(train_ids) // bs):
            feats, nxt, want_h, label, mask, cs = batch_tensors(perm[b * bs:(b + 1) * bs])
            out = _causal(head, F.embedding(nxt, embed), feats, cs)
            reg = (F.smooth_l1_loss(out, want_h, reduction="none").mean(-1) * mask).sum() / mask.sum()
            ce = F.cross_entropy(head.lm_head(out).reshape(-1, vocab), label.reshape(-1), ignore_index=-100)
            loss = reg + 0.1 * ce
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item()
        losses.append(total / max(1, len(train_ids) // bs))
        log(f"epoch {epoch + 1}/{epochs}: loss {losses[-1]:.3f}")
    with torch.no_grad():
        feats, nxt, want_h, label, mask, cs = batch_tensors(held)
        guess = head.lm_head(_causal(head, F.embedding(nxt, embed), feats, cs)).argmax(-1)
        accuracy = float(((guess == label) & (label >= 0)).sum() / (label >= 0).sum())
    save_eagle_head(head, out_dir, base_config={k: cfg[k] for k in ("rms_norm_eps", "intermediate_size",
                                                                    "rope_theta") if k in cfg}
                    | {"base_model_name_or_path": str(model_dir)})
    report = {"questions": len(seqs), "answer_tokens": int(hidden.shape[0]), "draft_vocab": vocab,
              "vocab_coverage": float(counts[token_map].sum() / counts.sum()), "epochs": epochs,
              "loss_per_epoch": losses, "held_out_top1_accuracy_first_draft": accuracy,
              "data_s": t1 - t0, "train_s": time.perf_counter() - t1}
    (pathlib.Path(out_dir) / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def ensure_eagle_head(model_dir, *, vocab: int = 8192, root=None, log=print) -> pathlib.Path:
    """The cached EAGLE head directory for `model_dir`, trained on first use."""
    model_dir = pathlib.Path(model_dir)
    root = pathlib.Path(root) if root else REPO_ROOT / "build" / "spec-heads"
    out = root / f"{model_dir.name}-{_weights_digest(model_dir)}-eagle-v{vocab}"
    if (out / "training.json").is_file():
        return out
    tmp = out.with_name(out.name + ".part")
    report = train(model_dir, tmp, vocab=vocab, log=log)
    log(json.dumps(report))
    tmp.rename(out)
    return out
