"""Keras callbacks for distributed training (the implementation lives in :mod:`horovod._keras.callbacks`)."""
from horovod._keras.callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback,  # noqa: F401
                                      LearningRateScheduleCallback, LearningRateWarmupCallback,
                                      MetricAverageCallback)
