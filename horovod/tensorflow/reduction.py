"""The public reducing collectives of ``horovod.tensorflow``: compression, IndexedSlices and the ``average=`` shim
on top of the raw ops in :mod:`horovod.tensorflow.mpi_ops`."""
from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

from horovod.common import framework_rules
from horovod.common.basics import Average
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.util import handle_average_backwards_compatibility
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.mpi_ops import (_grouped_allgather, _grouped_allreduce, _grouped_reducescatter, _set_size)


def _sparse_allreduce(slices: tf.IndexedSlices, name, op, prescale_factor, postscale_factor, process_set,
                      ignore_name_scope) -> tf.IndexedSlices:
    """IndexedSlices travel as two allgathers (values and indices, one group); duplicates sum when densified.

    Average divides the gathered values by the set size with TF's true division (integer values become floating
    point); pre/postscale factors and ops other than Sum/Average raise ``NotImplementedError``, before any
    collective starts (:mod:`horovod.common.framework_rules`).
    """
    framework_rules.check_sparse_allreduce(op, prescale_factor, postscale_factor)
    divisor = framework_rules.sparse_average_divisor(op, _set_size(process_set))
    values, indices = _grouped_allgather([slices.values, slices.indices], name, ignore_name_scope, process_set)
    if divisor is not None:
        values = values / tf.cast(divisor, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@not_converted
def allreduce(tensor, average=None, device_dense: str = "", device_sparse: str = "",
              compression=Compression.none, op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False):
    """Reduce ``tensor`` across the ranks of the process set (default: average).

    ``tensor`` may be a ``tf.Tensor``, a ``tf.Variable`` (its value is reduced) or ``tf.IndexedSlices`` (values
    and indices are allgathered; only Sum and Average, no scale factors; Average divides integer values into
    floating point ones, as ``values / size`` does).  Differentiable.  ``device_*`` are accepted for
    compatibility (everything runs on the host).  All ranks of the process set must call it, in the same order.

    Args:
        average: deprecated; use ``op``.
        compression: e.g. ``hvd.Compression.fp16`` to send floating tensors as float16.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max``, ``hvd.Product``, ``hvd.Adasum``.
        prescale_factor / postscale_factor: multiply before / after the reduction.
        name: the name every rank uses for this tensor (optional).

    Returns:
        A tensor of the same shape and dtype (``IndexedSlices`` for ``IndexedSlices``).

    Raises:
        tf.errors.FailedPreconditionError (eager, also ``hvd.HorovodInternalError``; in graphs when the op
            runs): ranks disagreed or a peer failed.
        NotImplementedError: ``IndexedSlices`` with an op other than Sum/Average or with a scale factor.
    """
    op = handle_average_backwards_compatibility(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set,
                                 ignore_name_scope)
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = _grouped_allreduce([compressed], name, op, prescale_factor, postscale_factor, process_set,
                                 ignore_name_scope, _single=True)[0]
    return compression.decompress(reduced, ctx)


@not_converted
def grouped_allreduce(tensors: Sequence, average=None, device_dense: str = "", device_sparse: str = "",
                      compression=Compression.none, op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: Optional[str] = None) -> List:
    """:func:`allreduce` of a list of tensors as one atomic group (negotiated and fused together).

    ``IndexedSlices`` members are reduced by allgather, outside the group.
    """
    op = handle_average_backwards_compatibility(op, average)
    tensors = list(tensors)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        # Refuse before the dense group starts, so every rank stops at the same point.
        framework_rules.check_sparse_allreduce(op, prescale_factor, postscale_factor)
    out: List = [None] * len(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    compressed, ctxs = [], []
    for i in dense:
        c, ctx = compression.compress(tf.convert_to_tensor(tensors[i]))
        compressed.append(c)
        ctxs.append(ctx)
    reduced = _grouped_allreduce(compressed, name, op, prescale_factor, postscale_factor, process_set,
                                 ignore_name_scope)
    for i, r, ctx in zip(dense, reduced, ctxs):
        out[i] = compression.decompress(r, ctx)
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _sparse_allreduce(t, None, op, prescale_factor, postscale_factor, process_set,
                                       ignore_name_scope)
    return out


@not_converted
def reducescatter(tensor, device_dense: str = "", compression=Compression.none, op: int = Average,
                  name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """Reduce ``tensor`` across the process set and return this rank's block of rows.

    Rank r gets ``d0 // size`` rows, plus one if ``r < d0 % size``.  Only ``hvd.Sum`` and ``hvd.Average``.
    Differentiable (the gradient is an allgather).  All ranks of the process set must call it, in order.
    """
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    out = _grouped_reducescatter([compressed], name, op, process_set, ignore_name_scope, prescale_factor,
                                 postscale_factor, _single=True)[0]
    return compression.decompress(out, ctx)


@not_converted
def grouped_reducescatter(tensors: Sequence, device_dense: str = "", compression=Compression.none,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None, ignore_name_scope: bool = False) -> List:
    """:func:`reducescatter` of a list of tensors as one atomic group."""
    compressed, ctxs = [], []
    for t in tensors:
        c, ctx = compression.compress(tf.convert_to_tensor(t))
        compressed.append(c)
        ctxs.append(ctx)
    out = _grouped_reducescatter(compressed, name, op, process_set, ignore_name_scope, prescale_factor,
                                 postscale_factor)
    return [compression.decompress(o, ctx) for o, ctx in zip(out, ctxs)]

