"""The TensorFlow collectives: engine kernels run as TF ops (see :mod:`horovod.tensorflow.bridge`), with gradients.

Every op works eagerly and inside ``tf.function`` (and in TF1 graphs), and is differentiable with
``tf.GradientTape``:

=================  ===============================================================================
op                 gradient
=================  ===============================================================================
allreduce          allreduce of the gradient with the same op and scale factors (Sum, Average, Adasum);
                   Min/Max: the summed gradient flows to the ranks that hold the extremum;
                   Product: the summed gradient times ``result / input``
allgather          allreduce-average of the gradient, then this rank's rows
broadcast          allreduce-average of the gradient on the root, zeros elsewhere
alltoall           alltoall of the gradient back along the received splits
reducescatter      allgather of the gradient times the set size for Sum, times 1 for Average (and the scale
                   factors): :func:`horovod.common.framework_rules.reducescatter_grad_scale`
=================  ===============================================================================

All ranks of the process set must call each collective, in the same order.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from horovod.common import basics, binding_ops
from horovod.common.basics import Adasum, Average, Max, Min, Sum
from horovod.common import framework_rules
from horovod.common.process_sets import ProcessSet, _set_id as _raw_set_id, global_process_set, \
    registered_process_sets
from horovod.engine import collectives
from horovod.engine import ops as engine_ops
from horovod.tensorflow import bridge
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.queries import (join, local_rank_op, local_size_op, process_set_included_op,  # noqa: F401
                                        rank_op, size_op)


# -- process-set helpers ------------------------------------------------------------------------------------
def _set_id(process_set: ProcessSet) -> int:
    """The id of a registered process set.

    Raises:
        ValueError: when the op is built, in graphs too (the original's ``ValueError``): the set was never
            registered, or its id is not one this rank knows.
    """
    set_id = _raw_set_id(process_set)
    if set_id != 0 and set_id not in registered_process_sets():
        raise ValueError(f"Process set id {set_id} is not registered on this rank "
                         f"(registered: {sorted(registered_process_sets())}); pass the ProcessSet that "
                         f"hvd.init(process_sets=...) or hvd.add_process_set() returned.")
    return set_id


def _set_size(process_set: ProcessSet) -> int:
    return basics.size() if _set_id(process_set) == 0 else len(process_set.ranks)


def _set_rank(process_set: ProcessSet) -> int:
    if _set_id(process_set) == 0:
        return basics.rank()
    me = basics.rank()
    if me not in process_set.ranks:
        raise ValueError(f"Rank {me} is not a member of the provided process set {process_set.ranks}.")
    return process_set.ranks.index(me)


def _check_op(op: int) -> None:
    if op not in engine_ops.OP_NAMES:
        raise ValueError(f"Unknown reduction op {op!r}; use hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product "
                         f"or hvd.Adasum.")


def _check_not_scalar(tensor: tf.Tensor, what: str) -> None:
    if tensor.shape.rank == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension; got a scalar. Reshape it to [1] "
                         f"first.")


def _is_differentiable(dtype: tf.DType) -> bool:
    return dtype.is_floating or dtype.is_complex


def scale(tensor: tf.Tensor, factor: float) -> tf.Tensor:
    """``tensor * factor`` in the framework (half precision multiplied in float32, see
    :func:`horovod.common.framework_rules.scaling_dtype`)."""
    if factor == 1.0:
        return tensor
    wide = tf.as_dtype(framework_rules.scaling_dtype(tensor.dtype.name))
    if wide == tensor.dtype:
        return tensor * tf.cast(factor, tensor.dtype)
    return tf.cast(tf.cast(tensor, wide) * tf.cast(factor, wide), tensor.dtype)


# -- kernels (run when the op executes) ---------------------------------------------------------------------
def _names(prefix: str, base: Optional[str], count: int, grouped: bool, set_id: int = 0) -> List[str]:
    if grouped:
        return collectives.group_names(f"grouped_{prefix}", base, count, set_id)[0]
    return [collectives.tensor_name(prefix, base, set_id)]


def _allreduce_kernel(base, op, prescale, postscale, set_id, count, grouped):
    def kernel(*arrays):
        names = _names("allreduce", base, count, grouped, set_id)
        return _results(binding_ops.allreduce(bridge.ARRAYS, arrays, names, op, prescale, postscale, set_id,
                                              inplace=False, grouped=grouped, attended=True), grouped)

    return kernel


def _allgather_kernel(base, set_id, count, grouped):
    def kernel(*arrays):
        for a in arrays:
            if a.ndim == 0:
                raise ValueError("allgather needs a tensor with at least one dimension; got a scalar.")
        names = _names("allgather", base, count, grouped, set_id)
        return _results(binding_ops.allgather(bridge.MOVABLE, arrays, names, set_id, grouped, attended=True),
                        grouped)

    return kernel


def _broadcast_kernel(base, root_rank, set_id, count, grouped):
    def kernel(*arrays):
        names = _names("broadcast", base, count, grouped, set_id)
        if grouped:
            return binding_ops.complete(binding_ops.grouped_broadcast(bridge.MOVABLE, arrays, names, root_rank,
                                                                      set_id, attended=True))
        return [binding_ops.complete(binding_ops.broadcast(bridge.MOVABLE, arrays[0], names[0], root_rank, set_id,
                                                           inplace=False, attended=True))]

    return kernel


def _reducescatter_kernel(base, op, prescale, postscale, set_id, count, grouped):
    def kernel(*arrays):
        names = _names("reducescatter", base, count, grouped, set_id)
        return _results(binding_ops.reducescatter(bridge.ARRAYS, arrays, names, op, prescale, postscale, set_id,
                                                  grouped, attended=True), grouped)

    return kernel


def _alltoall_kernel(base, set_id, with_splits):
    def kernel(array, splits):
        output, received = binding_ops.complete(binding_ops.alltoall(
            bridge.MOVABLE, array, collectives.tensor_name("alltoall", base, set_id),
            splits if with_splits else None, set_id, attended=True))
        return [output, np.asarray(received, dtype=np.int32)]

    return kernel


def _results(pending: binding_ops.Pending, grouped: bool) -> List[np.ndarray]:
    """A kernel's outputs: the collective's results, one per input."""
    results = binding_ops.complete(pending)
    return list(results) if grouped else [results]


# -- allreduce ----------------------------------------------------------------------------------------------
def _scaled_extremum_mask(x, y, prescale, postscale):
    scaled = x if prescale == postscale == 1.0 else x * tf.cast(prescale * postscale, x.dtype)
    return tf.cast(tf.equal(scaled, y), x.dtype)


def _run_differentiable(kernel, op_type: str, tensors: List[tf.Tensor], out_shape, grads_of) -> List[tf.Tensor]:
    """Run a (grouped) kernel as one differentiable op.

    ``out_shape(x)`` is the static shape of the output for input ``x``; ``grads_of(xs, ys, dys)`` gives the
    inputs' gradients from the outputs' upstream gradients.
    """
    @tf.custom_gradient
    def forward(*xs):
        ys = bridge.run(kernel, xs, [x.dtype for x in xs], op_type, [out_shape(x) for x in xs])

        def grad(*dys):
            return grads_of(xs, ys, dys)

        return ys, grad

    return list(forward(*tensors))


def _live_grads(xs, ys, dys, grads_of_live) -> List[Optional[tf.Tensor]]:
    """Gradients where non-differentiable inputs get ``None``.

    ``grads_of_live(live, upstream)`` returns the gradients of the inputs at indices ``live`` from their upstream
    gradients (zeros where none arrived).
    """
    live = [i for i, x in enumerate(xs) if _is_differentiable(x.dtype)]
    grads: List[Optional[tf.Tensor]] = [None] * len(xs)
    if live:
        upstream = [dys[i] if dys[i] is not None else tf.zeros_like(ys[i]) for i in live]
        for i, g in zip(live, grads_of_live(live, upstream)):
            grads[i] = g
    return grads


def _reduction_grads(xs, ys, dys, op, prescale, postscale, process_set, ignore_name_scope):
    """Gradients of a (grouped) allreduce; non-differentiable inputs get ``None``."""
    def grads_of_live(live, upstream):
        if op in (Sum, Average, Adasum):
            return _grouped_allreduce(upstream, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                      process_set=process_set, ignore_name_scope=ignore_name_scope)
        summed = _grouped_allreduce(upstream, op=Sum, process_set=process_set, ignore_name_scope=ignore_name_scope)
        if op in (Min, Max):
            return [g * _scaled_extremum_mask(xs[i], ys[i], prescale, postscale) for i, g in zip(live, summed)]
        # Product: d(prod)/dx_i = prod / x_i
        return [g * tf.math.divide_no_nan(ys[i], xs[i]) for i, g in zip(live, summed)]

    return _live_grads(xs, ys, dys, grads_of_live)


@not_converted
def _allreduce(tensor, name: Optional[str] = None, op: int = Sum, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
               ignore_name_scope: bool = False) -> tf.Tensor:
    """Allreduce one dense tensor (no compression, no IndexedSlices); see :func:`horovod.tensorflow.allreduce`."""
    return _grouped_allreduce([tensor], name, op, prescale_factor, postscale_factor, process_set,
                              ignore_name_scope, _single=True)[0]


@not_converted
def _grouped_allreduce(tensors: Sequence, name: Optional[str] = None, op: int = Sum, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                       ignore_name_scope: bool = False, _single: bool = False) -> List[tf.Tensor]:
    """Allreduce a list of dense tensors as one atomic group (one op, fused by the engine)."""
    _check_op(op)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    set_id = _set_id(process_set)
    op_type = "HorovodAllreduce" if _single else "HorovodGroupedAllreduce"
    base = bridge.base_name(op_type, name, ignore_name_scope)
    kernel = _allreduce_kernel(base, op, prescale_factor, postscale_factor, set_id, len(tensors),
                               grouped=not _single)
    return _run_differentiable(kernel, op_type, tensors, lambda x: x.shape,
                               lambda xs, ys, dys: _reduction_grads(xs, ys, dys, op, prescale_factor,
                                                                    postscale_factor, process_set, ignore_name_scope))


# -- allgather ----------------------------------------------------------------------------------------------
def _allgather_grads(xs, dys, process_set, ignore_name_scope) -> List[Optional[tf.Tensor]]:
    live = [i for i, x in enumerate(xs) if _is_differentiable(x.dtype)]
    grads: List[Optional[tf.Tensor]] = [None] * len(xs)
    if not live:
        return grads
    reduced = _grouped_allreduce([dys[i] for i in live], op=Average, process_set=process_set,
                                 ignore_name_scope=ignore_name_scope)
    # One allgather tells every rank the first dimension each rank contributed, for all tensors at once.
    mine = tf.stack([tf.shape(xs[i], out_type=tf.int64)[0] for i in live])
    dims = allgather(tf.reshape(mine, [1, len(live)]), process_set=process_set,
                     ignore_name_scope=ignore_name_scope)
    # Computed from every row of dims (an exclusive prefix sum), so no rank's graph can fold the collective away.
    offsets = tf.cumsum(dims, axis=0, exclusive=True)[_set_rank(process_set)]
    for k, (i, g) in enumerate(zip(live, reduced)):
        grads[i] = g[offsets[k]:offsets[k] + mine[k]]
    return grads


@not_converted
def allgather(tensor, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate ``tensor`` from every rank of the process set along dimension 0.

    The first dimension may differ between ranks; the others must match.  All ranks of the process set must
    call it, in the same order.

    Returns:
        A tensor with the sum of all ranks' first dimensions.
    """
    return _grouped_allgather([tensor], name, ignore_name_scope, process_set, _single=True)[0]


@not_converted
def grouped_allgather(tensors: Sequence, name: Optional[str] = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """:func:`allgather` of a list of tensors as one atomic group."""
    return _grouped_allgather(tensors, name, ignore_name_scope, process_set)


@not_converted
def _grouped_allgather(tensors, name, ignore_name_scope, process_set, _single=False):
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    for t in tensors:
        _check_not_scalar(t, "allgather")
    set_id = _set_id(process_set)
    op_type = "HorovodAllgather" if _single else "HorovodGroupedAllgather"
    base = bridge.base_name(op_type, name, ignore_name_scope)
    kernel = _allgather_kernel(base, set_id, len(tensors), grouped=not _single)

    def out_shape(x):
        return tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank is not None else None

    return _run_differentiable(kernel, op_type, tensors, out_shape,
                               lambda xs, ys, dys: _allgather_grads(xs, dys, process_set, ignore_name_scope))


# -- broadcast ----------------------------------------------------------------------------------------------
def _check_root(root_rank) -> int:
    if isinstance(root_rank, (tf.Tensor, tf.Variable)):
        raise ValueError("broadcast root_rank must be a Python int (a global rank), not a tensor.")
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise ValueError(f"broadcast root_rank must be an int, got {root_rank!r}.")
    return int(root_rank)


@not_converted
def broadcast(tensor, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank of the process set (``root_rank`` is a global rank).

    All ranks of the process set must call it, in the same order.
    """
    return _grouped_broadcast([tensor], root_rank, name, ignore_name_scope, process_set, _single=True)[0]


@not_converted
def _grouped_broadcast(tensors, root_rank, name=None, ignore_name_scope=False,
                       process_set: ProcessSet = global_process_set, _single=False) -> List[tf.Tensor]:
    root_rank = _check_root(root_rank)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    set_id = _set_id(process_set)
    op_type = "HorovodBroadcast" if _single else "HorovodGroupedBroadcast"
    base = bridge.base_name(op_type, name, ignore_name_scope)
    kernel = _broadcast_kernel(base, root_rank, set_id, len(tensors), grouped=not _single)

    def grads_of_live(live, upstream):
        reduced = _grouped_allreduce(upstream, op=Average, process_set=process_set,
                                     ignore_name_scope=ignore_name_scope)
        if basics.rank() == root_rank:
            return reduced
        # Non-roots get zeros, yet must still run the allreduce the root waits for: a bare zeros_like of a
        # tensor with a static shape does not depend on it, and a graph would prune the collective away.
        with tf.control_dependencies(reduced):
            return [tf.zeros_like(g) for g in reduced]

    return _run_differentiable(kernel, op_type, tensors, lambda x: x.shape,
                               lambda xs, ys, dys: _live_grads(xs, ys, dys, grads_of_live))


def _op_of(value):
    if isinstance(value, tf.Operation):
        return value
    return getattr(value, "op", None)


@not_converted
def broadcast_(variables, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set):
    """Broadcast variables from ``root_rank`` in place (the variables are assigned the root's values).

    Args:
        variables: a variable or a list of variables.

    Returns:
        The updated values (a tensor, or a list of tensors for a list).
    """
    single = not isinstance(variables, (list, tuple))
    var_list = [variables] if single else list(variables)
    values = _grouped_broadcast([tf.convert_to_tensor(v) for v in var_list], root_rank, name,
                                process_set=process_set)
    assigns = [v.assign(b) for v, b in zip(var_list, values)]
    if bridge.executing_eagerly():
        out = [tf.convert_to_tensor(v) for v in var_list]
    else:
        deps = [o for o in (_op_of(a) for a in assigns) if o is not None]
        with tf.control_dependencies(deps):
            out = [tf.identity(b) for b in values]
    return out[0] if single else out


# -- alltoall -----------------------------------------------------------------------------------------------
@not_converted
def alltoall(tensor, splits=None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set):
    """Send rows ``splits[p]`` of ``tensor`` to member p of the process set and receive theirs.

    Without ``splits`` the first dimension is split evenly.  All ranks of the process set must call it, in
    the same order.

    Returns:
        The received rows concatenated in rank order; with ``splits`` given, ``(output, received_splits)`` where
        ``received_splits`` (int32) says how many rows came from each member.
    """
    tensor = tf.convert_to_tensor(tensor)
    _check_not_scalar(tensor, "alltoall")
    set_id = _set_id(process_set)
    set_size = _set_size(process_set)
    with_splits = splits is not None
    splits_t = tf.reshape(tf.cast(splits, tf.int32), [-1]) if with_splits else tf.zeros([0], tf.int32)
    base = bridge.base_name("HorovodAlltoall", name, ignore_name_scope)
    kernel = _alltoall_kernel(base, set_id, with_splits)

    @tf.custom_gradient
    def forward(x, s):
        shape = tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank is not None else None
        y, received = bridge.run(kernel, [x, s], [x.dtype, tf.int32], "HorovodAlltoall",
                                 [shape, tf.TensorShape([set_size])])

        def grad(dy, _unused):
            if not _is_differentiable(x.dtype):
                return None, None
            if dy is None:
                dy = tf.zeros_like(y)
            dx, _ = alltoall(dy, splits=received, process_set=process_set, ignore_name_scope=ignore_name_scope)
            return dx, None

        return (y, received), grad

    output, received = forward(tensor, splits_t)
    return (output, received) if with_splits else output


# -- reducescatter ------------------------------------------------------------------------------------------
def _scatter_rows(rows: int, size: int, rank: int) -> int:
    return rows // size + (1 if rank < rows % size else 0)


@not_converted
def _reducescatter(tensor, name: Optional[str] = None, op: int = Average,
                   process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce one dense tensor and keep this rank's block of rows (no compression)."""
    return _grouped_reducescatter([tensor], name, op, process_set, ignore_name_scope, prescale_factor,
                                  postscale_factor, _single=True)[0]


@not_converted
def _grouped_reducescatter(tensors, name=None, op: int = Average, process_set: ProcessSet = global_process_set,
                           ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0, _single: bool = False) -> List[tf.Tensor]:
    if op not in (Sum, Average):
        raise ValueError(f"reducescatter supports only hvd.Sum and hvd.Average, got "
                         f"{engine_ops.OP_NAMES.get(op, op)}.")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    for t in tensors:
        _check_not_scalar(t, "reducescatter")
    set_id = _set_id(process_set)
    set_size = _set_size(process_set)
    # A rank outside the set gets the engine's error when the op runs (InvalidArgumentError, as the original).
    set_rank = _set_rank(process_set) if set_id == 0 or basics.rank() in process_set.ranks else None
    op_type = "HorovodReducescatter" if _single else "HorovodGroupedReducescatter"
    base = bridge.base_name(op_type, name, ignore_name_scope)
    kernel = _reducescatter_kernel(base, op, prescale_factor, postscale_factor, set_id, len(tensors),
                                   grouped=not _single)

    def out_shape(x):
        if x.shape.rank is None:
            return None
        rows = x.shape[0]
        first = None if rows is None or set_rank is None else _scatter_rows(rows, set_size, set_rank)
        return tf.TensorShape([first]).concatenate(x.shape[1:])

    def grads_of_live(live, upstream):
        gathered = _grouped_allgather(upstream, None, ignore_name_scope, process_set)
        factor = framework_rules.reducescatter_grad_scale(op, prescale_factor, postscale_factor, set_size)
        return [scale(g, factor) for g in gathered]

    return _run_differentiable(kernel, op_type, tensors, out_shape,
                               lambda xs, ys, dys: _live_grads(xs, ys, dys, grads_of_live))
