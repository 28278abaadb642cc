"""The collectives of ``horovod.mxnet`` on MXNet NDArrays, and the basics every binding re-exports.

Each call copies its NDArrays to host numpy arrays (``asnumpy`` waits for MXNet's pending writes to them), runs
the collective every binding shares (:mod:`horovod.common.binding_ops`, through :class:`MxnetAdapter`), and hands
the result back as a new NDArray on the input's context, or writes it into the input (``tensor[:] = result``) for
the in-place ``*_`` variants.

The original's operations were asynchronous on MXNet's dependency engine; these return once the result is there,
so a result never needs ``wait_to_read`` and a failure raises at the call instead of at the next read.
``priority`` is accepted everywhere: a single call has nothing to reorder, and the optimizers issue a batch of
gradients in descending priority (ties in call order), which is the same on every rank.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

import mxnet as mx
import numpy as np

from horovod.common.basics import (Adasum, Average, Max, Min, Product, Sum, ccl_built, cross_rank,  # noqa: F401
                                   cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous,
                                   is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                   mpi_threads_supported, nccl_built, rank, rocm_built, size, start_timeline,
                                   stop_timeline)
from horovod.common.process_sets import (ProcessSet, _set_id, add_process_set,  # noqa: F401
                                         group_op_names, op_name,
                                         global_process_set, remove_process_set)
from horovod.common import binding_ops
from horovod.common.adapter import TensorAdapter, View
from horovod.common.binding_ops import init, shutdown  # noqa: F401  (every binding's init/shutdown)
from horovod.common.util import handle_average_backwards_compatibility

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from mxnet.ndarray import NDArray   # mxnet is untyped: Any to mypy, but usable in annotations
else:
    NDArray = mx.nd.NDArray


# -- NDArray <-> numpy ----------------------------------------------------------------------------------------

def _is_np_array(tensor) -> bool:
    """True for the NumPy-compatible ``mx.np.ndarray`` (a subclass of NDArray) rather than a classic NDArray."""
    np_array = getattr(getattr(mx, "np", None), "ndarray", None)
    return np_array is not None and isinstance(tensor, np_array)


def _check(tensor, what: str) -> None:
    if not isinstance(tensor, NDArray):
        raise TypeError(f"horovod.mxnet.{what} expects an mxnet NDArray, got {type(tensor).__name__}; "
                        f"convert it with mx.nd.array(...) first.")
    stype = getattr(tensor, "stype", "default")
    if stype != "default":
        raise ValueError(f"horovod.mxnet.{what} got a {stype} NDArray, but only dense ('default' storage) tensors "
                         f"are supported; convert it with tensor.tostype('default'), or create the layer with "
                         f"sparse_grad=False.")


def to_numpy(tensor: NDArray, what: str = "collective") -> np.ndarray:
    """A fresh, C-contiguous host copy of ``tensor`` (waits for MXNet's pending writes to it)."""
    _check(tensor, what)
    return np.ascontiguousarray(tensor.asnumpy())


def from_numpy(array: np.ndarray, like: NDArray) -> NDArray:
    """A new NDArray holding ``array`` on ``like``'s context, of the same kind (``mx.nd`` or ``mx.np``)."""
    out = mx.nd.array(array, ctx=like.context, dtype=array.dtype)
    return out.as_np_ndarray() if _is_np_array(like) else out


def write_back(tensor: NDArray, array: np.ndarray) -> NDArray:
    """Copy ``array`` into ``tensor`` (same shape) through MXNet's engine, so later reads are ordered after it."""
    if tensor.size:
        tensor[:] = array
    return tensor


class MxnetAdapter(TensorAdapter[np.ndarray]):
    """NDArrays cross as fresh host copies (``asnumpy`` orders the copy after MXNet's pending writes), so every
    view is staged: results are new NDArrays on the input's context, in-place results are written back."""

    def view(self, tensor: NDArray) -> View[np.ndarray]:
        return View(tensor, np.ascontiguousarray(tensor.asnumpy()), None, True)

    def result(self, array: np.ndarray, view: View[np.ndarray]) -> NDArray:
        return from_numpy(np.ascontiguousarray(array), view.tensor)

    def write_back(self, tensor: NDArray, array: np.ndarray) -> NDArray:
        return write_back(tensor, array)

    def splits(self, splits):
        values = splits.asnumpy() if isinstance(splits, NDArray) else splits
        dtype = getattr(values, "dtype", None)
        if dtype is not None and np.dtype(dtype).kind not in "iu":
            raise ValueError(f"alltoall splits must hold integers (int32), got dtype {np.dtype(dtype).name}; "
                             f"pass e.g. mx.nd.array(splits, dtype='int32').")
        return super().splits(values)

    def received_splits(self, received: np.ndarray) -> NDArray:
        return mx.nd.array(np.asarray(received, dtype=np.int32), ctx=mx.cpu(), dtype=np.int32)


_ADAPTER = MxnetAdapter()


def _priority(priority) -> int:
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise ValueError(f"priority must be an int (higher runs earlier), got {priority!r}.")
    return int(priority)


def _check_not_scalar(tensors: Sequence[NDArray], what: str) -> None:
    # Every rank checks its own input before any collective starts, so all ranks raise (not one result of one
    # row and one of none).
    if any(t.shape == () for t in tensors):
        raise ValueError(f"{what} does not support scalar inputs")


def _tensor_list(tensors, what: str) -> List[NDArray]:
    if isinstance(tensors, NDArray) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"horovod.mxnet.{what} expects a list or tuple of NDArrays, got {type(tensors).__name__}.")
    for t in tensors:
        _check(t, what)
    return list(tensors)


