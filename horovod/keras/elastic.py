"""Elastic training with Keras (``horovod.keras.elastic``): the same classes as ``horovod.tensorflow.keras.elastic``."""
from horovod.tensorflow.keras.elastic import (CommitStateCallback, KerasState, UpdateBatchStateCallback,  # noqa: F401
                                              UpdateEpochStateCallback, run)
