"""The host side of ``horovod.jax``: collectives on numpy arrays, called with plain values or from jit callbacks.

Two callers share these functions: the pytree forms outside ``jax.jit`` (leaves viewed with ``np.asarray``, no
copy on the CPU) and the host callbacks that carry collectives inside ``jax.jit`` (:mod:`horovod.jax.jit_ops`,
where XLA hands the callback its operands).  Both run the collectives every binding shares
(:mod:`horovod.common.binding_ops`) through the numpy adapter, so JAX's bfloat16 (an ``ml_dtypes`` dtype) travels
as its bits like everywhere else.

Pytrees travel like the other bindings' gradients: consecutive small leaves of one dtype are packed into flat
buckets of up to ``HOROVOD_GRADIENT_BUCKET_BYTES`` (:func:`horovod.common.buckets.plan_buckets`), so a model of
many small layers costs a few requests per step instead of one per leaf.  Adasum never packs (its result depends
on how tensors are split).  Names are computed when the collective runs (inside a callback: when XLA calls it),
so unnamed operations are matched across ranks by the order in which they run.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from horovod.common import binding_ops
from horovod.common.adapter import ArrayAdapter
from horovod.common.basics import Adasum
from horovod.common.buckets import configured_cap, plan_buckets
from horovod.common.process_sets import ProcessSet, _set_id, group_op_names, op_name

NUMPY = ArrayAdapter()


def host_arrays(values: Sequence[Any]) -> List[np.ndarray]:
    """Callback operands (or concrete JAX arrays) as numpy arrays, without a copy where the memory allows."""
    return [np.asarray(v) for v in values]


# -- bucket packing --------------------------------------------------------------------------------------------
def pack(arrays: Sequence[np.ndarray], cap: int) -> Tuple[List[np.ndarray], Callable[[Sequence], List]]:
    """Concatenate the arrays of each planned bucket into one flat array.

    Returns:
        ``(packed, unpack)``: the arrays that travel (one per bucket, then the arrays in no bucket, in order) and
        a function mapping results of ``packed`` back to one array per input, with the input shapes.
    """
    buckets = plan_buckets([a.nbytes for a in arrays], [a.dtype for a in arrays], cap)
    if not buckets:
        return list(arrays), list
    in_bucket = {i for bucket in buckets for i in bucket}
    alone = [i for i in range(len(arrays)) if i not in in_bucket]
    packed = [np.concatenate([arrays[i].reshape(-1) for i in bucket]) for bucket in buckets]
    packed += [arrays[i] for i in alone]

    def unpack(results: Sequence[np.ndarray]) -> List[np.ndarray]:
        out: List[Any] = [None] * len(arrays)
        for bucket, flat in zip(buckets, results):
            offset = 0
            for i in bucket:
                n = arrays[i].size
                out[i] = flat[offset:offset + n].reshape(arrays[i].shape)
                offset += n
        for i, value in zip(alone, results[len(buckets):]):
            out[i] = value
        return out

    return packed, unpack


# -- pytree leaves ---------------------------------------------------------------------------------------------
def allreduce_leaves(arrays: Sequence[np.ndarray], op: int, prescale: float, postscale: float,
                     process_set: ProcessSet, name: Optional[str]) -> List[np.ndarray]:
    """Reduce every array (one atomic group, small ones packed in buckets); new arrays, in order."""
    if not arrays:
        return []
    packed, unpack = pack(arrays, 0 if op == Adasum else configured_cap())
    names, _ = group_op_names("allreduce_tree", name, len(packed), process_set)
    results = binding_ops.complete(binding_ops.allreduce(NUMPY, packed, names, op, prescale, postscale,
                                                         _set_id(process_set), inplace=False, grouped=True,
                                                         attended=True))
    return unpack(results)


def broadcast_leaves(arrays: Sequence[np.ndarray], root_rank: int, process_set: ProcessSet,
                     name: Optional[str]) -> List[np.ndarray]:
    """Every array of ``root_rank`` on every rank (small ones packed in buckets); new arrays, in order."""
    if not arrays:
        return []
    packed, unpack = pack(arrays, configured_cap())
    set_id = _set_id(process_set)
    base = op_name("broadcast_tree", name, process_set)   # one name per call: matched by issue order if unnamed
    pending = [binding_ops.broadcast(NUMPY, a, f"{base}.{i}", root_rank, set_id, inplace=False, attended=True)
               for i, a in enumerate(packed)]
    return unpack([binding_ops.complete(p) for p in pending])


# -- single collectives (the jit callbacks' bodies) --------------------------------------------------------------
def _names(kind: str, name, count: int, process_set, grouped: bool) -> list:
    """The engine names of one call: a member name per array when grouped, else the call's one name."""
    if grouped:
        return group_op_names(f"grouped_{kind}", name, count, process_set)[0]
    return [op_name(kind, name, process_set)]


def allreduce(arrays, op, prescale, postscale, process_set, name, grouped: bool):
    names = _names("allreduce", name, len(arrays), process_set, grouped)
    return binding_ops.complete(binding_ops.allreduce(NUMPY, arrays, names, op, prescale, postscale,
                                                      _set_id(process_set), inplace=False, grouped=grouped,
                                                      attended=True))


def allgather(arrays, process_set, name, grouped: bool):
    names = _names("allgather", name, len(arrays), process_set, grouped)
    return binding_ops.complete(binding_ops.allgather(NUMPY, arrays, names, _set_id(process_set), grouped,
                                                                            attended=True))


def reducescatter(arrays, op, prescale, postscale, process_set, name, grouped: bool):
    names = _names("reducescatter", name, len(arrays), process_set, grouped)
    return binding_ops.complete(binding_ops.reducescatter(NUMPY, arrays, names, op, prescale, postscale,
                                                          _set_id(process_set), grouped, attended=True))


def broadcast(array, root_rank, process_set, name):
    return binding_ops.complete(binding_ops.broadcast(NUMPY, array, op_name("broadcast", name, process_set),
                                                      root_rank, _set_id(process_set), inplace=False,
                                                      attended=True))


def alltoall(array, splits, process_set, name):
    return binding_ops.complete(binding_ops.alltoall(NUMPY, array, op_name("alltoall", name, process_set), splits,
                                                     _set_id(process_set), attended=True))
