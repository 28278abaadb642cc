"""horovod.numpy: the collectives on numpy arrays, with the names and semantics of ``horovod.torch``.

Needs nothing but numpy.  ``*_async`` functions return an integer handle for :func:`poll` / :func:`synchronize`;
functions ending in ``_`` work in place.  All ranks of the process set must call each collective in the same
order.
"""
from __future__ import annotations

from horovod.common.adapter import ArrayAdapter
from horovod.common.basics import dump_flight_recorder  # noqa: F401,E402  (the hang doctor)
from horovod.common.basics import (Adasum, Average, Max, Min, Product, Sum, ccl_built, cross_rank,  # noqa: F401
                                   cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous,
                                   is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                   mpi_threads_supported, nccl_built, rank, rocm_built, size, start_timeline,
                                   stop_timeline)
from horovod.common.binding_ops import HandleCollectives
from horovod.common.exceptions import HorovodInternalError  # noqa: F401
from horovod.common.objects import allgather_object as _allgather_object
from horovod.common.objects import broadcast_object as _broadcast_object
from horovod.common.process_sets import (ProcessSet, _set_id, add_process_set,  # noqa: F401
                                         global_process_set, remove_process_set)

# The public API, listed for `import *`, IDEs and mypy (tests/test_public_names.py holds it to the record).
__all__ = [
    "Adasum", "Average", "HorovodInternalError", "Max", "Min", "ProcessSet", "Product", "Sum", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline", "synchronize", "dump_flight_recorder"
]

# The asynchronous collectives, handles, init and shutdown are shared with horovod.torch
# (horovod/common/binding_ops.py); numpy arrays cross into the engine as they are (ArrayAdapter: bfloat16 arrays
# of ml_dtypes as their bits, non-contiguous inputs copied, in-place forms refuse what they cannot write into).
_collectives = HandleCollectives(ArrayAdapter(), __name__)

# Its public functions are the shared object's bound methods (MODULE_FUNCTIONS; tests/test_public_names.py checks
# that this list is complete), spelled out so that IDEs, mypy and readers see them.
init = _collectives.init
shutdown = _collectives.shutdown
poll = _collectives.poll
synchronize = _collectives.synchronize
allreduce_async = _collectives.allreduce_async
allreduce_async_ = _collectives.allreduce_async_
allreduce_ = _collectives.allreduce_
grouped_allreduce_async = _collectives.grouped_allreduce_async
grouped_allreduce_async_ = _collectives.grouped_allreduce_async_
grouped_allreduce_ = _collectives.grouped_allreduce_
allgather_async = _collectives.allgather_async
grouped_allgather_async = _collectives.grouped_allgather_async
broadcast_async = _collectives.broadcast_async
broadcast_async_ = _collectives.broadcast_async_
broadcast_ = _collectives.broadcast_
alltoall_async = _collectives.alltoall_async
reducescatter_async = _collectives.reducescatter_async
grouped_reducescatter_async = _collectives.grouped_reducescatter_async
join = _collectives.join
barrier = _collectives.barrier


# -- the blocking forms that return new arrays: results returned directly, no integer handle -------------------
allreduce = _collectives.allreduce
grouped_allreduce = _collectives.grouped_allreduce
allgather = _collectives.allgather
grouped_allgather = _collectives.grouped_allgather
broadcast = _collectives.broadcast
reducescatter = _collectives.reducescatter
grouped_reducescatter = _collectives.grouped_reducescatter


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Returns ``output`` when ``splits`` is None, else ``(output, received_splits)``."""
    output, received = _collectives.run(_collectives.start_alltoall(tensor, splits, name, process_set,
                                                                     attended=True))
    return output if splits is None else (output, received)


# -- objects --------------------------------------------------------------------------------------------------
def broadcast_object(obj, root_rank: int = 0, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` on every rank (any picklable value)."""
    return _broadcast_object(obj, root_rank, name, _set_id(process_set))


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return every rank's ``obj`` as a list in rank order."""
    return _allgather_object(obj, name, _set_id(process_set))
