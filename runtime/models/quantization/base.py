"""The linear-method interface: what every weight format implements, and the sharded loader they share.

A linear layer (fused column-parallel, row-parallel, the LM head) describes itself once as a
`LinearSpec`: the checkpoint's full sizes and this tensor-parallel rank's slice of them. Its
`LinearMethod` then

1. ``create_weights(layer, spec)`` registers this rank's parameters on the layer, named as the
   checkpoint names them (``weight``; ``qweight``/``qzeros``/``scales``; ``weight_packed``; ...),
   each built with `sharded_param` so that it knows which axis holds output or input features and
   how many features one index covers (a packing factor, a group size);
2. receives checkpoint tensors through each parameter's ``weight_loader(param, tensor, shard_id)``
   (`load_sharded`), which slices this rank's part out of the *whole* checkpoint tensor, refuses a
   tensor-parallel degree that would split a pack or a quantization group, and refuses a tensor
   whose shape does not match the declared format;
3. ``process_weights_after_loading(layer)`` turns what was loaded into what the kernel wants
   (unpacking a checkpoint layout, quantizing at load time, repacking for torch's CPU kernels);
4. ``apply(layer, x, bias)`` computes ``x @ W.T (+ bias)`` for a [tokens, in_features] input in
   the model's compute dtype and returns [tokens, out_features_of_this_rank] in that dtype.
   Row-parallel layers all-reduce the result afterwards, so `apply` never communicates.

Methods that also cover a vocabulary table (the LM head, and a tied embedding) implement
``embed(layer, ids)``: the dequantized rows of the table.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvserve.runtime.weight_formats.base import FormatConfig


@dataclass(frozen=True)
class LinearSpec:
    """One linear layer on one tensor-parallel rank.

    ``output_sizes`` are the checkpoint's full output features per fused part (q|k|v, gate|up, or
    one part); ``output_slices`` this rank's (start, size) of each part, laid out one after the
    other in the rank's output; ``input_slice`` this rank's (start, size) of the input features
    (the whole input unless the layer is row-parallel). ``output_padding`` rows follow the parts
    and stay zero (a vocabulary that tp does not divide). ``prefixes`` are the checkpoint module
    names of the parts ("model.layers.0.self_attn.q_proj", ...), used for per-module rules and in
    messages.
    """

    input_size: int
    output_sizes: tuple[int, ...]
    output_slices: tuple[tuple[int, int], ...]
    input_slice: tuple[int, int]
    prefixes: tuple[str, ...]
    part_names: tuple[str | None, ...] = (None,)
    params_dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    output_padding: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    # "linear" for projections, "lm_head" for the output projection (and a tied embedding).
    role: str = "linear"

    @property
    def in_features(self) -> int:
        """Input features on this rank."""
        return self.input_slice[1]

    @property
    def out_features(self) -> int:
        """Output rows on this rank, padding included."""
        return sum(size for _, size in self.output_slices) + self.output_padding

    @property
    def output_offsets(self) -> tuple[int, ...]:
        offsets, at = [], 0
        for _, size in self.output_slices:
            offsets.append(at)
            at += size
        return tuple(offsets)

    @property
    def input_is_sharded(self) -> bool:
        return self.input_slice != (0, self.input_size)

    @property
    def name(self) -> str:
        """The layer as messages name it: its first part's checkpoint name (others as "+k|v")."""
        if len(self.prefixes) == 1:
            return self.prefixes[0]
        return self.prefixes[0] + "".join(f"|{p.rsplit('.', 1)[-1]}" for p in self.prefixes[1:])

    def part_index(self, shard_id: str | None) -> int:
        if shard_id not in self.part_names:
            raise ValueError(f"weight part {shard_id!r}: expected one of {list(self.part_names)}")
        return self.part_names.index(shard_id)


class LinearMethod:
    """How one weight format stores and multiplies a linear layer. Subclasses override all four."""

    #: The format's name in messages and metrics ("unquantized", "int8", "awq", ...).
    name = "unquantized"

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every checkpoint tensor of the layer is loaded."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a vocabulary table, dequantized into the compute dtype."""
        raise NotImplementedError(f"{self.name}: this format cannot hold an embedding table")


class PackedWeightApplier(LinearMethod):
    """apply/embed for methods whose layers end up holding a packed weight object (an `Int8Weight`
    or `Int4Weight`) under the attribute `weight_attr`: its matmul, plus the bias; its rows."""

    weight_attr = ""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = getattr(layer, self.weight_attr).matmul(x)
        return out + bias if bias is not None else out

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return getattr(layer, self.weight_attr).rows(ids)


