"""A checkpoint plus a DeepSeek-V3-layout MTP module (num_nextn_predict_layers = 1), random or
"copying", for the MTP tests and bench/mtp_tree.py."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file


def add_mtp_layer(src, dst, *, seed: int = 0, copy: bool = False):
    """`src` with an MTP module at layer index num_hidden_layers (the checkpoint's own last
    decoder layer's shapes; random weights). `copy`: the block adds nothing and eh_proj passes
    the target's feature through, so the layer guesses the token it was just given again (a
    model that repeats itself gets drafts accepted)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    n = config["num_hidden_layers"]
    H = config["hidden_size"]
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for name, t in list(tensors.items()):
        if not name.startswith(last):
            continue
        if name.endswith("norm.weight"):
            new = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            new = 0.1 * torch.randn(t.shape, generator=gen)
        else:
            new = 0.05 * torch.randn(t.shape, generator=gen)
        if copy and (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")):
            new = torch.zeros(t.shape)
        tensors[mtp + name[len(last):]] = new.to(t.dtype).contiguous()
    tensors[mtp + "enorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=gen)
    tensors[mtp + "hnorm.weight"] = torch.ones(H) if copy else 1.0 + 0.1 * torch.randn(H, generator=gen)
    eh = 0.1 * torch.randn(H, 2 * H, generator=gen)
    if copy:
        eh = torch.cat((torch.zeros(H, H), torch.eye(H)), dim=1)
    tensors[mtp + "eh_proj.weight"] = eh
    tensors[mtp + "shared_head.norm.weight"] = torch.ones(H) if copy else 1.0 + 0.1 * torch.randn(H, generator=gen)
    # DeepSeek-V3 stores the embedding and the head again inside the MTP layer.
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst
