"""Medusa heads for a real model, trained on CPU from the model's own greedy generations.

Self-distillation: the model answers about 1,500 chat prompts on 208 topics greedily (kvserve's
offline engine), transformers gives the final hidden state at every answer position, and head i
learns to predict the token i + 2 places after each position, which is what the model itself
generated there. Each head is one residual block on top of a projection shared by every head and
frozen: the target's lm_head restricted to a truncated vocabulary (the answers' tokens, then the
lowest ids; a `token_map`), so that on a CPU the heads cost one small matmul per step instead of
one full-vocabulary projection per head. A tenth of the topics is held out, and the epoch kept is
the one that does best there (`train`'s docstring has the recipe).

`ensure_medusa_heads(model_dir)` trains once and caches the result under
`build/spec-heads/<model>-<digest>-medusa-<heads>x<layers>-v<vocab>-r<RECIPE>/`;
`scripts/train_medusa_heads.py` is the command-line form. On 2 CPU cores, generating the data
takes about 20-40 minutes (cached under build/spec-heads/data-<key>.pt, in parts, so an
interrupted run resumes) and training 7-25 minutes.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time

import torch

from kvserve.testing.realmodel import REPO_ROOT

# The training recipe: part of the heads' cache name, so a changed recipe trains new heads.
# 1: 960 questions on 80 topics, blocks trained 8 epochs on a random 90 %, chosen by nothing.
# 2: `train`'s docstring.
RECIPE = 2

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

# Recipe 2's extra questions: many more topics (none of bench/spec_heads.py's held-out ones), four
# tasks each, drawn in rotation from TASKS and from styles that change the answers' shape and
# length. Heads trained on 80 topics learned those topics' words; what carries over to new topics
# is style, and more topics is what teaches it.
EXTRA_TOPICS = (
    "ants", "frogs", "the Great Wall of China", "rockets", "the Amazon rainforest", "potatoes", "marathons",
    "typewriters", "coral reefs", "kangaroos", "the Eiffel Tower", "cheese", "umbrellas", "thunderstorms",
    "the piano", "hot air balloons", "salt", "glass", "ancient Egypt", "the Vikings", "knights", "samurai",
    "the Renaissance", "the steam engine", "electricity", "magnets", "gravity", "atoms", "light bulbs",
    "batteries", "solar panels", "wind power", "nuclear energy", "plastic", "paper", "cotton", "wool", "silk",
    "rice", "wheat", "corn", "bananas", "oranges", "strawberries", "carrots", "garlic", "spices", "ice cream",
    "sandwiches", "soup", "breakfast", "vegetables", "nutrition", "exercise", "yoga", "running", "tennis",
    "basketball", "baseball", "golf", "skiing", "surfing", "climbing", "dancing", "singing", "the guitar",
    "drums", "opera", "movies", "theater", "photography", "sculpture", "poetry", "novels", "comic books",
    "video games", "board games", "puzzles", "magic tricks", "birthdays", "weddings", "holidays", "festivals",
    "fireworks", "gardens", "houseplants", "cactus plants", "mushrooms", "sunflowers", "roses", "oak trees",
    "seeds", "soil", "worms", "snails", "ladybugs", "dragonflies", "mosquitoes", "turtles", "crocodiles",
    "snakes", "lizards", "parrots", "eagles", "pigeons", "ducks", "chickens", "cows", "sheep", "goats", "pigs",
    "rabbits", "mice", "bats", "bears", "lions", "tigers", "giraffes", "zebras", "monkeys", "gorillas",
    "dolphins", "seals", "jellyfish", "crabs", "starfish", "salmon", "the Arctic", "Antarctica",
    "the Himalayas", "the Nile", "the Pacific Ocean", "Mars", "Jupiter", "Saturn's rings", "black holes",
    "the sun", "eclipses", "meteors", "telescopes", "satellites", "astronauts", "the space station",
    "computers", "smartphones", "email", "social media", "passwords", "artificial intelligence", "programming",
    "databases", "spreadsheets", "keyboards", "printers", "cameras", "radio", "television", "newspapers",
    "the post office", "banks", "taxes", "budgeting", "saving money", "shopping", "markets", "farming",
    "fishing", "bakeries", "restaurants", "hospitals", "doctors", "nurses", "teachers", "firefighters",
    "police officers", "pilots", "engineers", "scientists", "architects", "carpenters", "plumbers", "schools",
    "homework", "exams", "reading", "writing essays", "learning a language", "mathematics", "fractions",
    "geometry", "history class", "geography", "maps of the world", "volcanoes on other planets", "tornadoes",
    "hurricanes", "floods", "droughts", "climate change", "pollution", "clean water", "oceans and plastic",
    "endangered animals", "national parks", "zoos", "aquariums", "beaches", "caves", "waterfalls", "lakes",
    "canyons", "cities", "villages", "skyscrapers", "roads", "traffic", "buses", "subways", "cars",
    "motorcycles", "boats", "ships", "helicopters", "maps and compasses", "time zones", "calendars",
    "languages", "kindness", "patience", "courage", "teamwork", "leadership", "honesty", "gratitude",
    "happiness", "stress", "memory", "dreams", "habits", "creativity", "curiosity", "good manners", "family",
    "grandparents", "neighbors", "pets", "moving to a new city", "the first day of school", "a rainy day",
    "a summer vacation", "a birthday party", "a lost key", "a new job",
)
EXTRA_TASKS = (
    "Answer in one sentence: what is {t}?",
    "Explain {t} in detail.",
    "List five interesting things about {t}.",
    "Give a step-by-step guide to learning about {t}.",
    "What are the pros and cons of {t}?",
    "Write a short dialogue between two friends about {t}.",
    "Write a haiku about {t}.",
    "Summarize what a student should know about {t}.",
    "What are some common myths about {t}?",
    "Write a short news report about {t}.",
    "How would you describe {t} to someone who has never seen it?",
    "What would the world be like without {t}?",
)


def prompts(count: int | None = None) -> list[str]:
    out = [task.format(t=topic) for task in TASKS for topic in TOPICS]
    return out[:count] if count else out


def prompt_topics(count: int | None = None) -> list[str]:
    """The topic of each of `prompts(count)`, in order."""
    out = [topic for _ in TASKS for topic in TOPICS]
    return out[:count] if count else out


def extra_prompts(topics: int = 128, per_topic: int = 4) -> list[tuple[str, str]]:
    """(topic, question) pairs of recipe 2's extra data: the first `topics` of EXTRA_TOPICS, topic j
    with `per_topic` tasks in rotation."""
    tasks = TASKS + EXTRA_TASKS
    return [(topic, tasks[(j * per_topic + m) % len(tasks)].format(t=topic))
            for j, topic in enumerate(EXTRA_TOPICS[:topics]) for m in range(per_topic)]


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


def extra_dataset(model_dir, max_tokens: int, *, topics: int = 128, per_topic: int = 4, chunk_topics: int = 64,
                  log=print) -> tuple[torch.Tensor, list, list[str]]:
    """(hidden states, tokens, topic of each sequence) of recipe 2's extra questions. Cached in
    chunks of `chunk_topics` topics, so an interrupted run keeps what it finished (and a run with
    more `topics` reuses the chunks it shares)."""
    pairs = extra_prompts(len(EXTRA_TOPICS), per_topic)
    hidden, tokens, names = [], [], []
    for c in range(0, topics, chunk_topics):
        chunk = [p for p in pairs if p[0] in set(EXTRA_TOPICS[c:c + chunk_topics])]
        t0 = time.perf_counter()
        h, t = dataset(model_dir, [q for _, q in chunk], max_tokens)
        log(f"spec heads: extra data chunk {c // chunk_topics + 1}: {len(chunk)} answers, {h.shape[0]} positions "
            f"({time.perf_counter() - t0:.0f} s)")
        hidden.append(h)
        tokens += t
        names += [topic for topic, _ in chunk]
    return torch.cat(hidden), tokens, names

def _weights_digest(model_dir) -> str:
    return hashlib.sha256((pathlib.Path(model_dir) / "model.safetensors").read_bytes()[:1 << 20]).hexdigest()[:10]


def _labels(tokens: list, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: head i's label (the token at p + 2 + i of the row's sequence, -1 past its end) and
    the row's sequence index."""
    labels, seq_of = [], []
    for s, toks in enumerate(tokens):
        t = torch.tensor(toks, dtype=torch.long)
        lab = torch.full((len(toks), num_heads), -1, dtype=torch.long)
        for i in range(num_heads):
            if len(toks) > 2 + i:
                lab[:len(toks) - 2 - i, i] = t[2 + i:]
        labels.append(lab)
        seq_of.append(torch.full((len(toks),), s, dtype=torch.long))
    return torch.cat(labels), torch.cat(seq_of)


def truncated_vocab(counts: torch.Tensor, vocab: int) -> torch.Tensor:
    """Sorted target ids of the heads' rows: every token the training answers use (most used
    first, if there are more than `vocab`), then the lowest ids not yet in, up to `vocab`. A BPE
    vocabulary's low ids are its earliest, most frequent merges; new topics need words the
    training answers never used, and a frozen lm_head row can be predicted without being seen."""
    used = int((counts > 0).sum())
    keep = torch.topk(counts.float(), min(vocab, used)).indices
    taken = torch.zeros(max(counts.shape[0], vocab), dtype=torch.bool)
    taken[keep] = True
    fill = (~taken).nonzero().flatten()[:vocab - keep.numel()]
    return torch.sort(torch.cat([keep, fill])).values


def chain_metrics(logits: torch.Tensor, target: torch.Tensor) -> dict:
    """Per-head top-1 / top-3 on rows with a label, and the tokens per step a greedy chain of the
    heads would give (1 + the rate of each prefix of heads being all right)."""
    valid = target >= 0
    top3 = logits.topk(3, dim=-1).indices
    right1 = (top3[..., 0] == target) & valid
    right3 = (top3 == target.unsqueeze(-1)).any(-1) & valid
    n = valid.sum(0).clamp(min=1)
    rows = valid.all(1)  # a chain needs every head's label
    run = right1[rows].cumprod(1).float().mean(0) if rows.any() else torch.zeros(target.shape[1])
    return {"top1": (right1.sum(0) / n).tolist(), "top3": (right3.sum(0) / n).tolist(),
            "chain_tokens_per_step": 1 + float(run.sum())}


def train(model_dir, out_dir, *, num_heads: int = 3, num_layers: int = 1, vocab: int = 8192, questions: int = 960,
          max_tokens: int = 160, epochs: int = 8, seed: int = 0, extra_topics: int = 128, held_topics: float = 0.1,
          lr: float = 2e-3, weight_decay: float = 0.01, dropout: float = 0.1, head_decay: float = 0.8,
          distill: float = 0.0, patience: int = 2, max_rows: int | None = None, log=print) -> dict:
    """Trains and saves heads; returns what was measured (sizes, losses, held-out accuracy per epoch).

    Recipe 2 (what generalizes to new topics, chosen by accuracy on held-out topics):
    - data: `prompts(questions)` (80 topics) and `extra_prompts(extra_topics)`: 4 questions on each
      of up to 253 more topics, in styles that vary the answers' shape and length;
    - a held-out split by topic (`held_topics` of them): the epoch kept is the one whose heads
      give the most chain tokens per step there (early stopping, `patience` epochs);
    - Medusa-1's heads: residual blocks at zero (the identity), the target's lm_head as the
      (frozen, shared) projection, per-head loss weights `head_decay ** i`, AdamW with a cosine
      schedule after a warm-up;
    - against overfitting: dropout on the hidden state the blocks read, weight decay, and a
      `distill` share of the loss on the target's own distribution of the label (softened labels
      say which other tokens were nearly as likely, which a single greedy token does not; off by
      default: it costs 80 % more time and gained nothing measurable on a 30k-row trial).
    `max_rows` caps the training rows (quick experiments)."""
    from safetensors.torch import load_file

    from kvserve.runtime.spec_decode.medusa import MedusaHeads, save_medusa_heads

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    qs = prompts(questions)
    hidden, tokens = dataset(model_dir, qs, max_tokens)
    topics = prompt_topics(questions)
    if extra_topics:
        h2, t2, topics2 = extra_dataset(model_dir, max_tokens, topics=extra_topics, log=log)
        hidden, tokens, topics = torch.cat([hidden, h2]), tokens + t2, topics + topics2
        qs = qs + [q for _, q in extra_prompts(extra_topics)]
    t_data = time.perf_counter()

    # Row r of `hidden` sits at position p of its sequence; head i's label is the token at p + 2 + i
    # (-1 past the end), and the target's own distribution of it is row r + 1 + i's logits.
    labels, seq_of = _labels(tokens, num_heads)
    names = sorted(set(topics))
    g = torch.Generator().manual_seed(seed)
    held_names = {names[j] for j in torch.randperm(len(names), generator=g)[:max(1, int(len(names) * held_topics))]}
    held_seq = torch.tensor([t in held_names for t in topics])
    is_held = held_seq[seq_of]
    train_rows = (~is_held).nonzero().flatten()
    held = is_held.nonzero().flatten()
    if max_rows is not None:
        train_rows = train_rows[torch.randperm(len(train_rows), generator=g)[:max_rows]]
        held = held[torch.randperm(len(held), generator=g)[:max(2000, max_rows // 8)]]

    train_labels = labels[train_rows]
    counts = torch.bincount(train_labels[train_labels >= 0], minlength=1)
    weights = load_file(str(pathlib.Path(model_dir) / "model.safetensors"))
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
    token_map = truncated_vocab(torch.nn.functional.pad(counts, (0, max(0, lm_head.shape[0] - counts.shape[0]))),
                                min(vocab, lm_head.shape[0]))
    vocab = token_map.numel()
    to_row = torch.full((lm_head.shape[0],), -100, dtype=torch.long)
    to_row[token_map] = torch.arange(vocab)
    target = torch.where(labels >= 0, to_row[labels.clamp(min=0)], torch.full_like(labels, -100))
    # Rows r + 1 + i exist exactly where head i has a label.
    teacher_row = torch.arange(len(labels)).unsqueeze(1) + 1 + torch.arange(num_heads)
    teacher_row = torch.where(labels >= 0, teacher_row, torch.zeros_like(teacher_row))

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
    # The frozen projection is most of the arithmetic; bfloat16 matmuls run it several times
    # faster on CPUs that have them (logits and the loss stay float32).
    proj_w = heads.heads[0].weight.detach().to(torch.bfloat16)

    def project(feat: torch.Tensor) -> torch.Tensor:
        return (feat.to(torch.bfloat16) @ proj_w.T).float()

    loss_w = torch.tensor([head_decay ** i for i in range(num_heads)])
    loss_w = loss_w / loss_w.sum()

    batch = 256
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    steps_per_epoch = max(1, len(train_rows) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps_per_epoch,
                                                pct_start=0.1, anneal_strategy="cos")

    def evaluate() -> dict:
        heads.eval()
        with torch.no_grad():
            logits = torch.cat([project(heads.features(hidden[held[b:b + 4096]])) for b in range(0, len(held), 4096)])
        # A label outside the truncated vocabulary is a miss (row `vocab` never comes out), not a skip.
        want = torch.where(labels[held] >= 0, target[held].where(target[held] >= 0, torch.full_like(target[held], vocab)),
                           torch.full_like(target[held], -1))
        return chain_metrics(logits, want)

    history, best, stale = [], None, 0
    for epoch in range(epochs):
        heads.train()
        perm = train_rows[torch.randperm(len(train_rows))]
        total = 0.0
        for b in range(steps_per_epoch):
            idx = perm[b * batch:(b + 1) * batch]
            x = torch.nn.functional.dropout(hidden[idx], dropout, training=True)
            logits = project(heads.features(x))  # [rows, heads, vocab]
            t = target[idx]
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), t.reshape(-1), ignore_index=-100,
                                                   reduction="none").view(t.shape)
            mask = (t >= 0).float()
            loss_rows = ce
            if distill:
                with torch.no_grad():
                    soft = project(hidden[teacher_row[idx]]).softmax(-1)  # [rows, heads, vocab]
                kl = -(soft * logits.log_softmax(-1)).sum(-1)
                loss_rows = (1 - distill) * ce + distill * kl
            per_head = (loss_rows * mask).sum(0) / mask.sum(0).clamp(min=1)
            loss = (per_head * loss_w).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item()
        m = evaluate()
        history.append({"epoch": epoch + 1, "loss": total / steps_per_epoch} | m)
        log(f"epoch {epoch + 1}/{epochs}: loss {total / steps_per_epoch:.3f}, held-out topics: top-1 "
            + " ".join(f"{a:.3f}" for a in m["top1"]) + f", chain tokens/step {m['chain_tokens_per_step']:.3f}")
        if best is None or m["chain_tokens_per_step"] > best["chain_tokens_per_step"]:
            best, stale = history[-1], 0
            # The best heads so far are on disk at once: a long run stopped early still leaves them.
            save_medusa_heads(heads, out_dir, base_model=str(model_dir))
        else:
            stale += 1
        report = {"recipe": RECIPE, "finished": False, "questions": len(qs), "topics": len(names),
                  "held_out_topics": sorted(held_names), "num_layers": num_layers, "answer_tokens": int(len(labels)),
                  "train_rows": int(len(train_rows)), "held_out_rows": int(len(held)), "truncated_vocab": vocab,
                  "vocab_coverage": float(counts[token_map[token_map < len(counts)]].sum() / counts.sum()),
                  "lr": lr, "weight_decay": weight_decay, "dropout": dropout, "head_decay": head_decay,
                  "distill": distill, "epochs": epochs, "best_epoch": best["epoch"], "history": history,
                  "held_out_top1_accuracy_per_head": best["top1"], "held_out_top3_accuracy_per_head": best["top3"],
                  "held_out_chain_tokens_per_step": best["chain_tokens_per_step"],
                  "data_s": t_data - t0, "train_s": time.perf_counter() - t_data}
        (pathlib.Path(out_dir) / "training.json").write_text(json.dumps(report, indent=2) + "\n")
        if stale >= patience:
            break
    report["finished"] = True
    (pathlib.Path(out_dir) / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def ensure_medusa_heads(model_dir, *, num_heads: int = 3, num_layers: int = 1, vocab: int = 8192, root=None,
                        log=print) -> pathlib.Path:
    """The cached heads directory for `model_dir`, trained on first use (recipe `RECIPE`)."""
    model_dir = pathlib.Path(model_dir)
    digest = _weights_digest(model_dir)
    root = pathlib.Path(root) if root else REPO_ROOT / "build" / "spec-heads"
    out = root / f"{model_dir.name}-{digest}-medusa-{num_heads}x{num_layers}-v{vocab}-r{RECIPE}"
    if (out / "training.json").is_file():
        return out
    tmp = out.with_name(out.name + ".part")
    report = train(model_dir, tmp, num_heads=num_heads, num_layers=num_layers, vocab=vocab, log=log)
    log(json.dumps({k: v for k, v in report.items() if k != "history"}))
    tmp.rename(out)
    return out
