"""The collectives of ``horovod.jax``: the names, semantics and argument order of ``horovod.torch``, on ``jax.Array``.

Concrete arrays go through the collectives every binding shares (:mod:`horovod.common.binding_ops`, with
:class:`~horovod.jax.adapter.JaxAdapter`); traced values (inside ``jax.jit``) go through ordered host callbacks
(:mod:`horovod.jax.jit_ops`).  The blocking forms pick the path by their input, so one training step works eagerly
and jitted.  ``*_async`` forms return integer handles for :func:`poll` / :func:`synchronize` and take concrete
arrays only (a handle cannot cross a compiled program).

JAX arrays are immutable: there are no in-place forms (``allreduce_``, ``broadcast_`` ...); the results are new
arrays.  ``allreduce`` and ``broadcast`` also take a pytree (a dict of parameters or gradients): its leaves travel
together, small ones packed into buckets (``HOROVOD_GRADIENT_BUCKET_BYTES``), and the result has the same structure.
"""
from __future__ import annotations

import numbers
from typing import Any, List, Optional

import jax
import numpy as np

from horovod.common.basics import Average
from horovod.common.binding_ops import HandleCollectives
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.util import handle_average_backwards_compatibility
from horovod.jax import jit_ops
from horovod.jax.adapter import JaxAdapter, after_jitted_collectives, as_jax, is_traced
from horovod.jax.compression import Compression

_collectives = HandleCollectives(JaxAdapter(), __name__)
# Its public functions are the shared object's bound methods, less the in-place forms (JAX arrays are immutable;
# shutdown, join and barrier are defined below), spelled out so that IDEs, mypy and readers see them.
init = _collectives.init
poll = _collectives.poll
synchronize = _collectives.synchronize
allreduce_async = _collectives.allreduce_async
grouped_allreduce_async = _collectives.grouped_allreduce_async
allgather_async = _collectives.allgather_async
grouped_allgather_async = _collectives.grouped_allgather_async
broadcast_async = _collectives.broadcast_async
alltoall_async = _collectives.alltoall_async
reducescatter_async = _collectives.reducescatter_async
grouped_reducescatter_async = _collectives.grouped_reducescatter_async

#: In-place forms of the other bindings: JAX arrays cannot be written into (``horovod.jax.__getattr__`` says so).
INPLACE = ("allreduce_async_", "allreduce_", "grouped_allreduce_async_", "grouped_allreduce_", "broadcast_async_",
           "broadcast_")


def _is_tensor(value: Any) -> bool:
    """One array (or number), as opposed to a pytree of them."""
    return is_traced(value) or isinstance(value, (jax.Array, np.ndarray, np.generic, numbers.Number))


def _any_traced(values) -> bool:
    return any(is_traced(v) for v in values)


def _tensors(values, what: str) -> list:
    """The members of a grouped call: a list (or tuple) of arrays."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"horovod.jax.{what} expects a list of arrays, got {type(values).__name__}")
    return [v if is_traced(v) else as_jax(v, what) for v in values]


# -- allreduce -------------------------------------------------------------------------------------------------
def allreduce(tensor, average=None, name: Optional[str] = None, compression=Compression.none, op=None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set):
    """Reduce ``tensor`` across the process set (default: average) and return the result.

    Args:
        tensor: a ``jax.Array`` (concrete or traced inside ``jax.jit``), or a pytree of them (reduced as one
            group, small leaves packed into buckets; the result has the same structure).
        average: deprecated; use ``op``.
        name: the operation's name (must match across ranks); unnamed ops are matched by the order they run in.
        compression: how floating-point values travel (``Compression.fp16`` / ``bf16`` halve the bytes).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor: multiply the input by this before reducing.
        postscale_factor: multiply the result by this after reducing.
        process_set: the ranks taking part (all of them must call this).
    """
    op = handle_average_backwards_compatibility(op, average)
    if not _is_tensor(tensor):
        from horovod.jax.tree import allreduce_tree

        return allreduce_tree(tensor, op=op, name=name, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, process_set=process_set, compression=compression)
    tensor = tensor if is_traced(tensor) else as_jax(tensor, "allreduce")
    compressed, ctx = compression.compress(tensor)
    if is_traced(compressed):
        out = jit_ops.allreduce([compressed], op, prescale_factor, postscale_factor, process_set, name, False)
    else:
        out = _collectives.allreduce(compressed, None, name, op, prescale_factor,
                                                                    postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, name: Optional[str] = None, compression=Compression.none, op=None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[jax.Array]:
    """Reduce a list of arrays as one atomic group (negotiated and fused together); returns a list of new arrays."""
    op = handle_average_backwards_compatibility(op, average)
    tensors = _tensors(tensors, "grouped_allreduce")
    compressed = [compression.compress(t) for t in tensors]
    values = [c for c, _ in compressed]
    if not values:
        return []
    if _any_traced(values):
        out = jit_ops.allreduce(values, op, prescale_factor, postscale_factor, process_set, name, True)
    else:
        out = _collectives.grouped_allreduce(values, None, name, op, prescale_factor,
                                                                            postscale_factor, process_set)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, compressed)]


# -- allgather -------------------------------------------------------------------------------------------------
def allgather(tensor, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> jax.Array:
    """Concatenate every rank's ``tensor`` along dimension 0 (outside jit the first dimensions may differ)."""
    if is_traced(tensor):
        return jit_ops.allgather([tensor], process_set, name, False)
    return _collectives.allgather(tensor, name, process_set)


