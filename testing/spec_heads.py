"""Medusa heads for a real model, trained on CPU from the model's own greedy generations.

Self-distillation: the model answers a few hundred chat prompts greedily (kvserve's offline
engine), transformers gives the final hidden state at every answer position, and head i learns to
predict the token i + 2 places after each position, which is what the model itself generated
there. Each head is one residual block on top of a projection shared by every head and frozen:
the target's lm_head restricted to the tokens the answers use most (a truncated vocabulary with
a `token_map`), so that on a CPU the heads cost one small matmul per step instead of one
full-vocabulary projection per head.

`ensure_medusa_heads(model_dir)` trains once and caches the result under
`build/spec-heads/<model>-medusa-<heads>x<layers>-v<vocab>/` (a few minutes on 2 cores);
`scripts/train_medusa_heads.py` is the command-line form.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time

import torch

from kvserve.testing.realmodel import REPO_ROOT

TOPICS = (
    "the ocean", "volcanoes", "the moon", "honey bees", "the Roman empire", "photosynthesis", "rainbows",
    "electric cars", "chess", "coffee", "the internet", "penguins", "gardening", "the human heart",
    "mountains", "recycling", "music", "clouds", "airplanes", "friendship", "bread", "dinosaurs",
    "the solar system", "libraries", "trees", "sleep", "earthquakes", "football", "robots", "rivers",
    "cats", "dogs", "the desert", "winter", "trains", "the brain", "vaccines", "bicycles", "money",
    "painting", "the weather", "cooking pasta", "birds", "the pyramids", "swimming", "stars", "forests",
    "butterflies", "the telephone", "camping", "apples", "soap", "bees and flowers", "castles", "kites",
    "maps", "snow", "whales", "the wheel", "volunteering", "city parks", "horses", "the alphabet",
    "pizza", "the heart of a computer", "rain", "islands", "spiders", "elephants", "gold", "sailing",
    "chocolate", "the seasons", "fire", "museums", "bamboo", "hiking", "clocks", "water", "sharks",
)
TASKS = (
    "Explain {t} to a child in a few sentences.",
    "Write three short facts about {t}.",
    "Write a short story about {t}.",
    "What are the benefits of {t}?",
    "Describe {t} in one paragraph.",
    "Give me some tips about {t}.",
    "Why is {t} important?",
    "Write a short poem about {t}.",
    "What is the history of {t}?",
    "Compare {t} with something similar.",
    "Write a friendly letter to a friend about {t}.",
    "What questions do people often ask about {t}?",
)


def prompts(count: int | None = None) -> list[str]:
    out = [task.format(t=topic) for task in TASKS for topic in TOPICS]
    return out[:count] if count else out


def generate(model_dir, questions: list[str], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Prompt + greedy answer token ids for each chat question (kvserve's offline engine), and
    where each answer starts."""
    from kvserve.runtime import LLM, SamplingParams

    with LLM(str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=32) as llm:
        outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                        SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return ([list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs],
            [len(o.prompt_token_ids) for o in outs])


