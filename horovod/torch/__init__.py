"""horovod.torch: distributed training for PyTorch, drop-in for Horovod 0.28.1 scripts.

``import horovod.torch as hvd``; ``hvd.init()``; wrap the optimizer in :func:`DistributedOptimizer`; broadcast the
initial state with :func:`broadcast_parameters` / :func:`broadcast_optimizer_state`.  The collectives take torch
tensors (any dtype the engine moves, including bfloat16 and bool; tensors on other devices are staged through
host memory).  Everything underneath is the framework-neutral engine in :mod:`horovod.engine`.
"""
from __future__ import annotations

from horovod.common.exceptions import HorovodInternalError  # noqa: F401
from horovod.common.basics import dump_flight_recorder  # noqa: F401,E402  (the hang doctor)
from horovod.torch.compression import Compression  # noqa: F401
from horovod.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,  # noqa: F401
                                     broadcast_parameters)
from horovod.torch.mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,  # noqa: F401
                                   _check_has_gpu, add_process_set, allgather, allgather_async, allreduce,
                                   allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier,
                                   broadcast, broadcast_, broadcast_async, broadcast_async_, ccl_built, cross_rank,
                                   cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, global_process_set,
                                   grouped_allgather, grouped_allgather_async, grouped_allreduce,
                                   grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                                   grouped_reducescatter, grouped_reducescatter_async, init, is_homogeneous,
                                   is_initialized, join,
                                   local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                                   nccl_built, poll, rank, reducescatter, reducescatter_async, remove_process_set,
                                   rocm_built, shutdown, size, sparse_allreduce_async, start_timeline,
                                   stop_timeline, synchronize)
from horovod.torch.optimizer import DistributedOptimizer  # noqa: F401
from horovod.torch.sync_batch_norm import SyncBatchNorm  # noqa: F401
from horovod.torch import elastic  # noqa: F401,E402

# The public API, listed for `import *`, IDEs and mypy (tests/test_public_names.py holds it to the record).
__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min", "ProcessSet",
    "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async",
    "start_timeline", "stop_timeline", "synchronize", "dump_flight_recorder", "is_homogeneous"
]
