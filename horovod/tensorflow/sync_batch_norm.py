"""SyncBatchNormalization: Keras batch normalization whose training statistics span every rank.

``hvd.SyncBatchNormalization`` is a layer of the Keras ``tf.keras`` is in this process (see
:mod:`horovod._keras.flavour`): Keras 3's ``BatchNormalization``, or ``tf_keras``'s with ``TF_USE_LEGACY_KERAS=1``,
so that it fits in that Keras's models (``tf.keras.Sequential`` accepts only its own layers).  Both classes
compute the statistics the same way (:func:`global_moments`); they differ only in the hook each Keras offers.
"""
from __future__ import annotations

import functools

import tensorflow as tf

from horovod.common import basics
from horovod.common.basics import Sum
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.mpi_ops import _grouped_allreduce, _set_size


def _distributed(process_set: ProcessSet) -> bool:
    # One rank: plain BatchNormalization (elastic jobs may grow, so they keep the collective).
    return _set_size(process_set) > 1 or basics.runtime().config.elastic


def global_moments(inputs, axes, mask, process_set: ProcessSet):
    """Mean and variance of ``inputs`` over ``axes`` of every rank's batch together (``mask``: Keras's per-sample
    mask, or None).

    Each rank computes its count, sum and sum of squares; one grouped allreduce (Sum) combines them, so every
    rank gets the same statistics.  Gradients flow through the allreduce.
    """
    x = tf.convert_to_tensor(inputs)
    axes = list(axes)
    if mask is None:
        count = tf.reshape(tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype), [1])
        local_sum = tf.reduce_sum(x, axis=axes)
        local_sq = tf.reduce_sum(tf.square(x), axis=axes)
    else:
        weights = tf.cast(tf.broadcast_to(tf.expand_dims(tf.cast(mask, x.dtype), -1), tf.shape(x)), x.dtype)
        count = tf.reshape(tf.reduce_sum(weights, axis=axes), [-1])
        local_sum = tf.reduce_sum(x * weights, axis=axes)
        local_sq = tf.reduce_sum(tf.square(x) * weights, axis=axes)
    total, total_sum, total_sq = _grouped_allreduce([count, local_sum, local_sq], op=Sum, process_set=process_set)
    mean = total_sum / total
    variance = tf.maximum(total_sq / total - tf.square(mean), 0.0)
    return mean, variance


_DOC = """Batch normalization that, in training, normalizes with the mean and variance of the *global* batch.

    Each rank computes its count, sum and sum of squares over the reduction axes; one grouped allreduce (Sum)
    combines them, so every rank normalizes with the same statistics (and updates the same moving averages).
    Gradients flow through the allreduce.  With one rank it is plain ``BatchNormalization``.  All ranks of the
    process set must call the layer in training together.

    Args:
        fused: must be False (accepted for compatibility with the original signature).
        process_set: the ranks whose batches form the global batch (not saved in the layer config).
        **kwargs: ``BatchNormalization`` arguments.
    """


@functools.lru_cache(maxsize=None)
def keras3_class() -> type:
    """The Keras 3 layer."""
    import keras

    @keras.saving.register_keras_serializable(package="Horovod")
    class SyncBatchNormalization(keras.layers.BatchNormalization):
        __doc__ = _DOC

        def __init__(self, fused: bool = False, process_set: ProcessSet = global_process_set, **kwargs):
            if fused:
                raise ValueError("SyncBatchNormalization does not support fused=True.")
            super().__init__(**kwargs)
            self._hvd_process_set = process_set

        @not_converted
        def _moments(self, inputs, mask):
            if not _distributed(self._hvd_process_set):
                return super()._moments(inputs, mask)
            return global_moments(inputs, self._reduction_axes, mask, self._hvd_process_set)

    SyncBatchNormalization.__module__ = __name__
    return SyncBatchNormalization


@functools.lru_cache(maxsize=None)
def tf_keras_class() -> type:
    """The Keras 2 (``tf_keras``) layer."""
    import tf_keras

    @tf_keras.saving.register_keras_serializable(package="Horovod")
    class SyncBatchNormalization(tf_keras.layers.BatchNormalization):
        __doc__ = _DOC

        def __init__(self, fused: bool = False, process_set: ProcessSet = global_process_set, **kwargs):
            if fused in (True, None):
                raise ValueError("SyncBatchNormalization does not support fused=True.")
            if not kwargs.get("name"):
                kwargs["name"] = "sync_batch_normalization"
            super().__init__(fused=False, **kwargs)
            self._hvd_process_set = process_set

        @not_converted
        def _moments(self, inputs, reduction_axes, keep_dims, mask=None):
            if not _distributed(self._hvd_process_set):
                return super()._moments(inputs, reduction_axes, keep_dims=keep_dims, mask=mask)
            mean, variance = global_moments(inputs, reduction_axes, mask, self._hvd_process_set)
            if keep_dims:
                shape = [1 if i in reduction_axes else -1 for i in range(inputs.shape.rank)]
                mean, variance = tf.reshape(mean, shape), tf.reshape(variance, shape)
            return mean, variance

    SyncBatchNormalization.__module__ = __name__
    return SyncBatchNormalization


def active_class() -> type:
    """The layer class for the Keras ``tf.keras`` is in this process."""
    from horovod._keras.flavour import is_tf_keras

    return tf_keras_class() if is_tf_keras() else keras3_class()


def __getattr__(name: str):
    if name == "SyncBatchNormalization":
        return active_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