def hidden_states(model_dir, sequences: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, list]:
    """Final-norm hidden states (what lm_head reads) from position starts[i] - 1 on, per sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    rows, tokens = [], []
    with torch.inference_mode():
        for seq, start in zip(sequences, starts):
            out = model.model(torch.tensor([seq])).last_hidden_state[0]
            rows.append(out[start - 1:])
            tokens.append(seq[start - 1:])
    return torch.cat(rows), tokens


def dataset(model_dir, questions: list[str], max_tokens: int, *, kind: str = "data",
            cache: pathlib.Path | None = None) -> tuple[torch.Tensor, list]:
    """(hidden states, tokens) of the model's answers, cached beside the heads: generating and
    re-reading them is most of the training time. `kind` names the cache (training data,
    held-out answers); `cache` is a file to use instead of the keyed one."""
    # The directory's name and its weights, not its path: a cache copied from another checkout is found.
    key = hashlib.sha256(json.dumps([pathlib.Path(model_dir).name, _weights_digest(model_dir), questions, max_tokens])
                         .encode()).hexdigest()[:16]
    cache = cache or REPO_ROOT / "build" / "spec-heads" / f"{kind}-{key}.pt"
    if cache.is_file():
        data = torch.load(cache, weights_only=True)
        return data["hidden"], data["tokens"]
    # Say so: on a CPU this takes many minutes, and a changed question list is a new key.
    others = sorted(p.name for p in cache.parent.glob(f"{kind}-*.pt")) if cache.parent.is_dir() else []
    print(f"spec heads: generating {len(questions)} answers of up to {max_tokens} tokens for {cache.name} "
          f"(minutes on a CPU){'; other caches here: ' + ', '.join(others) if others else ''}", flush=True)
    seqs, starts = generate(model_dir, questions, max_tokens)
    hidden, tokens = hidden_states(model_dir, seqs, starts)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"hidden": hidden, "tokens": tokens}, cache.with_suffix(".part"))
    cache.with_suffix(".part").rename(cache)
    return hidden, tokens


def _weights_digest(model_dir) -> str:
    return hashlib.sha256((pathlib.Path(model_dir) / "model.safetensors").read_bytes()[:1 << 20]).hexdigest()[:10]


def train(model_dir, out_dir, *, num_heads: int = 3, num_layers: int = 1, vocab: int = 8192, questions: int = 960,
          max_tokens: int = 160, epochs: int = 8, seed: int = 0, log=print) -> dict:
    """Trains and saves heads; returns what was measured (sizes, losses, held-out top-1 accuracy)."""
    from safetensors.torch import load_file

    from kvserve.runtime.spec_decode.medusa import MedusaHeads, save_medusa_heads

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    qs = prompts(questions)
    hidden, tokens = dataset(model_dir, qs, max_tokens)
    t2 = time.perf_counter()

    # Row r of `hidden` sits at some position p of a sequence; head i's label is the token at
    # p + 2 + i of that sequence (ignored past its end).
    labels = torch.full((hidden.shape[0], num_heads), -1, dtype=torch.long)
    r = 0
    for toks in tokens:
        for p in range(len(toks)):
            for i in range(num_heads):
                if p + 2 + i < len(toks):
                    labels[r, i] = toks[p + 2 + i]
            r += 1
    counts = torch.bincount(labels[labels >= 0], minlength=1)
    vocab = min(vocab, int((counts > 0).sum()))
    token_map = torch.sort(torch.topk(counts.float(), vocab).indices).values
    to_row = torch.full((max(counts.shape[0], int(token_map.max()) + 1),), -100, dtype=torch.long)
    to_row[token_map] = torch.arange(vocab)
    target = torch.where(labels >= 0, to_row[labels.clamp(min=0)], torch.full_like(labels, -100))

    weights = load_file(str(pathlib.Path(model_dir) / "model.safetensors"))
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
    heads = MedusaHeads(num_heads, num_layers, hidden.shape[1], vocab, token_map=token_map)
    with torch.no_grad():
        for blocks, proj in zip(heads.blocks, heads.heads):
            # Start as "the next token again", as Medusa does: every block at zero is the identity
            # (silu(0) = 0) and still learns (silu'(0) = 1/2).
            for block in blocks:
                block.weight.zero_()
                block.bias.zero_()
            proj.weight.copy_(lm_head[token_map])
            proj.weight.requires_grad_(False)
    heads.share_projection_if_equal()

    n = hidden.shape[0]
    order = torch.randperm(n)
    held = order[: n // 10]
    train_rows = order[n // 10:]
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
    steps_per_epoch = max(1, len(train_rows) // 256)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=epochs * steps_per_epoch)
    losses = []
    for epoch in range(epochs):
        perm = train_rows[torch.randperm(len(train_rows))]
        total = 0.0
        for b in range(steps_per_epoch):
            idx = perm[b * 256:(b + 1) * 256]
            logits = heads(hidden[idx])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target[idx].reshape(-1),
                                                     ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item()
        losses.append(total / steps_per_epoch)
        log(f"epoch {epoch + 1}/{epochs}: loss {losses[-1]:.3f}")
    with torch.no_grad():
        guess = heads(hidden[held]).argmax(-1)
        t = target[held]
        accuracy = [float(((guess[:, i] == t[:, i]) & (t[:, i] >= 0)).sum() / max(1, int((t[:, i] >= 0).sum())))
                    for i in range(num_heads)]
    save_medusa_heads(heads, out_dir, base_model=str(model_dir))
    report = {"questions": len(qs), "num_layers": num_layers, "answer_tokens": int(n), "truncated_vocab": vocab,
              "vocab_coverage": float(counts[token_map].sum() / counts.sum()), "epochs": epochs,
              "loss_per_epoch": losses, "held_out_top1_accuracy_per_head": accuracy,
              "data_s": t2 - t0, "train_s": time.perf_counter() - t2}
    (pathlib.Path(out_dir) / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def ensure_medusa_heads(model_dir, *, num_heads: int = 3, num_layers: int = 1, vocab: int = 8192, root=None,
                        log=print) -> pathlib.Path:
    """The cached heads directory for `model_dir`, trained on first use."""
    model_dir = pathlib.Path(model_dir)
    digest = _weights_digest(model_dir)
    root = pathlib.Path(root) if root else REPO_ROOT / "build" / "spec-heads"
    out = root / f"{model_dir.name}-{digest}-medusa-{num_heads}x{num_layers}-v{vocab}"
    if (out / "training.json").is_file():
        return out
    tmp = out.with_name(out.name + ".part")
    report = train(model_dir, tmp, num_heads=num_heads, num_layers=num_layers, vocab=vocab, log=log)
    log(json.dumps(report))
    tmp.rename(out)
    return out