# -- allreduce -------------------------------------------------------------------------------------------------
def _allreduce(tensors, what: str, average, name, priority, prescale_factor, postscale_factor, process_set, op,
               inplace: bool, grouped: bool):
    """Validate, then run the shared allreduce (the host copies are private, so the engine reduces into them)."""
    op = handle_average_backwards_compatibility(op, average)
    _priority(priority)
    if grouped:
        tensors = _tensor_list(tensors, what)
        if not tensors:
            return []
        names, _ = group_op_names("grouped_allreduce", name, len(tensors), process_set)
    else:
        _check(tensors, what)
        tensors, names = [tensors], [op_name("allreduce", name, process_set)]
    return binding_ops.complete(binding_ops.allreduce(_ADAPTER, tensors, names, op, prescale_factor,
                                                      postscale_factor, _set_id(process_set), inplace, grouped,
                                                      attended=True))


def allreduce(tensor: NDArray, average: Optional[bool] = None, name: Optional[str] = None, priority: int = 0,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: Optional[int] = None) -> NDArray:
    """Reduce ``tensor`` over the ranks of ``process_set`` (default: average) and return a new NDArray.

    Args:
        tensor: the NDArray to reduce; not modified.
        average: deprecated; use ``op``.
        name: the name that matches this reduction across ranks (automatic names follow call order).
        priority: ordering hint (accepted for compatibility).
        prescale_factor: multiply every rank's input by this before reducing.
        postscale_factor: multiply the result by this.
        process_set: the ranks taking part.
        op: ``hvd.Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.

    Returns:
        A new NDArray of the same shape, dtype and context.
    """
    return _allreduce(tensor, "allreduce", average, name, priority, prescale_factor, postscale_factor,
                      process_set, op, inplace=False, grouped=False)


def allreduce_(tensor: NDArray, average: Optional[bool] = None, name: Optional[str] = None, priority: int = 0,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op: Optional[int] = None) -> NDArray:
    """In-place :func:`allreduce`: ``tensor`` receives the result and is returned."""
    return _allreduce(tensor, "allreduce_", average, name, priority, prescale_factor, postscale_factor,
                      process_set, op, inplace=True, grouped=False)


def grouped_allreduce(tensors: Sequence[NDArray], average: Optional[bool] = None, name: Optional[str] = None,
                      priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, op: Optional[int] = None) -> List[NDArray]:
    """Reduce a list of NDArrays as one atomic group; returns a list of new NDArrays."""
    return _allreduce(tensors, "grouped_allreduce", average, name, priority, prescale_factor, postscale_factor,
                      process_set, op, inplace=False, grouped=True)


def grouped_allreduce_(tensors: Sequence[NDArray], average: Optional[bool] = None, name: Optional[str] = None,
                       priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set, op: Optional[int] = None) -> List[NDArray]:
    """In-place :func:`grouped_allreduce`: every tensor receives its result; returns them."""
    return _allreduce(tensors, "grouped_allreduce_", average, name, priority, prescale_factor, postscale_factor,
                      process_set, op, inplace=True, grouped=True)


