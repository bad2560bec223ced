"""A server's parallel layout, data-parallel engines x tensor-parallel ranks over its G devices,
and the pure decisions of changing it live (runtime/engine/data_parallel.py is the shell).

Pure: no torch, no processes. What a reshape decides here: whether a target layout is valid for
the devices and the model (a ValueError naming the field otherwise), which devices each engine
takes, and which engine each resumed or new request goes to (least outstanding work first, so
the engines of a layout fill evenly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    data_parallel: int
    tensor_parallel: int

    @property
    def devices(self) -> int:
        return self.data_parallel * self.tensor_parallel

    def __str__(self) -> str:
        return f"{self.data_parallel}xTP{self.tensor_parallel}"


def check_layout(layout: Layout, num_devices: int, tp_error: Callable[[int], str | None] | None = None) -> None:
    """Raises ValueError naming the field when `layout` cannot run on this server's devices.

    `tp_error(tp)` says why the model cannot be split `tp` ways (None when it can)."""
    for name, value in (("data_parallel", layout.data_parallel), ("tensor_parallel", layout.tensor_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if layout.devices != num_devices:
        raise ValueError(f"data_parallel x tensor_parallel: {layout.data_parallel} x {layout.tensor_parallel} = "
                         f"{layout.devices} devices, this server owns {num_devices} "
                         f"(--data-parallel-size x --tensor-parallel-size at start)")
    if layout.data_parallel > 1 and layout.tensor_parallel > 1:
        # Rank 0 of a tensor-parallel engine lives in the server's process and joins the one
        # default torch.distributed group a process can have: a second such engine cannot.
        raise ValueError(f"tensor_parallel: {layout.data_parallel} data-parallel engines of "
                         f"{layout.tensor_parallel} ranks each are not supported yet (one tensor-parallel "
                         "group per server process); use data_parallel 1 or tensor_parallel 1")
    if tp_error is not None and layout.tensor_parallel > 1:
        error = tp_error(layout.tensor_parallel)
        if error:
            raise ValueError(f"tensor_parallel: {error}")


def engine_devices(layout: Layout, device: str) -> list[str]:
    """The first device of each data-parallel engine: engine i takes ranks' devices
    [i*tp, (i+1)*tp) from the server's first GPU; on a CPU every engine is on "cpu"."""
    if not device.startswith("cuda"):
        return [device] * layout.data_parallel
    first = int(device.split(":", 1)[1]) if ":" in device else 0
    return [f"cuda:{first + i * layout.tensor_parallel}" for i in range(layout.data_parallel)]


def pick_engine(loads: Sequence[int]) -> int:
    """The engine with the least outstanding work (the first of equals)."""
    return min(range(len(loads)), key=lambda i: (loads[i], i))


def assign(loads: Sequence[int], costs: Sequence[int]) -> list[int]:
    """Engine index for each item of `costs` in order, each to the least loaded engine so far
    (loads and costs in the same unit: tokens to recompute, or requests)."""
    loads = list(loads)
    out = []
    for cost in costs:
        i = pick_engine(loads)
        out.append(i)
        loads[i] += cost
    return out


# -- prefix affinity: a request goes where its prompt's prefix ran, unless that engine is busier --
PREFIX_BLOCK_TOKENS = 16  # tokens (or 4x as many characters of a text prompt) per key
PREFIX_SLACK = 2  # unfinished requests an engine may have beyond the least loaded and still win


def prefix_keys(prompt, block: int = PREFIX_BLOCK_TOKENS, max_blocks: int = 256) -> list[int]:
    """Chained keys of the prompt's leading full blocks (key i covers blocks 0..i), so two prompts
    share exactly the keys of the blocks they share. Token ids when the prompt has them, else the
    text in blocks of 4 x `block` characters; [] for anything else."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if isinstance(prompt, str):
        items, size = prompt, 4 * block
    elif isinstance(prompt, (list, tuple)):
        items, size = prompt, block
    else:
        return []
    keys, key = [], 0
    for start in range(0, min(len(items) // size, max_blocks) * size, size):
        key = hash((key, tuple(items[start:start + size]) if not isinstance(items, str) else items[start:start + size]))
        keys.append(key)
    return keys


def choose_engine(loads: Sequence[int], preferred: int | None, slack: int = PREFIX_SLACK) -> int:
    """The engine that served the prompt's longest known prefix (its cache holds it) unless it has
    more than `slack` unfinished requests beyond the least loaded; else the least loaded."""
    least = pick_engine(loads)
    if preferred is not None and 0 <= preferred < len(loads) and loads[preferred] <= loads[least] + slack:
        return preferred
    return least