class QuantizationConfig(FormatConfig):
    """A format's choice of method per layer: the torch half of its `FormatConfig` (parsing,
    bytes per weight, ``describe`` and ``quantizes_vocab`` live there, torch-free).

    ``get_linear_method`` may answer the unquantized method for layers the checkpoint left in
    full precision (an ``ignore`` list, an unquantized LM head).
    """

    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        raise NotImplementedError

    def check_supported(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raises ValueError when this device or compute dtype cannot run the format."""


# ----------------------------------------------------------------------------- sharded parameters


# Set while a model is built only to receive tensors loaded before (runtime/models/host_weights.py):
# its parameters are replaced before any read, so filling them would be wasted work.
_no_fill = threading.local()


@contextlib.contextmanager
def parameters_replaced() -> Iterator[None]:
    _no_fill.on = True
    try:
        yield
    finally:
        _no_fill.on = False


def _set_attrs(param: torch.Tensor, **attrs: Any) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


def sharded_param(layer: nn.Module, name: str, spec: LinearSpec, shape: tuple[int, ...], dtype: torch.dtype, *,
                  out_dim: int | None = None, out_div: int = 1, in_dim: int | None = None, in_div: int = 1,
                  shard_input: bool = True, per_part: bool = False, optional: bool = False,
                  fill: float | int | None = 0, loader: Callable[..., None] | None = None) -> nn.Parameter:
    """Registers a parameter named as the checkpoint names it, with what `load_sharded` needs.

    `out_dim`/`in_dim`: the axes holding output/input features; `out_div`/`in_div`: features
    per index on that axis (8 for eight 4-bit values packed in an int32, g for one scale per
    group of g). `shard_input=False` keeps every input index on every rank (GPTQ's act-order
    scales). `per_part`: one scalar per fused part (an FP8 per-tensor scale). `optional`: the
    checkpoint may lack it (the method then supplies a default in process_weights_after_loading).
    """
    data = torch.empty(shape, dtype=dtype, device=spec.device)
    if fill is not None and not getattr(_no_fill, "on", False):
        data.fill_(fill)
    param = nn.Parameter(data, requires_grad=False)
    _set_attrs(param, out_dim=out_dim, out_div=out_div, in_dim=in_dim, in_div=in_div, shard_input=shard_input,
               per_part=per_part, optional=optional, spec=spec, loaded_parts=set(),
               weight_loader=loader or load_sharded)
    layer.register_parameter(name, param)
    return param


def _features(extent: int, div: int) -> int:
    return -(-extent // div)


def load_sharded(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
    """Copies this rank's slice of a whole checkpoint tensor into `param` (see `sharded_param`)."""
    spec: LinearSpec = param.spec
    i = spec.part_index(shard_id)
    what = f"{spec.prefixes[i]}.{_param_name(param)}"
    if param.per_part:
        if loaded.numel() != 1:
            raise ValueError(f"weight {what}: expected one per-tensor value, checkpoint has shape "
                             f"{tuple(loaded.shape)}")
        param.data[i] = loaded.reshape(()).to(param.dtype)
        param.loaded_parts.add(i)
        return
    src, dst = loaded, param.data
    if param.out_dim is not None:
        d = param.out_div
        full = spec.output_sizes[i]
        start, size = spec.output_slices[i]
        offset = spec.output_offsets[i]
        if src.dim() <= param.out_dim or src.shape[param.out_dim] != _features(full, d):
            raise ValueError(f"weight {what}: checkpoint shape {tuple(loaded.shape)} does not match the "
                             f"layout (expected {_features(full, d)} along axis {param.out_dim} for "
                             f"{full} output features{f' packed {d} per element' if d > 1 else ''})")
        if offset % d:
            raise ValueError(f"{spec.name}: fused part {spec.prefixes[i]} starts at output feature {offset}, "
                             f"inside a pack of {d}; this layout cannot hold it")
        if start % d or (size % d and start + size != full):
            raise ValueError(f"tensor_parallel_size {spec.tp_size}: {spec.prefixes[i]} would split "
                             f"{d} packed output features between ranks (output features {full})")
        src = src.narrow(param.out_dim, start // d, _features(size, d))
        dst = dst.narrow(param.out_dim, offset // d, _features(size, d))
    if param.in_dim is not None:
        d = param.in_div
        if src.dim() <= param.in_dim or src.shape[param.in_dim] != _features(spec.input_size, d):
            raise ValueError(f"weight {what}: checkpoint shape {tuple(loaded.shape)} does not match the "
                             f"layout (expected {_features(spec.input_size, d)} along axis {param.in_dim} "
                             f"for {spec.input_size} input features{f' in groups/packs of {d}' if d > 1 else ''})")
        if param.shard_input and spec.input_is_sharded:
            start, size = spec.input_slice
            if start % d or size % d:
                raise ValueError(f"tensor_parallel_size {spec.tp_size}: {spec.prefixes[i]} would split a "
                                 f"quantization group or pack of {d} input features between ranks "
                                 f"({spec.input_size} input features, {size} per rank)")
            src = src.narrow(param.in_dim, start // d, size // d)
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"weight {what}: checkpoint shape {tuple(loaded.shape)} does not match the "
                         f"layout (this rank expects {tuple(dst.shape)})")
    dst.copy_(src)
    param.loaded_parts.add(i)


def _param_name(param: torch.Tensor) -> str:
    return getattr(param, "checkpoint_name", "weight")


def register_checkpoint_names(layer: nn.Module) -> None:
    """Records each parameter's own name on it, for messages."""
    for name, p in layer.named_parameters(recurse=False):
        p.checkpoint_name = name


def replace_param(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Swaps a loaded parameter for its processed form (or drops it), outside autograd."""
    if name in layer._parameters:
        del layer._parameters[name]
    if value is not None:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
