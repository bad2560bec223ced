"""Linear and embedding layers laid out for tensor parallelism.

Every parameter carries a ``weight_loader(param, full_checkpoint_tensor, shard_id=None)`` that
takes the *whole* tensor from the checkpoint and copies in this rank's slice, so the loader never
needs to know how a layer is sharded:

- column-parallel (q/k/v, gate/up): output features split across ranks;
- row-parallel (o_proj, down_proj): input features split, partial outputs summed (all-reduce);
- vocab-parallel (embedding, lm head): vocabulary rows split.

With tp_size == 1 every slice is the whole tensor and every collective is the identity.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F


def _param(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
           loader: Callable[..., None]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _copy(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight {what}: checkpoint shape {tuple(loaded.shape)} does not match the "
                         f"model's {tuple(param.shape)}")
    param.copy_(loaded)


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sums partial results across tensor-parallel ranks (identity at tp_size == 1)."""
    if tp_size == 1:
        return x
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensor parallelism needs an initialized torch.distributed process group")
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensor parallelism needs an initialized torch.distributed process group")
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


class ReplicatedWeight(nn.Module):
    """A norm weight (or any small tensor) that every rank holds whole."""

    def __init__(self, size: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param((size,), dtype, device, self._load)

    @staticmethod
    def _load(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param, loaded, "norm")


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel projections fused into one matmul (q|k|v, or gate|up).

    `output_sizes` are the checkpoint's full output sizes per part; `shard_sizes` this rank's.
    A part with `replicated_parts[i]` (KV heads when tp_size > num_kv_heads) is not split
    evenly: its rank slice starts at `shard_starts[i]`.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], shard_sizes: Sequence[int],
                 shard_starts: Sequence[int], *, bias: bool, dtype: torch.dtype, device: torch.device,
                 part_names: Sequence[str]):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.shard_sizes = list(shard_sizes)
        self.shard_starts = list(shard_starts)
        self.part_names = list(part_names)
        self.offsets = [0]
        for size in self.shard_sizes:
            self.offsets.append(self.offsets[-1] + size)
        out = self.offsets[-1]
        self.weight = _param((out, input_size), dtype, device, self._load)
        self.bias = _param((out,), dtype, device, self._load) if bias else None

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id not in self.part_names:
            raise ValueError(f"weight part {shard_id!r}: expected one of {self.part_names}")
        i = self.part_names.index(shard_id)
        if loaded.shape[0] != self.output_sizes[i]:
            raise ValueError(f"weight {shard_id}: checkpoint has {loaded.shape[0]} output rows, the model "
                             f"config implies {self.output_sizes[i]}")
        piece = loaded.narrow(0, self.shard_starts[i], self.shard_sizes[i])
        _copy(param.narrow(0, self.offsets[i], self.shard_sizes[i]), piece, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; the partial products are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device, reduce_results: bool = True):
        super().__init__()
        if input_size % tp_size:
            raise ValueError(f"row-parallel input size {input_size} is not divisible by tp_size {tp_size}")
        if bias and not reduce_results:
            raise ValueError("a row-parallel bias needs reduce_results (it is added once, after the sum)")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # False when the caller sums several partial results first and all-reduces once (MoE).
        self.reduce_results = reduce_results
        self.shard = input_size // tp_size
        self.weight = _param((output_size, self.shard), dtype, device, self._load_weight)
        self.bias = _param((output_size,), dtype, device, self._load_bias) if bias else None

    def _load_weight(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param, loaded.narrow(1, self.tp_rank * self.shard, self.shard), "row-parallel")

    @staticmethod
    def _load_bias(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param, loaded, "row-parallel bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if not self.reduce_results:
            return out
        out = all_reduce(out, self.tp_size)
        # The bias is added once, after the sum, not once per rank.
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split across ranks (padded so each rank holds the same count)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.shard = math.ceil(vocab_size / tp_size)
        self.start = tp_rank * self.shard
        self.end = min(self.start + self.shard, vocab_size)
        self.weight = _param((self.shard, hidden_size), dtype, device, self._load)
        if self.end - self.start < self.shard:
            self.weight.data[self.end - self.start:].zero_()

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"weight embedding: checkpoint has {loaded.shape[0]} rows, config vocab_size "
                             f"is {self.vocab_size}")
        n = self.end - self.start
        _copy(param[:n], loaded[self.start:self.end], "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Uses this table as the output projection (also how tied embeddings work)."""
        local = F.linear(hidden, self.weight)
        full = all_gather_last_dim(local, self.tp_size)
        return full[..., : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """The untied output projection, sharded like the embedding; logits are gathered to full vocab."""
