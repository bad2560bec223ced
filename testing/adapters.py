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


def build_lora_adapter(base_dir, out_dir, *, r: int = 8, lora_alpha: float = 16,
                       target_modules: Sequence[str] = ALL_MODULES, seed: int = 0, std: float = 0.05,
                       use_rslora: bool = False, layers_to_transform: Sequence[int] | None = None,
                       rank_pattern: dict | None = None, alpha_pattern: dict | None = None) -> pathlib.Path:
    """Writes a PEFT adapter directory for the model at `base_dir` (A and B random at `std`)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = pathlib.Path(out_dir)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM", use_rslora=use_rslora,
                        layers_to_transform=list(layers_to_transform) if layers_to_transform else None,
                        rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {})
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(str(out))
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


def ensure_smollm2_adapters(base_dir, count: int = 8, *, r: int = 16, root=None) -> list[pathlib.Path]:
    """`count` rank-`r` adapters on every q/k/v/o/gate/up/down of SmolLM2, cached under build/."""
    root = pathlib.Path(root or REPO_ROOT / "build" / "smollm2-loras")
    root.mkdir(parents=True, exist_ok=True)
    out = []
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for i in range(count):
            d = root / f"r{r}-{i}"
            marker = d / "adapter_config.json"
            if not marker.exists() or json.loads(marker.read_text()).get("r") != r:
                # std 0.02 over 30 layers moves greedy text without turning it into noise.
                build_lora_adapter(base_dir, d, r=r, lora_alpha=2 * r, seed=1000 + i, std=0.02)
            out.append(d)
    return out
