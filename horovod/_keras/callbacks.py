"""Keras callbacks for distributed training (shared by ``horovod.tensorflow.keras`` and ``horovod.keras``).

They derive from the ``Callback`` of the Keras this process uses (Keras 3, or ``tf_keras`` with
``TF_USE_LEGACY_KERAS=1``), chosen when this module is imported: each Keras drives only callbacks of its own
kind correctly.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod._keras.flavour import keras as _active_keras, to_float, variables_of
from horovod.tensorflow.gradient_reducer import variable_key

# keras or tf_keras: untyped either way, so its classes are Any to mypy, as if imported directly.
keras: Any = _active_keras()

logger = logging.getLogger(__name__)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's weights and the optimizer's variables from ``root_rank`` to every rank.

    Runs when training begins (before the first step, so every rank starts from the root's weights) and, if the
    optimizer had no variables yet then, once more after the first batch for them.  A model that is built by its
    first batch (a ``Sequential`` without an input shape) has no weights when training begins: then everything is
    broadcast at the end of the first batch, as the original always did.  Every rank must use it.

    Args:
        root_rank: global rank whose values win.
        device: accepted for compatibility.
        local_variables: variables to leave alone (e.g. model-parallel parts).
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Optional[Sequence] = None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.local_keys = {variable_key(v) for v in (local_variables or [])}
        self.broadcast_done = False

    def _broadcast(self, include_optimizer: bool) -> None:
        variables = list(self.model.weights)
        optimizer = getattr(self.model, "optimizer", None)
        if include_optimizer and optimizer is not None:
            variables += variables_of(optimizer)
        variables = [v for v in variables if variable_key(v) not in self.local_keys]
        hvd.broadcast_variables(variables, root_rank=self.root_rank)

    def on_train_begin(self, logs=None):
        if self.broadcast_done or not getattr(self.model, "built", True):
            return   # not built yet (tf_keras raises on model.weights): on_batch_end broadcasts
        optimizer = getattr(self.model, "optimizer", None)
        optimizer_ready = optimizer is not None and bool(getattr(optimizer, "built", False))
        self._broadcast(include_optimizer=optimizer_ready)
        self.broadcast_done = optimizer_ready

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        self._broadcast(include_optimizer=True)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace the epoch's metrics in ``logs`` by their average over all ranks.

    Put it before callbacks that read the metrics (checkpointing, early stopping, learning-rate schedules on
    plateau); the History object returned by ``fit`` then holds the averages.  Every rank must use it.

    Args:
        device: accepted for compatibility.
    """

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype,
                                                                                      np.number))
        # One allreduce for all metrics; ranks with different metric sets fail with a shape mismatch.
        values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        averaged = hvd.allreduce(values, op=hvd.Average, name="MetricAverageCallback").numpy()
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch`` and ``end_epoch``.

    Args:
        initial_lr: the base learning rate (usually already scaled by ``hvd.size()``).
        multiplier: a constant, or ``fn(epoch) -> float`` (``epoch`` is fractional when not ``staircase``).
        start_epoch: first epoch (inclusive) the schedule applies to.
        end_epoch: first epoch it no longer applies to (``None``: until the end).
        staircase: change the rate at epoch boundaries only; otherwise every batch, with
            ``epoch + batch / steps_per_epoch``.
        momentum_correction: when the rate changes, scale a *variable* momentum by ``new_lr / old_lr`` for one
            batch (Keras 3 optimizers keep momentum as a Python float fixed at trace time; those are left alone).
        steps_per_epoch: batches per epoch (default: what ``fit`` reports).
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None):
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch, m=multiplier: m)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._restore_momentum: Optional[float] = None

    def _in_range(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _optimizer(self):
        return self.model.optimizer

    def _get_lr(self) -> float:
        return to_float(self._optimizer().learning_rate)

    def _set_lr(self, lr: float) -> None:
        optimizer = self._optimizer()
        try:
            optimizer.learning_rate = lr
        except TypeError as exc:
            raise ValueError("LearningRateScheduleCallback needs an optimizer with a float learning rate, not a "
                             "LearningRateSchedule.") from exc

    def _adjust(self, epoch: float) -> None:
        old_lr = self._get_lr()
        new_lr = self.initial_lr * self.multiplier(epoch)
        self._set_lr(new_lr)
        momentum = getattr(self._optimizer(), "momentum", None)
        if (self.momentum_correction and old_lr > 0 and new_lr != old_lr and momentum is not None
                and hasattr(momentum, "assign")):
            value = to_float(momentum)
            self._restore_momentum = value
            momentum.assign(value * new_lr / old_lr)

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError("LearningRateScheduleCallback with staircase=False needs steps_per_epoch: pass it, "
                             "or give model.fit data whose length is known.")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_batch_begin(self, batch, logs=None):
        if not self.staircase and self._in_range(self.current_epoch):
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self._optimizer().momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self._get_lr()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``, per batch.

    The multiplier at (fractional) epoch ``e`` is ``1/size * (e * (size - 1) / warmup_epochs + 1)``: large
    global batches start with the single-rank rate and reach the scaled rate gradually ("Accurate, Large
    Minibatch SGD", Goyal et al.).  At the end of the last warm-up epoch the rate is set to ``initial_lr``
    exactly (the last batch of the ramp stops one batch short of it).

    Args:
        initial_lr: the target learning rate (typically ``base_lr * hvd.size()``).
        warmup_epochs: number of epochs of warm-up.
        momentum_correction / steps_per_epoch: as in :class:`LearningRateScheduleCallback`.
        verbose: print (rank 0) when the warm-up ends.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        def multiplier(epoch: float) -> float:
            size = hvd.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.end_epoch - 1:
            # The last batch ran at a fraction below 1: land exactly on the target rate.
            self._set_lr(self.initial_lr)
            if self.verbose > 0 and hvd.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")
        super().on_epoch_end(epoch, logs)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ``ModelCheckpoint`` that keeps only the best model (``save_best_only=True``).

    ``filepath`` may be given later (the original's estimators set it); it must be set before training.
    Usually only rank 0 uses it.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq="epoch", filepath: Optional[str] = None):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs=None):
        if not self.filepath:
            raise ValueError("BestModelCheckpoint.filepath must be set before training.")
        super().on_train_begin(logs)
