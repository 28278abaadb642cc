"""horovod.numpy: the collectives on numpy arrays, with the names and semantics of ``horovod.torch``.

Needs nothing but numpy.  ``*_async`` functions return an integer handle for :func:`poll` / :func:`synchronize`;
functions ending in ``_`` work in place.  All ranks of the process set must call each collective in the same
order.
"""
from __future__ import annotations

from typing import List

import numpy as np

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
from horovod.engine.collectives import blocking

# The asynchronous collectives, handles, init and shutdown are shared with horovod.torch
# (horovod/common/binding_ops.py); numpy arrays cross into the engine as they are (ArrayAdapter: bfloat16 arrays
# of ml_dtypes as their bits, non-contiguous inputs copied, in-place forms refuse what they cannot write into).
_collectives = HandleCollectives(ArrayAdapter(), __name__)

_collectives.export(globals())   # init, shutdown, poll, synchronize and the *_async forms


# -- the blocking forms that return new arrays -----------------------------------------------------------------
@blocking
def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set) -> np.ndarray:
    """Reduce ``tensor`` across ranks (default: average) and return the result."""
    return _collectives.synchronize(_collectives.allreduce_async(tensor, average, name, op, prescale_factor,
                                                                 postscale_factor, process_set))


@blocking
def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> List[np.ndarray]:
    """Reduce a list of arrays as one atomic group; returns a list of new arrays."""
    return _collectives.synchronize(_collectives.grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                                                         postscale_factor, process_set))


@blocking
def allgather(tensor, name=None, process_set=global_process_set) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along dimension 0."""
    return _collectives.synchronize(_collectives.allgather_async(tensor, name, process_set))


@blocking
def grouped_allgather(tensors, name=None, process_set=global_process_set) -> List[np.ndarray]:
    return _collectives.synchronize(_collectives.grouped_allgather_async(tensors, name, process_set))


@blocking
def broadcast(tensor, root_rank: int, name=None, process_set=global_process_set) -> np.ndarray:
    """Return ``root_rank``'s ``tensor`` on every rank (a new array)."""
    return _collectives.synchronize(_collectives.broadcast_async(tensor, root_rank, name, process_set))


@blocking
def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Returns ``output`` when ``splits`` is None, else ``(output, received_splits)``."""
    output, received = _collectives.synchronize(_collectives.alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


@blocking
def reducescatter(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0) -> np.ndarray:
    """Reduce ``tensor`` and return this rank's block of rows (rank r gets block r)."""
    return _collectives.synchronize(_collectives.reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                                                     postscale_factor))


@blocking
def grouped_reducescatter(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> List[np.ndarray]:
    return _collectives.synchronize(_collectives.grouped_reducescatter_async(tensors, name, op, process_set,
                                                                             prescale_factor, postscale_factor))


# -- objects --------------------------------------------------------------------------------------------------
def broadcast_object(obj, root_rank: int = 0, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` on every rank (any picklable value)."""
    return _broadcast_object(obj, root_rank, name, _set_id(process_set))


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return every rank's ``obj`` as a list in rank order."""
    return _allgather_object(obj, name, _set_id(process_set))
