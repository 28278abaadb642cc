"""Keras pieces of elastic training (shared by ``horovod.tensorflow.keras`` and ``horovod.keras``)."""
from __future__ import annotations

from typing import Any

from horovod._keras.flavour import keras as _active_keras
from horovod.tensorflow.elastic import TensorFlowKerasState

# The callbacks derive from the Callback of the Keras this process uses (keras or tf_keras: untyped either way,
# so Any to mypy, as if imported directly).
keras: Any = _active_keras()


class KerasState(TensorFlowKerasState):
    """Elastic state of a Keras model and its optimizer (default ``model.optimizer``), plus plain values."""

    def __init__(self, model, optimizer=None, **kwargs: Any):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit the elastic state every ``batches_per_commit`` batches (and at the end of every epoch)."""

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be >= 1, got {batches_per_commit}.")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()
        self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of batches done in the current epoch (0 when an epoch ends)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the next epoch to run (pass ``initial_epoch=state.epoch`` to ``fit``)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1
