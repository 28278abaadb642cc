"""The original's ``horovod.torch.mpi_ops``: every collective on torch tensors, in one namespace.

Two modules hold them, so that neither imports the other's user: :mod:`horovod.torch.engine_ops` (asynchronous
and in-place operations, handles, queries) and :mod:`horovod.torch.autograd_ops` (the differentiable blocking
forms, built on the former).
"""
from horovod.torch.engine_ops import (Adasum, Average, HorovodInternalError, Max, Min, ProcessSet, Product, Sum,
                                      add_process_set, allgather_async, allreduce_, allreduce_async, allreduce_async_,
                                      alltoall_async, barrier, broadcast_, broadcast_async, broadcast_async_,
                                      ccl_built, cross_rank, cross_size, cuda_built, ddl_built, global_process_set,
                                      gloo_built, gloo_enabled, grouped_allgather_async, grouped_allreduce_,
                                      grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter_async,
                                      handle_average_backwards_compatibility, init, is_homogeneous, is_initialized,
                                      join, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                                      nccl_built, poll, rank, reducescatter_async, remove_process_set, rocm_built,
                                      shutdown, size, sparse_allreduce_async, start_timeline, stop_timeline,
                                      synchronize)
from horovod.torch.engine_ops import _check_has_gpu  # noqa: F401  (horovod.torch re-exports it)
from horovod.torch.autograd_ops import (HorovodAllgather, HorovodAllreduce, HorovodAlltoall, HorovodBroadcast,
                                        HorovodGroupedAllgather, HorovodGroupedAllreduce, HorovodGroupedReducescatter,
                                        HorovodReducescatter, allgather, allreduce, alltoall, broadcast,
                                        grouped_allgather, grouped_allreduce, grouped_reducescatter, reducescatter)

# The original's names, listed for `import *`, IDEs and mypy (tests/test_public_names.py holds it to the record).
__all__ = [
    "Adasum", "Average", "HorovodAllgather", "HorovodAllreduce", "HorovodAlltoall", "HorovodBroadcast",
    "HorovodGroupedAllgather", "HorovodGroupedAllreduce", "HorovodGroupedReducescatter", "HorovodInternalError",
    "HorovodReducescatter", "Max", "Min", "ProcessSet", "Product", "Sum", "add_process_set", "allgather",
    "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "handle_average_backwards_compatibility", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async",
    "start_timeline", "stop_timeline", "synchronize"
]
