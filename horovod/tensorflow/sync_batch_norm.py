"""SyncBatchNormalization: Keras batch normalization whose training statistics span every rank."""
from __future__ import annotations

import keras
import tensorflow as tf

from horovod.common import basics
from horovod.common.basics import Sum
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.mpi_ops import _grouped_allreduce, _set_size


@keras.saving.register_keras_serializable(package="Horovod")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization that, in training, normalizes with the mean and variance of the *global* batch.

    Each rank computes its count, sum and sum of squares over the reduction axes; one grouped allreduce (Sum)
    combines them, so every rank normalizes with the same statistics (and updates the same moving averages).
    Gradients flow through the allreduce.  With one rank it is plain ``BatchNormalization``.  All ranks of the
    process set must call the layer in training together.

    Args:
        fused: must be False (accepted for compatibility with the original signature).
        process_set: the ranks whose batches form the global batch (not saved in the layer config).
        **kwargs: ``keras.layers.BatchNormalization`` arguments.
    """

    def __init__(self, fused: bool = False, process_set: ProcessSet = global_process_set, **kwargs):
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(**kwargs)
        self._hvd_process_set = process_set

    @not_converted
    def _moments(self, inputs, mask):
        if _set_size(self._hvd_process_set) == 1 and not basics.runtime().config.elastic:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        x = tf.convert_to_tensor(inputs)
        if mask is None:
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
            count = tf.reshape(count, [1])
            local_sum = tf.reduce_sum(x, axis=axes)
            local_sq = tf.reduce_sum(tf.square(x), axis=axes)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(tf.cast(mask, x.dtype), -1), tf.shape(x)), x.dtype)
            count = tf.reshape(tf.reduce_sum(weights, axis=axes), [-1])
            local_sum = tf.reduce_sum(x * weights, axis=axes)
            local_sq = tf.reduce_sum(tf.square(x) * weights, axis=axes)
        total, total_sum, total_sq = _grouped_allreduce([count, local_sum, local_sq], op=Sum,
                                                        process_set=self._hvd_process_set)
        mean = total_sum / total
        variance = tf.maximum(total_sq / total - tf.square(mean), 0.0)
        return mean, variance
