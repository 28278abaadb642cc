"""horovod.numpy: the collectives on numpy arrays, with the names and semantics of ``horovod.torch``.

Needs nothing but numpy.  ``*_async`` functions return an integer handle for :func:`poll` / :func:`synchronize`;
functions ending in ``_`` work in place.  All ranks of the process set must call each collective in the same
order.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from horovod.common.basics import (Adasum, Average, Max, Min, Product, Sum, ccl_built, cross_rank,  # noqa: F401
                                   cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
                                   is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                   mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size,
                                   start_timeline, stop_timeline)
from horovod.common.exceptions import HorovodInternalError  # noqa: F401
from horovod.common.objects import allgather_object as _allgather_object
from horovod.common.objects import broadcast_object as _broadcast_object
from horovod.common.process_sets import (ProcessSet, _set_id, add_process_set,  # noqa: F401
                                         group_op_names, op_name,
                                         global_process_set, remove_process_set)
from horovod.common.util import handle_average_backwards_compatibility
from horovod.engine import collectives, result_pool
from horovod.engine.handles import HandleTable
from horovod.engine.collectives import blocking

_handles = HandleTable()


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has completed."""
    return _handles.poll(handle)


def synchronize(handle: int):
    """Wait for ``handle`` and return its result (``HorovodInternalError`` if the collective failed)."""
    return _handles.synchronize(handle)



def _arr(x) -> np.ndarray:
    # np.ascontiguousarray would turn a 0-d value into shape (1,); scalars must stay scalars.
    a = np.asarray(x)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


# -- allreduce ------------------------------------------------------------------------------------------
def allreduce_async(tensor, average=None, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` across ranks; the result is a new array."""
    op = handle_average_backwards_compatibility(op, average)
    t = _arr(tensor)
    return _handles.add(collectives.allreduce_async(
        [t], [op_name("allreduce", name, process_set)], op=op, prescale=prescale_factor,
        postscale=postscale_factor, process_set=_set_id(process_set), outputs=[result_pool.empty_like(t)]))


@blocking
def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set) -> np.ndarray:
    """Reduce ``tensor`` across ranks (default: average) and return the result."""
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async_(tensor: np.ndarray, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """In-place :func:`allreduce_async`: ``tensor`` (C-contiguous) receives the result."""
    op = handle_average_backwards_compatibility(op, average)
    _require_inplace(tensor)
    return _handles.add(collectives.allreduce_async(
        [tensor], [op_name("allreduce", name, process_set)], op=op, prescale=prescale_factor,
        postscale=postscale_factor, process_set=_set_id(process_set), outputs=[tensor]))


@blocking
def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> np.ndarray:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _require_inplace(tensor) -> None:
    if not isinstance(tensor, np.ndarray) or not tensor.flags.c_contiguous or not tensor.flags.writeable:
        raise ValueError("in-place collectives need a writeable, C-contiguous numpy array")


def grouped_allreduce_async(tensors: Sequence, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """Reduce a list of arrays as one atomic group; the result is a list of new arrays."""
    op = handle_average_backwards_compatibility(op, average)
    arrays = [_arr(t) for t in tensors]
    names, _ = group_op_names("grouped_allreduce", name, len(arrays), process_set)
    return _handles.add(collectives.allreduce_async(
        arrays, names, op=op, prescale=prescale_factor, postscale=postscale_factor,
        process_set=_set_id(process_set), outputs=[result_pool.empty_like(a) for a in arrays], grouped=True))


@blocking
def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> List[np.ndarray]:
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                               process_set))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    op = handle_average_backwards_compatibility(op, average)
    for t in tensors:
        _require_inplace(t)
    names, _ = group_op_names("grouped_allreduce", name, len(tensors), process_set)
    return _handles.add(collectives.allreduce_async(
        list(tensors), names, op=op, prescale=prescale_factor, postscale=postscale_factor,
        process_set=_set_id(process_set), outputs=list(tensors), grouped=True))


@blocking
def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> List[np.ndarray]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# -- allgather ------------------------------------------------------------------------------------------
def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0."""
    return _handles.add(collectives.allgather_async([_arr(tensor)], [op_name("allgather", name, process_set)],
                                                    process_set=_set_id(process_set)))


@blocking
def allgather(tensor, name=None, process_set=global_process_set) -> np.ndarray:
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    arrays = [_arr(t) for t in tensors]
    names, _ = group_op_names("grouped_allgather", name, len(arrays), process_set)
    return _handles.add(collectives.allgather_async(arrays, names, process_set=_set_id(process_set), grouped=True))


@blocking
def grouped_allgather(tensors, name=None, process_set=global_process_set) -> List[np.ndarray]:
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# -- broadcast ------------------------------------------------------------------------------------------
def broadcast_async(tensor, root_rank: int, name=None, process_set=global_process_set) -> int:
    """Start copying ``root_rank``'s ``tensor`` to every rank (a new array is returned)."""
    t = _arr(tensor)
    return _handles.add(collectives.broadcast_async([t], [op_name("broadcast", name, process_set)], root_rank,
                                                    process_set=_set_id(process_set), outputs=[t.copy()]))


@blocking
def broadcast(tensor, root_rank: int, name=None, process_set=global_process_set) -> np.ndarray:
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank: int, name=None, process_set=global_process_set) -> int:
    _require_inplace(tensor)
    return _handles.add(collectives.broadcast_async([tensor], [op_name("broadcast", name, process_set)],
                                                    root_rank, process_set=_set_id(process_set), outputs=[tensor]))


@blocking
def broadcast_(tensor, root_rank: int, name=None, process_set=global_process_set) -> np.ndarray:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall / reducescatter ---------------------------------------------------------------------------
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start scattering rows of ``tensor`` to every rank (by ``splits``) and gathering theirs."""
    return _handles.add(collectives.alltoall_async(_arr(tensor), op_name("alltoall", name, process_set), splits,
                                                   process_set=_set_id(process_set)))


@blocking
def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Returns ``output`` when ``splits`` is None, else ``(output, received_splits)``."""
    output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    """Start reducing ``tensor`` and scattering row blocks (rank r gets block r)."""
    return _handles.add(collectives.reducescatter_async(
        [_arr(tensor)], [op_name("reducescatter", name, process_set)], op=op, prescale=prescale_factor,
        postscale=postscale_factor, process_set=_set_id(process_set)))


@blocking
def reducescatter(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0) -> np.ndarray:
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    arrays = [_arr(t) for t in tensors]
    names, _ = group_op_names("grouped_reducescatter", name, len(arrays), process_set)
    return _handles.add(collectives.reducescatter_async(
        arrays, names, op=op, prescale=prescale_factor, postscale=postscale_factor,
        process_set=_set_id(process_set), grouped=True))


@blocking
def grouped_reducescatter(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> List[np.ndarray]:
    return synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                   postscale_factor))


# -- synchronisation ------------------------------------------------------------------------------------
def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the process set reaches the barrier."""
    collectives.barrier(_set_id(process_set))


@blocking
def join(device: int = -1) -> int:
    """Declare that this rank has no more data; returns the rank that joined last.

    Until every rank joined, this rank contributes zeros to the allreduces the others still run.
    """
    return int(collectives.join_async().wait())


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` on every rank (any picklable value)."""
    return _broadcast_object(obj, root_rank, name, _set_id(process_set))


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return every rank's ``obj`` as a list in rank order."""
    return _allgather_object(obj, name, _set_id(process_set))