# -- allgather -------------------------------------------------------------------------------------------------
def allgather(tensor: NDArray, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> NDArray:
    """Concatenate every rank's ``tensor`` along dimension 0 (first dimensions may differ); a new NDArray."""
    _priority(priority)
    _check(tensor, "allgather")
    return binding_ops.complete(binding_ops.allgather(_ADAPTER, [tensor], [op_name("allgather", name, process_set)],
                                                      _set_id(process_set), grouped=False, attended=True))


def grouped_allgather(tensors: Sequence[NDArray], name: Optional[str] = None, priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> List[NDArray]:
    """:func:`allgather` of a list of NDArrays as one atomic group."""
    _priority(priority)
    tensors = _tensor_list(tensors, "grouped_allgather")
    if not tensors:
        return []
    names, _ = group_op_names("grouped_allgather", name, len(tensors), process_set)
    return binding_ops.complete(binding_ops.allgather(_ADAPTER, tensors, names, _set_id(process_set),
                                                      grouped=True, attended=True))


# -- broadcast -------------------------------------------------------------------------------------------------
def _broadcast(tensor: NDArray, root_rank: int, name: Optional[str], priority, process_set, what: str,
               inplace: bool) -> NDArray:
    _priority(priority)
    _check(tensor, what)
    return binding_ops.complete(binding_ops.broadcast(_ADAPTER, tensor, op_name("broadcast", name, process_set),
                                                      root_rank, _set_id(process_set), inplace, attended=True))


def broadcast(tensor: NDArray, root_rank: int, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> NDArray:
    """Return ``root_rank``'s ``tensor`` on every rank as a new NDArray (the input is not modified)."""
    return _broadcast(tensor, root_rank, name, priority, process_set, "broadcast", inplace=False)


def broadcast_(tensor: NDArray, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> NDArray:
    """In-place :func:`broadcast`: ``tensor`` receives the root's values and is returned."""
    return _broadcast(tensor, root_rank, name, priority, process_set, "broadcast_", inplace=True)


# -- alltoall --------------------------------------------------------------------------------------------------
def alltoall(tensor: NDArray, splits=None, name: Optional[str] = None, priority: int = 0,
             process_set: ProcessSet = global_process_set) -> Union[NDArray, Tuple[NDArray, NDArray]]:
    """Send rows ``splits[p]`` of ``tensor`` to member p of the set and gather what the others send here.

    Args:
        tensor: rows to scatter along dimension 0.
        splits: rows per destination (list, numpy array or NDArray of integers; a floating array raises
            ``ValueError``); ``None`` splits evenly.

    Returns:
        The gathered NDArray; with ``splits`` given, ``(output, received_splits)`` where ``received_splits`` is an
        int32 NDArray on the CPU with the number of rows received from each member.
    """
    _priority(priority)
    _check(tensor, "alltoall")
    out, received = binding_ops.complete(binding_ops.alltoall(_ADAPTER, tensor, op_name("alltoall", name, process_set),
                                                              splits, _set_id(process_set), attended=True))
    return out if splits is None else (out, received)


# -- reducescatter ---------------------------------------------------------------------------------------------
def reducescatter(tensor: NDArray, op: int = Average, name: Optional[str] = None, priority: int = 0,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> NDArray:
    """Reduce ``tensor`` over the set and return this rank's block of rows (lower ranks get the extra rows).

    Raises:
        ValueError: ``tensor`` is a scalar (shape ``()``), on every rank.
    """
    _priority(priority)
    _check(tensor, "reducescatter")
    _check_not_scalar([tensor], "reducescatter")
    return binding_ops.complete(binding_ops.reducescatter(
        _ADAPTER, [tensor], [op_name("reducescatter", name, process_set)], op, prescale_factor, postscale_factor,
        _set_id(process_set), grouped=False, attended=True))


def grouped_reducescatter(tensors: Sequence[NDArray], op: int = Average, name: Optional[str] = None,
                          priority: int = 0, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> List[NDArray]:
    """:func:`reducescatter` of a list of NDArrays as one atomic group."""
    _priority(priority)
    tensors = _tensor_list(tensors, "grouped_reducescatter")
    _check_not_scalar(tensors, "grouped_reducescatter")
    if not tensors:
        return []
    names, _ = group_op_names("grouped_reducescatter", name, len(tensors), process_set)
    return binding_ops.complete(binding_ops.reducescatter(_ADAPTER, tensors, names, op, prescale_factor,
                                                          postscale_factor, _set_id(process_set), grouped=True,
                                                          attended=True))
