"""An EAGLE head for a real model, trained on CPU from the model's own greedy answers.

The data are Medusa's (testing/spec_heads.py `dataset`: the model's answers and its final-norm
hidden states at every answer position, cached under build/spec-heads/). The head is EAGLE-1's
layout: fc(concat(embedding of token p+1, hidden state at p)) into one decoder layer initialised
from the target's last layer with its residual branches at zero (so it starts as "the feature
passes through"). Run over each answer with teacher forcing and unrolled over `depth` draft steps
as the proposer runs them (`_unrolled`), each step learns the target's own next-token
distribution at that depth (soft cross-entropy: self-distillation) and the next feature (smooth
L1 scaled by the features' RMS). Its projection is the target's lm_head restricted to the tokens
the answers use most, frozen, with a `d2t` map back to target ids: on a CPU a full-vocabulary
projection per draft costs about a fifth of a SmolLM2 decode step, the truncated one far less.

`ensure_eagle_head(model_dir)` trains once and caches the result under
`build/spec-heads/<model>-<digest>-eagle-v<vocab>/`; `scripts/train_eagle_head.py` is the
command-line form.
"""

from __future__ import annotations

import json
import math
import pathlib
import time

import torch
from torch.nn import functional as F

from kvserve.testing.realmodel import REPO_ROOT
from kvserve.testing.spec_heads import _weights_digest, dataset, prompts


def _unrolled(head, embed, feats, toks, cos_sin, depth: int):
    """The head over [B, n] answer rows at once, unrolled `depth` draft steps as the proposer runs
    them (EAGLE-3's training-time test): step 0's row j reads the target's feature at j and the
    token at j+1; step d's row j reads step d-1's output at j (its guess of the feature at j+d) and
    the token at j+d+1 (teacher forced: a draft is only verified after its predecessors matched),
    sits at position j+d and attends to the target-fed rows 0..j and to its own chain rows j of
    steps 1..d. Returns each step's outputs [B, n, H]."""
    B, n, H = feats.shape
    rep = head.num_heads // head.num_kv_heads
    keys, values, outs = [], [], []
    row = torch.arange(n)
    feature = feats
    for d in range(depth):
        tok = toks[:, d + 1:d + 1 + n]
        attn_in, residual = head.layer_input(F.embedding(tok, embed).reshape(B * n, H), feature.reshape(B * n, -1))
        q, k, v = head.qkv(attn_in, cos_sin[d:d + n].repeat(B, 1))
        q = q.view(B, n, head.num_heads, -1).transpose(1, 2)
        keys.append(k.view(B, n, head.num_kv_heads, -1).transpose(1, 2).repeat_interleave(rep, dim=1))
        values.append(v.view(B, n, head.num_kv_heads, -1).transpose(1, 2).repeat_interleave(rep, dim=1))
        # Key columns: step 0's rows (causal), then each chain step's own row j (diagonal).
        mask = torch.cat([row[None, :] <= row[:, None]] + [row[None, :] == row[:, None]] * d, dim=1)
        attn = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask)
        feature = head.finish(attn.transpose(1, 2).reshape(B * n, -1), residual).view(B, n, H)
        outs.append(feature)
    return outs


