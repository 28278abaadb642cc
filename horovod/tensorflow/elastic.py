"""Elastic training for TensorFlow: ``TensorFlowKerasState``, ``TensorFlowState`` and the ``run`` decorator.

.. code-block:: python

    import horovod.tensorflow as hvd

    hvd.init()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches_per_epoch):
                train_step(...)
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    train(state)
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from horovod.common.basics import init, rank, shutdown
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError
from horovod.tensorflow.functions import broadcast_object, broadcast_variables

__all__ = ["TensorFlowKerasState", "TensorFlowState", "run"]

# Engine failures inside a graph reach Python as tf.errors.FailedPreconditionError (see horovod.tensorflow.bridge;
# UnknownError from a Python node that failed otherwise) whose text names the failing Horovod node or the engine's
# exception class.
_HOROVOD_MARKERS = ("HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather", "HorovodGroupedAllgather",
                    "HorovodBroadcast", "HorovodGroupedBroadcast", "HorovodAlltoall", "HorovodReducescatter",
                    "HorovodGroupedReducescatter", "HorovodInternalError", "PeerFailureError", "ShutdownError",
                    "MismatchError", "StallError")


def _reset() -> None:
    shutdown()
    init()


def _as_horovod_error(exc: BaseException) -> Optional[HorovodInternalError]:
    if isinstance(exc, HorovodInternalError):
        return None   # already what run_fn catches
    if isinstance(exc, (tf.errors.FailedPreconditionError, tf.errors.UnknownError)) and \
            any(m in str(exc) for m in _HOROVOD_MARKERS):
        return HorovodInternalError(str(exc))
    return None


def run(func: Callable) -> Callable:
    """Decorator: run ``func(state, ...)`` and, whenever workers fail or hosts change, restore or keep the state,
    re-initialise Horovod with the new workers, synchronise the state and call ``func`` again.

    Failures of Horovod ops inside ``tf.function`` (reported by TF as ``FailedPreconditionError``) count as
    ``HorovodInternalError``.
    """

    return run_fn(translate_errors(func), _reset)


def translate_errors(func: Callable) -> Callable:
    """Wrap ``func`` so that Horovod failures reported by TF as graph errors (``FailedPreconditionError``,
    ``UnknownError``) raise ``HorovodInternalError``."""

    @functools.wraps(func)
    def translated(*args: Any, **kwargs: Any):
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as exc:
            error = _as_horovod_error(exc)
            if error is not None:
                raise error from exc
            raise

    return translated


def _values(variables: Sequence) -> List[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


def _optimizer_variables(optimizer) -> list:
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class TensorFlowKerasState(ObjectState):
    """Elastic state of a Keras model and its optimizer (TF2, eager or ``model.fit``), plus plain values.

    ``commit()`` keeps a copy of every weight and optimizer variable; ``restore()`` assigns it back; ``sync()``
    broadcasts them (and the plain values) from the rank holding the newest commit.

    Args:
        model: the Keras model.
        optimizer: its optimizer (default ``model.optimizer``).
        backend: accepted for compatibility.
        kwargs: plain values (``epoch=0, batch=0`` …), read and assigned as attributes.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs: Any):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._saved_weights = _values(model.weights)
        self._saved_optimizer = _values(_optimizer_variables(self.optimizer))
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        self._saved_weights = _values(self.model.weights)
        self._saved_optimizer = _values(_optimizer_variables(self.optimizer))
        super().save()

    def restore(self) -> None:
        for var, value in zip(self.model.weights, self._saved_weights):
            var.assign(value)
        opt_vars = _optimizer_variables(self.optimizer)
        # An optimizer built after the last commit has nothing saved to go back to.
        if len(opt_vars) == len(self._saved_optimizer):
            for var, value in zip(opt_vars, self._saved_optimizer):
                var.assign(value)
        super().restore()

    def sync(self) -> None:
        root = getattr(self, "_sync_root", 0)
        broadcast_variables(list(self.model.weights) + _optimizer_variables(self.optimizer), root_rank=root)
        self.save()   # the synced weights are what restore() returns to, not this rank's pre-sync ones
        super().sync()


class TensorFlowState(ObjectState):
    """Elastic state of a list of ``tf.Variable`` (eager, or a TF1 graph with ``session``), plus plain values.

    Args:
        variables: the variables (default: ``tf.compat.v1.global_variables()`` in graph mode).
        session: the TF1 session that owns them (graph mode only).
        kwargs: plain values, read and assigned as attributes.
    """

    def __init__(self, variables: Optional[Sequence] = None, session=None, **kwargs: Any):
        if variables is None:
            if tf.executing_eagerly():
                raise ValueError("TensorFlowState needs the list of variables when running eagerly.")
            variables = tf.compat.v1.global_variables()
        self.variables = list(variables)
        self.session = session
        if session is not None:
            # Build the graph pieces once: placeholders to assign saved values, and the broadcast op.
            with session.graph.as_default():
                self._placeholders = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in self.variables]
                self._assign_op = tf.group(*[v.assign(p) for v, p in zip(self.variables, self._placeholders)])
                self._bcast_ops: Dict[int, Any] = {}   # root rank -> its broadcast op
        self._saved = self._eval()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _eval(self) -> List[np.ndarray]:
        if self.session is not None:
            return [np.array(v, copy=True) for v in self.session.run(self.variables)]
        return _values(self.variables)

    def save(self) -> None:
        self._saved = self._eval()
        super().save()

    def restore(self) -> None:
        if self.session is not None:
            self.session.run(self._assign_op, feed_dict=dict(zip(self._placeholders, self._saved)))
        else:
            for var, value in zip(self.variables, self._saved):
                var.assign(value)
        super().restore()

    def sync(self) -> None:
        root = getattr(self, "_sync_root", 0)
        if self.session is not None:
            op = self._bcast_ops.get(root)
            if op is None:
                with self.session.graph.as_default():
                    op = self._bcast_ops[root] = broadcast_variables(self.variables, root_rank=root)
            self.session.run(op)
        else:
            broadcast_variables(self.variables, root_rank=root)
        self.save()   # the synced values are what restore() returns to, not this rank's pre-sync ones
        super().sync()
