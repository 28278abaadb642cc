"""Collectives on traced values: inside ``jax.jit`` they run as *ordered* host callbacks.

XLA cannot call the engine itself, so a collective on a traced value becomes
``jax.experimental.io_callback(host_fn, result_shape, *operands, ordered=True)``: when the compiled program
reaches it, XLA hands the operands to ``host_fn`` (:mod:`horovod.jax.host`), which runs the collective and returns
the result.  *Ordered* is what makes this safe: the callbacks of one program run in program order, exactly once
each, so every rank issues its collectives in the same order (``jax.pure_callback`` may reorder, repeat or drop a
call, which would deadlock the ranks).

What follows from it:

- result shapes are fixed when the function is traced: ``allreduce``, ``broadcast``, ``alltoall`` (equal splits)
  keep the input's shape; ``allgather`` assumes every rank has the same first dimension (``size * d0`` rows) and
  ``reducescatter`` gives this rank its block (``d0 // size`` rows, one more for the first ``d0 % size`` ranks).
  A rank whose real result differs fails with a ``ValueError`` naming both shapes.  The size and rank are those at
  trace time: after an elastic reset, jitted functions must be traced again (``horovod.jax.elastic.run`` clears
  JAX's compilation caches for that).
- ``alltoall`` with explicit ``splits`` has a data-dependent result shape and is refused under ``jit``.
- ``jax.vmap`` of an ordered callback is refused by JAX, so every collective has a ``custom_vmap`` rule (one
  callback for the whole batch, see :func:`_run`); ``jax.grad`` through ``allreduce`` works (its gradient is the
  same allreduce of the cotangent, a ``custom_vjp``), the other collectives are not differentiable.
- ``jax.checkpoint`` cannot rematerialise ordered effects: collectives stay outside checkpointed blocks.
- ``pmap`` runs the callback once per local device, i.e. one collective per device, not one per process: use one
  process (one ``horovodrun`` slot) per device instead.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback

from horovod.common import basics
from horovod.common.basics import Average, Sum
from horovod.common.process_sets import ProcessSet, _set_id
from horovod.engine.errors import InvalidArgumentError
from horovod.jax import host


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def set_size_and_rank(process_set: ProcessSet):
    """``(size, rank in the set)`` now, for result shapes fixed at trace time (raises for an unregistered set)."""
    set_id = _set_id(process_set)
    if set_id == 0:
        return basics.size(), basics.rank()
    if not process_set.included():
        raise ValueError(f"rank {basics.rank()} is not a member of {process_set}; only members may call its "
                         f"collectives.")
    return process_set.size(), process_set.rank()


def _checked(fn: Callable[[List], Any], specs: Sequence[jax.ShapeDtypeStruct], what: str, grouped: bool):
    """``fn`` on host arrays, its results checked against the shapes the traced program was built for."""
    def callback(*operands):
        out = fn(host.host_arrays(operands))
        results = list(out) if grouped else [out]
        for i, (result, spec) in enumerate(zip(results, specs)):
            if tuple(result.shape) != tuple(spec.shape):
                where = f" (tensor {i} of the group)" if grouped else ""
                raise ValueError(
                    f"horovod.jax.{what} inside jax.jit on rank {basics.rank()}: the result{where} has shape "
                    f"{tuple(result.shape)}, but the traced program was built for {tuple(spec.shape)} (result "
                    f"shapes are fixed at trace time: every rank must pass the same first dimension, and the job's "
                    f"size must not change). Call it outside jit for ragged inputs, or trace again after a reset.")
        return results if grouped else results[0]
    return callback


def _run(fn, spec_of: Callable[[Any], jax.ShapeDtypeStruct], operands: Sequence, what: str, grouped: bool,
         rows: bool = False):
    """One ordered host callback running ``fn`` on the operands; ``spec_of(operand)`` is its result's shape.

    Under ``jax.vmap`` the callback runs once on the stacked operands (a ``custom_vmap`` rule): for elementwise
    collectives (allreduce, broadcast) the stacked array is reduced as it is; for the ones that split or
    concatenate rows (``rows``: allgather, reducescatter, alltoall) the batch axis is moved behind the rows first
    and back after, so every example gets what it would get alone.
    """
    @custom_vmap
    def call(args):
        specs = [spec_of(a) for a in args]
        out = io_callback(_checked(fn, specs, what, grouped), list(specs) if grouped else specs[0], *args,
                          ordered=True)
        return tuple(out) if grouped else (out,)

    @call.def_vmap
    def batched(axis_size, in_batched, args):
        flags = tuple(in_batched[0])
        if rows:
            args = tuple(jnp.moveaxis(a, 0, 1) if b else a for a, b in zip(args, flags))
        out = call(args)
        if rows:
            out = tuple(jnp.moveaxis(o, 1, 0) if b else o for o, b in zip(out, flags))
        return out, flags

    out = call(tuple(operands))
    return list(out) if grouped else out[0]


def _same_shape(t) -> jax.ShapeDtypeStruct:
    return _spec(t.shape, t.dtype)


def _need_rows(tensors, what: str) -> None:
    for t in tensors:
        if t.ndim == 0:
            raise InvalidArgumentError(f"{what} needs a tensor with at least one dimension; got a scalar. "
                                       f"Reshape it to [1] first.")


# -- allreduce, differentiable ---------------------------------------------------------------------------------
def allreduce(tensors: Sequence, op: int, prescale: float, postscale: float, process_set: ProcessSet,
              name: Optional[str], grouped: bool):
    _set_id(process_set)
    return _allreduce_vjp(tuple(tensors), op, prescale, postscale, process_set, name, grouped)


def _allreduce_fwd_only(tensors, op, prescale, postscale, process_set, name, grouped):
    fn = functools.partial(host.allreduce, op=op, prescale=prescale, postscale=postscale, process_set=process_set,
                           name=name, grouped=grouped)
    return _run(lambda arrays: fn(arrays if grouped else arrays[0:1]), _same_shape, tensors, "allreduce", grouped)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _allreduce_vjp(tensors, op, prescale, postscale, process_set, name, grouped):
    return _allreduce_fwd_only(tensors, op, prescale, postscale, process_set, name, grouped)


def _allreduce_fwd(tensors, op, prescale, postscale, process_set, name, grouped):
    return _allreduce_fwd_only(tensors, op, prescale, postscale, process_set, name, grouped), None


def _allreduce_bwd(op, prescale, postscale, process_set, name, grouped, _res, cotangent):
    # y = post * reduce(pre * x): for Sum and Average the map is linear and symmetric across ranks, so the
    # cotangent of every rank's x is the same reduction of every rank's cotangent of y.
    if op not in (Sum, Average):
        raise TypeError(f"horovod.jax.allreduce is differentiable for Sum and Average only, got op={op} "
                        f"(Min, Max, Product and Adasum have no gradient here).")
    grads = tuple(cotangent) if grouped else (cotangent,)
    out = _allreduce_fwd_only(grads, op, prescale, postscale, process_set, None if name is None else f"{name}.grad",
                              grouped)
    return (tuple(out) if grouped else (out,),)


_allreduce_vjp.defvjp(_allreduce_fwd, _allreduce_bwd)


# -- the other collectives ---------------------------------------------------------------------------------------
def allgather(tensors: Sequence, process_set: ProcessSet, name: Optional[str], grouped: bool):
    _need_rows(tensors, "allgather")
    size, _ = set_size_and_rank(process_set)
    fn = functools.partial(host.allgather, process_set=process_set, name=name, grouped=grouped)
    return _run(lambda arrays: fn(arrays if grouped else arrays[0:1]),
                lambda t: _spec((size * t.shape[0],) + tuple(t.shape[1:]), t.dtype), tensors, "allgather", grouped,
                rows=True)


def reducescatter(tensors: Sequence, op: int, prescale: float, postscale: float, process_set: ProcessSet,
                  name: Optional[str], grouped: bool):
    _need_rows(tensors, "reducescatter")
    size, rank = set_size_and_rank(process_set)

    def block(t):   # rank r gets d0 // n rows, one more when r < d0 % n
        return _spec((t.shape[0] // size + (1 if rank < t.shape[0] % size else 0),) + tuple(t.shape[1:]), t.dtype)

    fn = functools.partial(host.reducescatter, op=op, prescale=prescale, postscale=postscale,
                           process_set=process_set, name=name, grouped=grouped)
    return _run(lambda arrays: fn(arrays if grouped else arrays[0:1]), block, tensors, "reducescatter", grouped,
                rows=True)


def broadcast(tensor, root_rank: int, process_set: ProcessSet, name: Optional[str]):
    _set_id(process_set)
    fn = functools.partial(host.broadcast, root_rank=root_rank, process_set=process_set, name=name)
    return _run(lambda arrays: fn(arrays[0]), _same_shape, [tensor], "broadcast", False)


def alltoall(tensor, splits, process_set: ProcessSet, name: Optional[str]):
    if splits is not None:
        raise TypeError("horovod.jax.alltoall with explicit splits has a result shape that depends on the other "
                        "ranks' splits, which jax.jit cannot express; inside jit only splits=None (an equal "
                        "split of the first dimension) works. Call it outside jit for uneven splits.")
    _need_rows([tensor], "alltoall")
    size, _ = set_size_and_rank(process_set)
    if tensor.shape[0] % size:
        raise InvalidArgumentError(f"alltoall without splits needs a first dimension divisible by the set size "
                                   f"{size}; got {tensor.shape[0]} rows. Pass splits (outside jit).")
    fn = functools.partial(host.alltoall, splits=None, process_set=process_set, name=name)
    return _run(lambda arrays: fn(arrays[0])[0], _same_shape, [tensor], "alltoall", False, rows=True)


# -- pytrees ---------------------------------------------------------------------------------------------------
def allreduce_leaves(leaves: Sequence, op: int, prescale: float, postscale: float, process_set: ProcessSet,
                     name: Optional[str]) -> List:
    """All leaves in one callback (packed into buckets on the host), differentiable like :func:`allreduce`."""
    _set_id(process_set)
    return list(_leaves_vjp(tuple(leaves), op, prescale, postscale, process_set, name))


def _leaves_fwd_only(leaves, op, prescale, postscale, process_set, name):
    fn = functools.partial(host.allreduce_leaves, op=op, prescale=prescale, postscale=postscale,
                           process_set=process_set, name=name)
    return tuple(_run(fn, _same_shape, leaves, "allreduce", True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _leaves_vjp(leaves, op, prescale, postscale, process_set, name):
    return _leaves_fwd_only(leaves, op, prescale, postscale, process_set, name)


def _leaves_fwd(leaves, op, prescale, postscale, process_set, name):
    return _leaves_fwd_only(leaves, op, prescale, postscale, process_set, name), None


def _leaves_bwd(op, prescale, postscale, process_set, name, _res, cotangents):
    if op not in (Sum, Average):
        raise TypeError(f"horovod.jax.allreduce is differentiable for Sum and Average only, got op={op}.")
    return (_leaves_fwd_only(tuple(cotangents), op, prescale, postscale, process_set,
                             None if name is None else f"{name}.grad"),)


_leaves_vjp.defvjp(_leaves_fwd, _leaves_bwd)


def broadcast_leaves(leaves: Sequence, root_rank: int, process_set: ProcessSet, name: Optional[str]) -> List:
    _set_id(process_set)
    fn = functools.partial(host.broadcast_leaves, root_rank=root_rank, process_set=process_set, name=name)
    return _run(fn, _same_shape, leaves, "broadcast", True)
