"""The model-execution side of the engine: executors (one process, or one per tensor-parallel
rank), the Worker every rank runs, and the Platform that knows the device.

    base.py           Executor: the engine core's interface; rank 0's runner, sampler, spec decoding
    uniproc.py        UniProcExecutor: tensor_parallel_size 1
    multiproc.py      MultiProcExecutor: ranks 1..N-1 in worker processes, failures named by rank
    worker.py         Worker: one rank's weights, KV pools, CUDA graphs and forward pass
    pipeline_worker.py PipelineWorker: one pipeline stage's shard; activations sent stage to stage
    worker_process.py the process around a Worker of rank 1..N-1
    model_runner.py   ModelRunner: packs a step into a ForwardInput, samples the logits
    forward_input.py  ForwardInput: one forward pass, as every rank receives it
    protocol.py       the bytes between rank 0 and its workers
    platform.py       Platform (cpu, cuda): kernels, collectives, memory, graphs
    cuda_graphs.py    uniform steps (decode, speculative verification) replayed from CUDA graphs
    verify_graphs.py  which verification steps replay graphs (pure policy)
    verify_padding.py short verification queries padded to a captured query length

Names are imported lazily, so ``kvserve.runtime.executor.protocol`` pulls in nothing else.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Executor": "base",
    "UniProcExecutor": "uniproc",
    "MultiProcExecutor": "multiproc",
    "TensorParallelError": "multiproc",
    "WorkerDiedError": "multiproc",
    "check_tensor_parallel": "multiproc",
    "Worker": "worker",
    "Platform": "platform",
    "platform_for": "platform",
    "create_executor": None,
}

__all__ = list(_EXPORTS)


def create_executor(config, model_config, *, device, dtype, max_model_len: int, quant_config=None):
    """One process (TP 1, PP 1), or one process per rank (tensor_parallel_size x pipeline_parallel_size)."""
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        from kvserve.runtime.executor.multiproc import MultiProcExecutor as cls
    else:
        from kvserve.runtime.executor.uniproc import UniProcExecutor as cls
    return cls(config, model_config, device=device, dtype=dtype, max_model_len=max_model_len,
               quant_config=quant_config)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
