"""Medusa heads: extra next-next-token heads on the target's final hidden state.

Head i (0-based) reads the hidden state h_t that gave token t+1 and guesses token t+2+i: a stack
of residual blocks (x + SiLU(W x + b)) and then a vocabulary projection. After every step the
heads run once on the row behind each sequence's newest token, and their top-1 guesses become
that sequence's drafts for the next step (a chain; the target verifies them like any other
drafts, so greedy output is the target's own).

Two checkpoint layouts load:
- Medusa's own (``medusa_lm_head.safetensors`` or ``.pt``): ``{i}.{j}.linear.weight/bias`` for
  block j of head i and ``{i}.{L}.weight`` for its projection, with ``medusa_num_heads`` and
  ``medusa_num_layers`` in ``config.json``;
- vLLM's (``model.safetensors``): ``blocks.{i}.layers.{j}.weight/bias`` and ``lm_heads.{i}.weight``,
  with ``num_heads`` and ``num_hidden_layers``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

_MEDUSA_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_MEDUSA_HEAD = re.compile(r"^(\d+)\.\d+\.weight$")
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


class MedusaHeads(nn.Module):
    """`vocab_size` is the projections' row count: the target's vocabulary, or a truncated one
    whose row r stands for target token `token_map[r]` (vLLM's `truncated_vocab_size`)."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int, *,
                 token_map: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(hidden_size, hidden_size, **kw)
                                                  for _ in range(num_layers)) for _ in range(num_heads))
        self.heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False, **kw) for _ in range(num_heads))
        if token_map is not None and token_map.shape != (vocab_size,):
            raise ValueError(f"token_map: expected {vocab_size} entries, got {tuple(token_map.shape)}")
        self.register_buffer("token_map", None if token_map is None else token_map.to(device, torch.long))
        # Heads that share one projection (often the target's own lm_head) project together: on a
        # CPU the projection's weights are the step's largest read, so one read serves every head.
        self.shared = False

    def share_projection_if_equal(self) -> bool:
        first = self.heads[0].weight
        self.shared = all(torch.equal(first, h.weight) for h in self.heads[1:])
        return self.shared

    def features(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[rows, heads, hidden]: each head's residual blocks applied to the hidden state."""
        hidden = hidden.to(self.heads[0].weight.dtype)
        out = []
        for blocks in self.blocks[:num_heads or self.num_heads]:
            x = hidden
            for block in blocks:
                x = x + torch.nn.functional.silu(block(x))
            out.append(x)
        return torch.stack(out, dim=1)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits [rows, heads, vocab_size] (float32) of the first `num_heads` heads."""
        x = self.features(hidden, num_heads)
        if self.shared:
            return self.heads[0](x).float()
        return torch.stack([head(x[:, i]) for i, head in enumerate(self.heads[:x.shape[1]])], dim=1).float()

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, num_heads: int) -> list[list[int]]:
        """Each row's top-1 guesses (target token ids), head by head."""
        best = self(hidden, num_heads).argmax(dim=-1)
        if self.token_map is not None:
            best = self.token_map[best]
        return best.tolist()

    def state_in_medusa_layout(self) -> dict[str, torch.Tensor]:
        """The tensors under Medusa's own names (what ``save_medusa_heads`` writes)."""
        out = {}
        for i, (blocks, head) in enumerate(zip(self.blocks, self.heads)):
            for j, block in enumerate(blocks):
                out[f"{i}.{j}.linear.weight"] = block.weight
                out[f"{i}.{j}.linear.bias"] = block.bias
            out[f"{i}.{self.num_layers}.weight"] = head.weight
        if self.token_map is not None:
            out["token_map"] = self.token_map
        return out


def save_medusa_heads(heads: MedusaHeads, path: str | Path, *, base_model: str | None = None) -> Path:
    """Writes a heads directory in Medusa's layout (config.json + medusa_lm_head.safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in heads.state_in_medusa_layout().items()}
    save_file(tensors, str(path / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
              "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size}
    if heads.token_map is not None:
        config["truncated_vocab_size"] = heads.vocab_size
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    for name in ("medusa_lm_head.safetensors", "model.safetensors"):
        if (path / name).is_file():
            from safetensors.torch import load_file

            return load_file(str(path / name))
    for name in ("medusa_lm_head.pt", "pytorch_model.bin"):
        if (path / name).is_file():
            return torch.load(path / name, map_location="cpu", weights_only=True)
    raise ValueError(f"speculative_config.model: {str(path)!r} has no medusa_lm_head.safetensors, "
                     "medusa_lm_head.pt or model.safetensors")


def _arrange(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(blocks[(head, layer)] = {weight, bias}, projections[head] = weight) from either layout."""
    blocks: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    projections: dict[int, torch.Tensor] = {}
    for k, v in tensors.items():
        if m := _MEDUSA_BLOCK.match(k) or _VLLM_BLOCK.match(k):
            blocks.setdefault((int(m[1]), int(m[2])), {})[m[3]] = v
        elif m := _MEDUSA_HEAD.match(k) or _VLLM_HEAD.match(k):
            projections[int(m[1])] = v
    return blocks, projections


def load_medusa_heads(path: str | Path, *, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                      device: torch.device) -> MedusaHeads:
    """Heads from a directory, checked against the target (hidden size, vocabulary)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"speculative_config.model: {str(path)!r} is not a directory")
    config = {}
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except ValueError as exc:
            raise ValueError(f"speculative_config.model: config.json is not valid JSON ({exc})") from None
    tensors = _read_tensors(path)
    token_map = tensors.pop("token_map", None)
    blocks, projections = _arrange(tensors)
    if not projections:
        raise ValueError("speculative_config.model: no Medusa head weights found (expected "
                         "'{i}.{j}.linear.weight' / '{i}.{L}.weight' or 'lm_heads.{i}.weight')")
    num_heads = int(config.get("medusa_num_heads", config.get("num_heads", len(projections))))
    num_layers = int(config.get("medusa_num_layers", config.get("num_hidden_layers",
                                                                 len(blocks) // max(1, len(projections)))))
    if sorted(projections) != list(range(num_heads)):
        raise ValueError(f"speculative_config.model: config says {num_heads} heads, weights have "
                         f"{sorted(projections)}")
    head_vocab, head_hidden = projections[0].shape
    if head_hidden != hidden_size:
        raise ValueError(f"speculative_config.model: heads read hidden size {head_hidden}, the target's is "
                         f"{hidden_size}")
    if token_map is not None:
        if token_map.shape != (head_vocab,) or int(token_map.min()) < 0 or int(token_map.max()) >= vocab_size:
            raise ValueError(f"speculative_config.model: token_map must hold {head_vocab} token ids below the "
                             f"target's vocabulary size {vocab_size}")
    elif head_vocab != vocab_size:
        raise ValueError(f"speculative_config.model: heads project to {head_vocab} tokens, the target's "
                         f"vocabulary has {vocab_size} (and there is no token_map)")
    heads = MedusaHeads(num_heads, num_layers, hidden_size, head_vocab, token_map=token_map, dtype=dtype,
                        device=device)
    with torch.no_grad():
        for i in range(num_heads):
            heads.heads[i].weight.copy_(projections[i])
            for j in range(num_layers):
                part = blocks.get((i, j))
                if part is None or "weight" not in part:
                    raise ValueError(f"speculative_config.model: head {i} lacks residual block {j}")
                heads.blocks[i][j].weight.copy_(part["weight"])
                if "bias" in part:
                    heads.blocks[i][j].bias.copy_(part["bias"])
                else:
                    heads.blocks[i][j].bias.zero_()
    heads.share_projection_if_equal()
    return heads.eval().requires_grad_(False)
