"""PEFT LoRA adapters for tests and benchmarks, built with `peft` on a base model directory.

PEFT initialises B to zero (an adapter that changes nothing), so the adapters here draw B at
random too: each one then visibly changes greedy output, which is what the parity tests need.
Everything is seeded: the same (base, options) always gives the same adapter. Real-model adapters
are cached under `build/` (`ensure_smollm2_adapters`).
"""

from __future__ import annotations

import fcntl
import json
import pathlib
from collections.abc import Sequence

from kvserve.testing.realmodel import REPO_ROOT

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Random A and B of SmolLM2 adapters: enough to change greedy answers, not enough for noise.
STD = 0.05


def build_lora_adapter(base_dir, out_dir, *, r: int = 8, lora_alpha: float = 16,
                       target_modules: Sequence[str] = ALL_MODULES, seed: int = 0, std: float = 0.05,
                       use_rslora: bool = False, layers_to_transform: Sequence[int] | None = None,
                       rank_pattern: dict | None = None, alpha_pattern: dict | None = None) -> pathlib.Path:
    """Writes a PEFT adapter directory for the model at `base_dir` (A and B random at `std`)."""
    options = dict(r=r, lora_alpha=lora_alpha, target_modules=target_modules, seed=seed, std=std,
                   use_rslora=use_rslora, layers_to_transform=layers_to_transform, rank_pattern=rank_pattern,
                   alpha_pattern=alpha_pattern)
    return build_lora_adapters(base_dir, {out_dir: options})[0]


def build_lora_adapters(base_dir, adapters: dict) -> list[pathlib.Path]:
    """Several adapters on one load of the base model: {out_dir: build_lora_adapter's options}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    out = []
    for out_dir, o in adapters.items():
        config = LoraConfig(r=o.get("r", 8), lora_alpha=o.get("lora_alpha", 16),
                            target_modules=list(ALL_MODULES if o.get("target_modules") is None else o["target_modules"]),
                            lora_dropout=0.0,
                            bias="none", task_type="CAUSAL_LM", use_rslora=o.get("use_rslora", False),
                            layers_to_transform=list(o["layers_to_transform"]) if o.get("layers_to_transform")
                            else None,
                            rank_pattern=o.get("rank_pattern") or {}, alpha_pattern=o.get("alpha_pattern") or {},
                            # fused MoE expert parameters (mlp.experts.gate_up_proj, ...)
                            target_parameters=list(o["target_parameters"]) if o.get("target_parameters") else None)
        pm = get_peft_model(model, config)
        gen = torch.Generator().manual_seed(o.get("seed", 0))
        std = o.get("std", 0.05)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_A" in name or "lora_B" in name or "lora_embedding_" in name:
                    p.copy_(std * torch.randn(p.shape, generator=gen))
        pm.save_pretrained(str(out_dir))
        model = pm.unload()  # the base model again, for the next adapter
        out.append(pathlib.Path(out_dir))
    return out


def peft_model(base_dir, adapter_dirs: dict[str, str]):
    """transformers + peft, unmerged, with every adapter loaded under its name (the oracle)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    names = list(adapter_dirs)
    pm = PeftModel.from_pretrained(model, str(adapter_dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        pm.load_adapter(str(adapter_dirs[name]), adapter_name=name)
    pm.eval()
    return pm


def peft_greedy(pm, name: str | None, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The oracle: peft's greedy tokens for `prompt` under adapter `name` (None: the base model,
    adapters disabled) and each token's logprob."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        if name is None:
            with pm.disable_adapter():
                out = pm.generate(ids, max_new_tokens=max_tokens, do_sample=False)
                logits = pm(out).logits[0]
        else:
            pm.set_adapter(name)
            out = pm.generate(ids, max_new_tokens=max_tokens, do_sample=False)
            logits = pm(out).logits[0]
    tokens = out[0, len(prompt):].tolist()
    logprobs = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:-1]
    return tokens, [logprobs[i, t].item() for i, t in enumerate(tokens)]


def assert_outputs_match_peft(outs, pm, names, prompts, max_tokens: int, *, abs_logprob: float = 2e-4,
                              adapter_matters: bool = False) -> None:
    """kvserve's greedy outputs (with logprobs=1) equal peft's per request: same tokens, logprobs
    within `abs_logprob`; with `adapter_matters`, an adapter's tokens also differ from the base's."""
    import pytest

    for out, name, prompt in zip(outs, names, prompts, strict=True):
        tokens, logprobs = peft_greedy(pm, name, prompt, max_tokens)
        got = out.outputs[0]
        assert got.token_ids == tokens, name
        assert [lp[t].logprob for lp, t in zip(got.logprobs, tokens)] == pytest.approx(logprobs, abs=abs_logprob), name
        if adapter_matters and name is not None:
            assert tokens != peft_greedy(pm, None, prompt, max_tokens)[0], name


def ensure_smollm2_adapters(base_dir, count: int = 8, *, r: int = 16, root=None) -> list[pathlib.Path]:
    """`count` rank-`r` adapters on every q/k/v/o/gate/up/down of SmolLM2, cached under build/."""
    root = pathlib.Path(root or REPO_ROOT / "build" / "smollm2-loras")
    root.mkdir(parents=True, exist_ok=True)
    dirs = [root / f"r{r}-s{int(STD * 1000)}-{i}" for i in range(count)]
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = {d: dict(r=r, lora_alpha=2 * r, seed=1000 + i, std=STD) for i, d in enumerate(dirs)
                   if not (d / "adapter_config.json").exists()
                   or json.loads((d / "adapter_config.json").read_text()).get("r") != r}
        if missing:
            # STD over 30 layers changes greedy text without turning it into noise.
            build_lora_adapters(base_dir, missing)
    return dirs
