"""How DistributedGradientTape and the DistributedOptimizers reduce a list of gradients.

Dense gradients travel in atomic groups (by default one group: one TF op per step).  Without explicit ``groups``
small dense gradients are packed into buckets of up to ``HOROVOD_GRADIENT_BUCKET_BYTES`` (4 MiB) of one dtype,
like the torch optimizer's (:mod:`horovod.common.buckets` plans them): each bucket is concatenated into one flat
tensor with one allreduce request, instead of one request per gradient.  ``IndexedSlices`` travel as allgathers
(unless ``sparse_as_dense``), and gradients of *local* variables
(``PartialDistributedGradientTape`` / ``register_local_var``) stay on this rank, divided by the process-set size
when ``scale_local_gradients`` so they are on the same scale as the averaged ones.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence

import tensorflow as tf

from horovod.common import basics
from horovod.common.basics import Adasum, Average
from horovod.common.buckets import plan_buckets
from horovod.common.grouping import check_groups, partition
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.engine import config as _config
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.mpi_ops import _set_size, scale
from horovod.tensorflow.reduction import allreduce, grouped_allreduce


_BUCKET_KNOB = "HOROVOD_GRADIENT_BUCKET_BYTES"
_bucket_bytes_by_raw: Dict[Optional[str], int] = {}


def _bucket_bytes() -> int:
    """``HOROVOD_GRADIENT_BUCKET_BYTES`` as the engine's config reads it, parsed once per distinct value (a tape
    may be wrapped every step, and a full config load costs ~0.1 ms)."""
    raw = _config.environ().get(_BUCKET_KNOB)
    value = _bucket_bytes_by_raw.get(raw)
    if value is None:
        value = _bucket_bytes_by_raw[raw] = _config.load({} if raw is None else {_BUCKET_KNOB: raw}) \
            .gradient_bucket_bytes
    return value


def variable_key(var) -> Hashable:
    """One identity for a variable, the same for a Keras variable and the ``tf.Variable`` it wraps."""
    inner = getattr(var, "_value", None)
    if isinstance(inner, tf.Variable):
        return id(inner)
    return id(var)


def check_predivide(op: int, gradient_predivide_factor: float) -> None:
    """Raises ValueError when a predivide factor is combined with an op other than Average."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average "
                         f"(got op={op}, gradient_predivide_factor={gradient_predivide_factor}).")


