"""Linear and embedding layers laid out for tensor parallelism.

Every parameter carries a ``weight_loader(param, full_checkpoint_tensor, shard_id=None)`` that
takes the *whole* tensor from the checkpoint and copies in this rank's slice, so the loader never
needs to know how a layer is sharded. Linear layers (and the vocabulary table, which is also the
LM head) hold their weights through a `LinearMethod` (kvserve.runtime.models.quantization): the
method decides what the parameters are (full precision, int4, FP8, ...) and how to multiply.

- column-parallel (q/k/v, gate/up): output features split across ranks;
- row-parallel (o_proj, down_proj): input features split, partial outputs summed (all-reduce);
- vocab-parallel (embedding, lm head): vocabulary rows split.

With tp_size == 1 every slice is the whole tensor and every collective is the identity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kvserve.runtime.models.quantization import QuantizationConfig
from kvserve.runtime.models.quantization.base import LinearSpec, register_checkpoint_names, sharded_param
from kvserve.runtime.models.quantization.unquantized import UnquantizedConfig

_UNQUANTIZED_CONFIG = UnquantizedConfig()


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


# The process group of this rank's tensor-parallel peers; None is the default (world) group.
# Pipeline parallelism sets it: the world is pp x tp ranks and a layer reduces within its stage.
_tp_group = None


def set_tp_group(group) -> None:
    global _tp_group
    _tp_group = group


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sums partial results across tensor-parallel ranks (identity at tp_size == 1)."""
    if tp_size == 1:
        return x
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensor parallelism needs an initialized torch.distributed process group")
    dist.all_reduce(x, group=_tp_group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensor parallelism needs an initialized torch.distributed process group")
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=-1)


class ReplicatedWeight(nn.Module):
    """A norm weight (or any small tensor) that every rank holds whole."""

    def __init__(self, size: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param((size,), dtype, device, self._load)

    @staticmethod
    def _load(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param, loaded, "norm")


class LinearBase(nn.Module):
    """A linear layer whose weights are whatever its `LinearMethod` makes them (kvserve.runtime.
    models.quantization): full precision, int8/int4, AWQ, GPTQ, FP8, ... The bias is never
    quantized: it stays in the compute dtype beside the method's weights."""

    def __init__(self, spec: LinearSpec, quant_config: QuantizationConfig | None, *, bias: bool):
        super().__init__()
        self.spec = spec
        self.quant_method = (quant_config or _UNQUANTIZED_CONFIG).get_linear_method(spec)
        self.quant_method.create_weights(self, spec)
        if bias:
            sharded_param(self, "bias", spec, (spec.out_features,), spec.params_dtype, out_dim=0)
        else:
            self.bias = None
        register_checkpoint_names(self)

    def checkpoint_params(self, prefixes: Sequence[str] | None = None) -> dict[str, tuple[torch.Tensor, str | None]]:
        """Checkpoint tensor name -> (parameter, shard id), for every tensor this layer loads;
        `prefixes` (one per fused part) default to the spec's."""
        out = {}
        for name, param in self.named_parameters(recurse=False):
            if getattr(param, "weight_loader", None) is None:
                continue
            # A checkpoint name that is no attribute name ("weight.absmax") is the parameter's suffix.
            suffix = getattr(param, "checkpoint_suffix", name)
            for prefix, part in zip(prefixes or self.spec.prefixes, self.spec.part_names):
                out[f"{prefix}.{suffix}"] = (param, part)
        return out

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections fused into one matmul (q|k|v, or gate|up).

    `output_sizes` are the checkpoint's full output sizes per part; `shard_sizes` this rank's.
    A part with `replicated_parts[i]` (KV heads when tp_size > num_kv_heads) is not split
    evenly: its rank slice starts at `shard_starts[i]`. `prefixes` are the parts' checkpoint
    module names (default: the part names).
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], shard_sizes: Sequence[int],
                 shard_starts: Sequence[int], *, bias: bool, dtype: torch.dtype, device: torch.device,
                 part_names: Sequence[str], prefixes: Sequence[str] | None = None,
                 quant_config: QuantizationConfig | None = None, tp_rank: int = 0, tp_size: int = 1):
        spec = LinearSpec(input_size=input_size, output_sizes=tuple(output_sizes),
                          output_slices=tuple(zip(shard_starts, shard_sizes)), input_slice=(0, input_size),
                          prefixes=tuple(prefixes or part_names), part_names=tuple(part_names),
                          params_dtype=dtype, device=torch.device(device), tp_rank=tp_rank, tp_size=tp_size)
        super().__init__(spec, quant_config, bias=bias)
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.shard_sizes = list(shard_sizes)
        self.shard_starts = list(shard_starts)
        self.part_names = list(part_names)
        self.offsets = [*spec.output_offsets, spec.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device, reduce_results: bool = True,
                 prefix: str = "row_parallel", quant_config: QuantizationConfig | None = None):
        if input_size % tp_size:
            raise ValueError(f"row-parallel input size {input_size} is not divisible by tp_size {tp_size}")
        if bias and not reduce_results:
            raise ValueError("a row-parallel bias needs reduce_results (it is added once, after the sum)")
        shard = input_size // tp_size
        spec = LinearSpec(input_size=input_size, output_sizes=(output_size,), output_slices=((0, output_size),),
                          input_slice=(tp_rank * shard, shard), prefixes=(prefix,), params_dtype=dtype,
                          device=torch.device(device), tp_rank=tp_rank, tp_size=tp_size)
        super().__init__(spec, quant_config, bias=bias)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # False when the caller sums several partial results first and all-reduces once (MoE).
        self.reduce_results = reduce_results
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x)
        if not self.reduce_results:
            return out
        out = all_reduce(out, self.tp_size)
        # The bias is added once, after the sum, not once per rank.
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(LinearBase):
    """Rows of the vocabulary split across ranks (padded so each rank holds the same count).

    Its weight is also the output projection (`logits`): of an untied LM head, or of a tied
    embedding. A format that covers the vocabulary (int8, int4) quantizes it; others keep it in
    the compute dtype.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device, prefix: str = "model.embed_tokens",
                 quant_config: QuantizationConfig | None = None):
        shard = math.ceil(vocab_size / tp_size)
        start = min(tp_rank * shard, vocab_size)
        end = min(start + shard, vocab_size)
        spec = LinearSpec(input_size=hidden_size, output_sizes=(vocab_size,), output_slices=((start, end - start),),
                          input_slice=(0, hidden_size), prefixes=(prefix,), params_dtype=dtype,
                          device=torch.device(device), output_padding=shard - (end - start), tp_rank=tp_rank,
                          tp_size=tp_size, role="lm_head")
        if quant_config is not None and not quant_config.quantizes_vocab():
            quant_config = None
        super().__init__(spec, quant_config, bias=False)
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.shard, self.start, self.end = shard, start, end

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embed(self, input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = self.quant_method.embed(self, local.masked_fill(outside, 0))
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Uses this table as the output projection (also how tied embeddings work)."""
        local = self.quant_method.apply(self, hidden)
        full = all_gather_last_dim(local, self.tp_size)
        return full[..., : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """The untied output projection, sharded like the embedding; logits are gathered to full vocab."""

    def __init__(self, vocab_size: int, hidden_size: int, *, prefix: str = "lm_head", **kw):
        super().__init__(vocab_size, hidden_size, prefix=prefix, **kw)