def grouped_allgather(tensors, name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[jax.Array]:
    """Allgather a list of arrays as one group."""
    tensors = _tensors(tensors, "grouped_allgather")
    if _any_traced(tensors):
        return jit_ops.allgather(tensors, process_set, name, True)
    return _collectives.grouped_allgather(tensors, name, process_set)


# -- broadcast -------------------------------------------------------------------------------------------------
def broadcast(tensor, root_rank: int, name: Optional[str] = None, process_set: ProcessSet = global_process_set):
    """Return ``root_rank``'s ``tensor`` (or pytree of arrays) on every rank, as new arrays.

    ``root_rank`` is a global rank, also when a process set is given.
    """
    if not _is_tensor(tensor):
        from horovod.jax.tree import broadcast_tree

        return broadcast_tree(tensor, root_rank, name=name, process_set=process_set)
    if is_traced(tensor):
        return jit_ops.broadcast(tensor, root_rank, process_set, name)
    return _collectives.broadcast(tensor, root_rank, name, process_set)


# -- alltoall / reducescatter ----------------------------------------------------------------------------------
def alltoall(tensor, splits=None, name: Optional[str] = None, process_set: ProcessSet = global_process_set):
    """Send ``splits[i]`` rows to rank ``i`` of the set and receive theirs.

    Returns ``output`` when ``splits`` is None, else ``(output, received_splits)``.  Inside ``jax.jit`` only
    ``splits=None`` works (the result shape must be known when tracing).
    """
    if is_traced(tensor):
        return jit_ops.alltoall(tensor, splits, process_set, name)
    output, received = _collectives.run(_collectives.start_alltoall(tensor, splits, name, process_set,
                                                                             attended=True))
    return output if splits is None else (output, received)


def reducescatter(tensor, name: Optional[str] = None, op=Average, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> jax.Array:
    """Reduce ``tensor`` (Sum or Average) and return this rank's block of rows (rank r gets block r)."""
    op = Average if op is None else op
    if is_traced(tensor):
        return jit_ops.reducescatter([tensor], op, prescale_factor, postscale_factor, process_set, name, False)
    return _collectives.reducescatter(tensor, name, op, process_set, prescale_factor,
                                                                     postscale_factor)


def grouped_reducescatter(tensors, name: Optional[str] = None, op=Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[jax.Array]:
    """Reduce-scatter a list of arrays as one group."""
    op = Average if op is None else op
    tensors = _tensors(tensors, "grouped_reducescatter")
    if _any_traced(tensors):
        return jit_ops.reducescatter(tensors, op, prescale_factor, postscale_factor, process_set, name, True)
    return _collectives.grouped_reducescatter(tensors, name, op, process_set,
                                                                             prescale_factor, postscale_factor)


# -- synchronisation: after the collectives of already dispatched jitted programs -------------------------------
def shutdown() -> None:
    """Stop Horovod once the collectives of already dispatched jitted programs have run; ``init()`` may follow."""
    after_jitted_collectives()
    _collectives.shutdown()


def join(device: int = -1) -> int:
    """Declare that this rank has no more data and wait until every rank has joined; returns the last to join.

    Until then this rank contributes zeros to the allreduces the other ranks still run.  Outside ``jax.jit`` only.
    """
    after_jitted_collectives()
    return _collectives.join(device)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the process set has reached the barrier (outside ``jax.jit`` only)."""
    after_jitted_collectives()
    _collectives.barrier(process_set)
