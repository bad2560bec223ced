"""The device family a process runs on (cpu or cuda), chosen once per process: the one place that
knows what the device can do and which kernels serve it.

Everything device-specific that the executor and the workers used to decide inline goes through
here: the attention backend for "auto", the collective backend of a tensor-parallel group, whether
decode steps may be captured as CUDA graphs and the model compiled, how much memory the KV pools
may take, and how memory is handed back when an engine closes. Whether kvserve's native CPU
kernels (kvserve.kernels.cpu) serve an operation is asked here too, one named question per
operation (``native_ops``, ``native_write_kv``, ``native_decode_attention``,
``native_token_bitmask``): the attention backend, the model and the sampler ask the platform of
their tensors' device instead of deciding for themselves. The quantized linear methods ask it
which form an int4/int8 weight takes at load (``native_int_weights``: kvserve's native panels;
``torch_packed_int_weights``: torch's packed CPU layouts) and which kernel multiplies activations
by an int4/int8 weight (``int_matmul_kernel``) or an FP8 one (``fp8_matmul_kernel``); the
switches tests and benchmarks flip (``set_cpu_packed``, ``set_cpu_native``) stay in
runtime/models/quantization/packed.py and narrow what the platform offers.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Activation rows above which a CUDA int4/int8 matmul dequantizes the weight to the compute dtype
# and calls cuBLAS: the Triton dequant-GEMM's tiles are sized for decode's few rows (split-K),
# and a prefill of many rows amortises one dequantization over all of them.
DEQUANT_GEMM_MIN_ROWS = 64


def int_matmul_choice(rows: int, *, triton: bool, group_ok: bool, dequant_min_rows: int | None) -> str:
    """"triton" (the dequant-GEMM kernel), "dequant" (dequantize, then a dense matmul: cuBLAS on a
    GPU) or "twin" (the torch twin, also dequantize-then-matmul, where no kernel applies)."""
    if not triton:
        return "twin"
    if dequant_min_rows is not None and rows > dequant_min_rows:
        return "dequant"
    return "triton" if group_ok else "twin"


def fp8_matmul_choice(*, scaled_mm: bool, triton: bool) -> str:
    """"scaled_mm" (torch._scaled_mm with rowwise scales: cuBLASLt's FP8 GEMM), "triton" (the
    kernel of kvserve.kernels.quant) or "twin" (float32 emulation)."""
    return "scaled_mm" if scaled_mm else "triton" if triton else "twin"


def scaled_mm_rowwise_ok(out_dtype: torch.dtype, n: int, k: int, capability: tuple[int, int] | None) -> bool:
    """Whether torch._scaled_mm takes this GEMM with per-row activation and per-column weight
    scales on a GPU of `capability`: rowwise scaling needs a bfloat16 output, dimensions that are
    multiples of 16 and (as kvserve uses it) a Hopper-class GPU; elsewhere the Triton kernel runs."""
    return (hasattr(torch, "_scaled_mm") and capability is not None and capability >= (9, 0)
            and out_dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0)


@dataclass(frozen=True)
class Platform:
    name: str  # "cpu" | "cuda"
    dist_backend: str  # the torch.distributed backend of a tensor-parallel group
    default_attention_backend: str  # what "auto" resolves to
    supports_cuda_graphs: bool
    supports_compile: bool  # torch.compile of the model's forward (compilation_config level 3)

    def set_device(self, device: torch.device) -> None:
        """Makes `device` this process's current device (kernels launch there)."""

    def attention_backend_name(self, requested: str) -> str:
        return self.default_attention_backend if requested == "auto" else requested

    def free_memory_bytes(self, device: torch.device) -> tuple[int, int] | None:
        """(free, total) device memory, or None where the device has no fixed memory to share."""
        return None

    def release_memory(self) -> None:
        """Returns what dropped tensors held to the allocator's owner (the OS, the driver)."""
        gc.collect()

    # What the KV sizing measures around its profiling runs (runtime/executor/worker.py); only
    # read where free_memory_bytes is not None.
    def memory_allocated(self, device: torch.device) -> int:
        return 0

    def reset_peak_memory(self, device: torch.device) -> None:
        pass

    def peak_memory_allocated(self, device: torch.device) -> int:
        return 0

    def synchronize(self, device: torch.device) -> None:
        pass

    def native_kernels(self) -> bool:
        """Whether kvserve's native CPU kernels are loaded and serve float32 work here."""
        return False

    def native_ops(self, t: torch.Tensor) -> bool:
        """The native layer ops and the one-call decode stack, for tensors like `t`."""
        return False

    def native_write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return False

    def native_decode_attention(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return False

    def native_token_bitmask(self, logits: torch.Tensor) -> bool:
        """The grammar bitmask applied by the native kernel (xgrammar's tests one bit at a time)."""
        return False

    dequant_gemm_min_rows: int | None = None  # see DEQUANT_GEMM_MIN_ROWS; None: never

    def native_int_weights(self) -> bool:
        """Whether int4/int8 weights here are repacked at load for kvserve's native kernels."""
        return False

    def torch_packed_int_weights(self) -> bool:
        """Whether int4/int8 weights here may take torch's packed CPU layouts
        (aten._weight_int4pack_mm_for_cpu, aten._weight_int8pack_mm)."""
        return False

    def int_matmul_kernel(self, x: torch.Tensor, group_size: int) -> str:
        """Which kernel multiplies activations `x` [.., K] by an int4/int8 weight with groups of
        `group_size` (int_matmul_choice's answers). Triton under the kernel mode (kernels/ops.py:
        CUDA, or the interpreter when forced)."""
        from kvserve.kernels import ops

        triton = ops.use_triton(x)
        group_ok = False
        if triton:
            from kvserve.kernels import quant

            group_ok = quant.supports_group(group_size)
        return int_matmul_choice(x.numel() // max(1, x.shape[-1]), triton=triton, group_ok=group_ok,
                                 dequant_min_rows=self.dequant_gemm_min_rows)

    def fp8_matmul_kernel(self, x: torch.Tensor, weight: torch.Tensor) -> str:
        """Which kernel multiplies FP8-quantized activations by an FP8 weight [N, K] (W8A8)."""
        from kvserve.kernels import ops

        return fp8_matmul_choice(scaled_mm=False, triton=ops.use_triton(x) and x.is_cuda)


@dataclass(frozen=True)
class CpuPlatform(Platform):
    name: str = "cpu"
    dist_backend: str = "gloo"
    default_attention_backend: str = "torch"
    supports_cuda_graphs: bool = False
    # The native CPU kernels are opaque calls that torch.compile would only break the graph around.
    supports_compile: bool = False

    def native_kernels(self) -> bool:
        from kvserve.kernels.cpu import native

        return native.available()

    def native_ops(self, t: torch.Tensor) -> bool:
        from kvserve.kernels import ops

        return ops.use_native(t)  # float32 CPU tensors, under the kernel mode (KVSERVE_CPU_KERNELS)

    def native_write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor) -> bool:
        from kvserve.kernels.cpu import native

        return self.native_ops(key) and native.write_kv_supported(key, value, k_cache)  # float32 pools only

    def native_decode_attention(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        from kvserve.kernels.cpu import native

        return self.native_ops(query) and native.decode_supported(query, k_cache)

    def native_token_bitmask(self, logits: torch.Tensor) -> bool:
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            return False
        return self.native_kernels()

    def native_int_weights(self) -> bool:
        return self.native_kernels()

    def torch_packed_int_weights(self) -> bool:
        return True


@dataclass(frozen=True)
class CudaPlatform(Platform):
    name: str = "cuda"
    dist_backend: str = "nccl"
    default_attention_backend: str = "triton"
    supports_cuda_graphs: bool = True
    supports_compile: bool = True

    def set_device(self, device: torch.device) -> None:
        # Without it every rank (and cuda:N of a single engine) would launch on cuda:0. A bare
        # "cuda" means the current device (torch refuses to set a device without an index).
        if device.index is not None:
            torch.cuda.set_device(device)

    def attention_backend_name(self, requested: str) -> str:
        if requested != "auto":
            return requested
        try:
            import kvserve.runtime.attention.triton_backend  # noqa: F401  (needs triton)
        except ImportError:
            return "torch"
        return "triton"

    dequant_gemm_min_rows: int | None = DEQUANT_GEMM_MIN_ROWS

    def fp8_matmul_kernel(self, x: torch.Tensor, weight: torch.Tensor) -> str:
        from kvserve.kernels import ops

        n, k = weight.shape
        ok = scaled_mm_rowwise_ok(x.dtype, n, k, torch.cuda.get_device_capability(x.device))
        return fp8_matmul_choice(scaled_mm=ok, triton=ops.use_triton(x))

    def free_memory_bytes(self, device: torch.device) -> tuple[int, int] | None:
        self.release_memory()
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)

    def release_memory(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()

    def memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.memory_allocated(device)

    def reset_peak_memory(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def peak_memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


CPU = CpuPlatform()
CUDA = CudaPlatform()


# Depth of held releases on this thread (held_release): while it is above 0, a closing Worker
# leaves the full garbage collection to the caller.
_held = threading.local()


@contextlib.contextmanager
def held_release(platform: Platform, release: bool = True):
    """Closes several engines with one release_memory at the end instead of one per rank: a full
    collection takes most of a second in a process holding torch and transformers, and a live
    reshape closing G engines paid it G times (runtime/engine/data_parallel.py). `release=False`:
    none at the end either (the caller collects later)."""
    _held.depth = getattr(_held, "depth", 0) + 1
    try:
        yield
    finally:
        _held.depth -= 1
        if not _held.depth and release:
            platform.release_memory()


def release_is_held() -> bool:
    return getattr(_held, "depth", 0) > 0


def platform_for(device: torch.device | str) -> Platform:
    """The platform of a device: CPU or CUDA (which device of the family is the worker's business)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu":
        return CPU
    if kind == "cuda":
        return CUDA
    raise ValueError(f"device: {kind!r} is not supported; use 'cpu' or 'cuda[:N]'")


def resolve_device(device: str) -> torch.device:
    """'auto' picks CUDA when present; 'cuda[:N]' must exist."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r} but only {torch.cuda.device_count()} GPUs are visible")
    return resolved
