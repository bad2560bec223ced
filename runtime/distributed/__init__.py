"""Tensor parallelism: worker processes, the process group, and the executor that feeds them."""

from kvserve.runtime.distributed.executor import (
    TensorParallelError,
    TensorParallelExecutor,
    WorkerDiedError,
    check_tensor_parallel,
)

__all__ = ["TensorParallelError", "TensorParallelExecutor", "WorkerDiedError", "check_tensor_parallel"]