def train(model_dir, out_dir, *, vocab: int = 2048, questions: int = 960, max_tokens: int = 160, epochs: int = 2,
          depth: int = 2, seed: int = 0, budget_s: float | None = None, data=None, log=print) -> dict:
    """Trains and saves an EAGLE-1 head by self-distillation; returns what was measured (losses,
    held-out accuracy per draft depth, the acceptance length a greedy chain would get)."""
    from safetensors.torch import load_file

    from kvserve.runtime.model_config import ModelConfig
    from kvserve.runtime.models.rope import rope_cos_sin_cache
    from kvserve.runtime.spec_decode.eagle import EagleHead, save_eagle_head

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    if data is not None:  # a cached dataset file of the same model (testing/spec_heads.py `dataset`)
        cached = torch.load(data, weights_only=True)
        hidden, tokens = cached["hidden"], cached["tokens"]
    else:
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
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(head, name).weight.copy_(weights[f"{last}self_attn.{name}.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(head, name).weight.copy_(weights[f"{last}mlp.{name}.weight"])
        head.post_attention_layernorm.copy_(weights[f"{last}post_attention_layernorm.weight"])
        # The layer's two residual branches start at zero (o_proj, down_proj): the head starts as
        # "the feature passes through", whose logits are sane, instead of the target's last layer
        # applied to final-norm states (logits in the thousands, which the first head never left).
        head.o_proj.weight.zero_()
        head.down_proj.weight.zero_()
        head.fc.weight.zero_()
        head.fc.weight[:, H:] = torch.eye(H)  # start from "the feature passes through"
        head.fc.weight[:, :H].normal_(0, 0.01)
        head.fc.bias.zero_()
        head.lm_head = torch.nn.Linear(H, vocab, bias=False)
        head.lm_head.weight.copy_(lm_head[token_map])
    head.lm_head.weight.requires_grad_(False)
    head.d2t = token_map - torch.arange(vocab)
    cos_sin_all = rope_cos_sin_cache(mcfg, max_tokens + depth + 8)
    # The features' scale: SmolLM2's final-norm states are large (outlier channels in the
    # hundreds), which made an unscaled regression term swamp the token loss (the first head's
    # failure); scaled, both terms start near 1.
    scale = hidden.float().pow(2).mean().sqrt()

    order = torch.randperm(len(seqs)).tolist()
    held, train_ids = order[: len(seqs) // 10], order[len(seqs) // 10:]
    # Batches of similar lengths (shuffled as batches): padding is most of the cost otherwise.
    train_ids.sort(key=lambda i: len(seqs[i][1]))

    def batch_tensors(ids):
        n = max(len(seqs[i][1]) for i in ids) - 2
        feats = torch.zeros(len(ids), n + depth + 2, H)
        toks = torch.zeros(len(ids), n + depth + 2, dtype=torch.long)
        mask = torch.zeros(len(ids), n + depth + 2)
        for b, i in enumerate(ids):
            h, t = seqs[i]
            feats[b, :len(t)], toks[b, :len(t)], mask[b, :len(t) - 2] = h, t, 1
        return feats, toks, mask, n

    def losses_of(ids):
        feats, toks, mask, n = batch_tensors(ids)
        outs = _unrolled(head, embed, feats[:, :n], toks, cos_sin_all, depth)
        total, correct = 0.0, []
        for d, out in enumerate(outs):
            # Step d's row j guesses the token at j+d+2: the target's distribution after the
            # feature at j+d+1 is the soft label (self-distillation), its feature the regression.
            want = feats[:, d + 1:d + 1 + n]
            m = mask[:, d:d + n]
            with torch.no_grad():
                soft = F.softmax(want @ head.lm_head.weight.T, dim=-1)
            logits = head.lm_head(out)
            ce = -(soft * F.log_softmax(logits, -1)).sum(-1)
            reg = F.smooth_l1_loss(out / scale, want / scale, reduction="none").mean(-1)
            total = total + (0.8 ** d) * (((ce + reg) * m).sum() / m.sum())
            correct.append(((logits.argmax(-1) == soft.argmax(-1)) & (m > 0)).detach())
        return total, correct, mask[:, :n]

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0)
    bs = 8
    steps = epochs * (len(train_ids) // bs)
    losses = []
    done = 0
    for epoch in range(epochs):
        batches = torch.randperm(len(train_ids) // bs).tolist()
        total = 0.0
        taken = 0
        for batch in batches:
            loss, _, _ = losses_of(train_ids[batch * bs:(batch + 1) * bs])
            # Warm-up, then a cosine over the steps or the time budget, whichever ends first.
            progress = max(done / max(1, steps), (time.perf_counter() - t1) / budget_s if budget_s else 0.0)
            for group in opt.param_groups:
                group["lr"] = 5e-4 * min(1.0, (done + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            done += 1
            taken += 1
            if done % 10 == 0:
                log(f"step {done}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - t1:.0f} s)")
            if budget_s is not None and time.perf_counter() - t1 > budget_s:
                break
        losses.append(total / max(1, taken))
        log(f"epoch {epoch + 1}/{epochs}: loss {losses[-1]:.3f}")
        if budget_s is not None and time.perf_counter() - t1 > budget_s:
            break
    with torch.no_grad():
        hits = [0] * depth
        run_total, rows = 0, 0
        for b in range(0, len(held), 16):
            _, correct, m = losses_of(held[b:b + 16])
            chain = torch.ones_like(correct[0])
            for d in range(depth):
                chain = chain & correct[d]
                hits[d] += int((correct[d] & (m > 0)).sum())
                run_total += int((chain & (m > 0)).sum())
            rows += int(m.sum())
    accuracy = [h / rows for h in hits]
    save_eagle_head(head, out_dir, base_config={k: cfg[k] for k in ("rms_norm_eps", "intermediate_size",
                                                                    "rope_theta") if k in cfg}
                    | {"base_model_name_or_path": str(model_dir)})
    report = {"questions": len(seqs), "answer_tokens": int(hidden.shape[0]), "draft_vocab": vocab,
              "vocab_coverage": float(counts[token_map].sum() / counts.sum()), "epochs": epochs, "depth": depth,
              "steps": done, "loss_per_epoch": losses, "held_out_top1_accuracy_first_draft": accuracy[0],
              "held_out_top1_accuracy_per_depth": accuracy,
              # Greedy chain of `depth` drafts, teacher-forced on the held-out answers: tokens per
              # verification step (1 + the drafts accepted before the first miss).
              "held_out_chain_acceptance_length": 1 + run_total / rows,
              "data_s": t1 - t0, "train_s": time.perf_counter() - t1}
    (pathlib.Path(out_dir) / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def ensure_eagle_head(model_dir, *, vocab: int = 2048, root=None, log=print, **train_kw) -> pathlib.Path:
    """The cached EAGLE head directory for `model_dir`, trained on first use."""
    model_dir = pathlib.Path(model_dir)
    root = pathlib.Path(root) if root else REPO_ROOT / "build" / "spec-heads"
    out = root / f"{model_dir.name}-{_weights_digest(model_dir)}-eagle-v{vocab}"
    if (out / "training.json").is_file():
        return out
    tmp = out.with_name(out.name + ".part")
    report = train(model_dir, tmp, vocab=vocab, log=log, **{k: v for k, v in train_kw.items() if v is not None})
    log(json.dumps(report))
    tmp.rename(out)
    return out