class GradientReducer:
    """Allreduces lists of gradients (see the module docstring).

    Args:
        name: name scope of the ops (``<name>_Allreduce``).
        compression: compressor for dense gradients.
        sparse_as_dense: densify ``IndexedSlices`` before reducing.
        op: reduction op (default Average).
        gradient_predivide_factor: with Average, divide by this before the sum and multiply after (the sum is
            then divided by the set size as usual).
        groups: ``None``/int/list of lists of variables; see :func:`horovod.common.grouping.partition`.
        num_groups: deprecated alias of an int ``groups``.
        process_set: the ranks to reduce over.
        scale_local_gradients: divide local variables' gradients by the set size.
    """

    def __init__(self, name: str = "DistributedGradientTape", compression=Compression.none,
                 sparse_as_dense: bool = False, op: int = Average, gradient_predivide_factor: float = 1.0,
                 groups=None, num_groups: int = 0, process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True):
        check_predivide(op, gradient_predivide_factor)
        self.name = name
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.groups = check_groups(groups, num_groups)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.prescale = 1.0 / gradient_predivide_factor if op == Average else 1.0
        self.postscale = gradient_predivide_factor if op == Average else 1.0
        self.local_keys: set = set()
        # Adasum's result depends on how tensors are split, and explicit groups keep the original's meaning.
        self.bucket_bytes = _bucket_bytes() if self.groups is None and op != Adasum else 0

    def register_local(self, var) -> None:
        """Keep ``var``'s gradient on this rank (not reduced)."""
        self.local_keys.add(variable_key(var))

    def is_local(self, var) -> bool:
        return var is not None and variable_key(var) in self.local_keys

    def _single_rank(self) -> bool:
        # One rank: every reduction is the identity, so skip the ops (elastic jobs may grow, so keep them).
        return _set_size(self.process_set) == 1 and not basics.runtime().config.elastic

    def _outside_set(self) -> bool:
        # A rank that is not a member of the process set keeps its local gradients unchanged (the original's
        # _allreduce_cond), instead of failing in a collective it cannot join.
        ranks = self.process_set.ranks
        return bool(ranks) and self.process_set.process_set_id != 0 and basics.rank() not in ranks

    @not_converted
    def __call__(self, grads: Sequence, variables: Optional[Sequence] = None) -> List:
        """Reduce ``grads`` (``None`` entries stay ``None``); ``variables`` identify groups and local variables."""
        grads = list(grads)
        variables = list(variables) if variables is not None else [None] * len(grads)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        out = list(grads)
        local = [i for i, g in enumerate(grads) if g is not None and self.is_local(variables[i])]
        shared = [i for i, g in enumerate(grads) if g is not None and not self.is_local(variables[i])]
        if shared and not self._single_rank() and not self._outside_set():
            with tf.name_scope(f"{self.name}_Allreduce"):
                dense = [i for i in shared if not isinstance(grads[i], tf.IndexedSlices)]
                keys = [variable_key(variables[i]) if variables[i] is not None else None for i in dense]
                for group in partition(len(dense), self.groups, keys, key_of=variable_key):
                    idx = [dense[j] for j in group]
                    tensors = [tf.convert_to_tensor(grads[i]) for i in idx]
                    packed, unpack = pack_buckets(tensors, self.bucket_bytes)
                    reduced = grouped_allreduce(packed, op=self.op, compression=self.compression,
                                                prescale_factor=self.prescale, postscale_factor=self.postscale,
                                                process_set=self.process_set)
                    for i, r in zip(idx, unpack(reduced)):
                        out[i] = r
                for i in shared:
                    if isinstance(grads[i], tf.IndexedSlices):
                        # Gathered, not summed: the predivide factor (prescale 1/f, postscale f) has nothing to
                        # split, and the sparse path refuses scale factors.
                        out[i] = allreduce(grads[i], op=self.op, process_set=self.process_set)
        if local and self.scale_local_gradients:
            size = _set_size(self.process_set)
            if size != 1:
                for i in local:
                    out[i] = _scale(grads[i], 1.0 / size)
        return out


def _nbytes(tensor) -> Optional[int]:
    elements = tensor.shape.num_elements()
    return None if elements is None else elements * tensor.dtype.size


def pack_buckets(tensors: Sequence, cap: int):
    """Concatenate the small tensors of each planned bucket into one flat tensor.

    Returns:
        ``(packed, unpack)``: the tensors to reduce (one per bucket, then the tensors in no bucket) and a function
        mapping the reduced ``packed`` back to one tensor per input, in input order and with the input shapes.
    """
    buckets = plan_buckets([_nbytes(t) for t in tensors], [t.dtype for t in tensors], cap)
    if not buckets:
        return list(tensors), list
    in_bucket = {i for bucket in buckets for i in bucket}
    alone = [i for i in range(len(tensors)) if i not in in_bucket]
    packed = [tf.concat([tf.reshape(tensors[i], [-1]) for i in bucket], axis=0) for bucket in buckets]
    packed += [tensors[i] for i in alone]

    def unpack(reduced: Sequence) -> List:
        out: List = [None] * len(tensors)
        for bucket, flat in zip(buckets, reduced):
            pieces = tf.split(flat, [tensors[i].shape.num_elements() for i in bucket])
            for i, piece in zip(bucket, pieces):
                out[i] = tf.reshape(piece, tensors[i].shape)
        for i, value in zip(alone, reduced[len(buckets):]):
            out[i] = value
        return out

    return packed, unpack


def _scale(grad, factor: float):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(scale(grad.values, factor), grad.indices, grad.dense_shape)
    return scale(grad, factor)

