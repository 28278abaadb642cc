"""DistributedOptimizer for TF1-style optimizers (``tf.compat.v1.train.Optimizer``), the factory that also
accepts Keras optimizers, and the TF1 global-variable broadcast helpers."""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from horovod.common.basics import Average
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow import bridge
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.functions import broadcast_variables
from horovod.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from horovod.tensorflow.gradient_reducer import GradientReducer

_LegacyOptimizer = tf.compat.v1.train.Optimizer


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``: ``compute_gradients`` returns reduced gradients.

    ``minimize()`` (inherited) calls :meth:`compute_gradients` and :meth:`apply_gradients`, so it is
    distributed too.  Everything else is delegated to the wrapped optimizer.
    """

    def __init__(self, optimizer, name: Optional[str] = None, use_locking: bool = False,
                 compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, groups=None, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True):
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = GradientReducer(name, compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                                        num_groups, process_set, scale_local_gradients)
        self._aggregation = None
        if backward_passes_per_step > 1:
            self._aggregation = LocalGradientAggregationHelper(
                backward_passes_per_step, self._reducer, sparse_as_dense, average_aggregated_gradients,
                optimizer_type="legacy", process_set=process_set, scale_local_gradients=scale_local_gradients,
                name=name)
        elif backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}.")

    @not_converted
    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``compute_gradients``, then the gradients are reduced across ranks.

        All ranks must call it for the same variables.
        """
        gradients = self._optimizer.compute_gradients(*args, **kwargs)
        if not gradients:
            return gradients
        grads, variables = zip(*gradients)
        if self._aggregation is not None:
            reduced = self._aggregation.compute_gradients(grads, variables)
        else:
            reduced = self._reducer(grads, variables)
        return list(zip(reduced, variables))

    @not_converted
    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's ``apply_gradients`` (every ``backward_passes_per_step``-th step)."""
        if self._aggregation is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        grads_and_vars = list(grads_and_vars)

        def apply():
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

        def skip():
            return global_step.assign_add(1) if global_step is not None else None

        return self._aggregation.apply_gradients(apply, skip)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (not reduced)."""
        self._reducer.register_local(var)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def _is_keras_optimizer(optimizer) -> bool:
    from horovod._keras.flavour import optimizer_kind   # imports tensorflow only; Keras on demand

    return optimizer_kind(optimizer) is not None


def DistributedOptimizer(optimizer, name: Optional[str] = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups=None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True):
    """Wrap an optimizer so that gradients are averaged (by default) across ranks before they are applied.

    Accepts a TF1 ``tf.compat.v1.train.Optimizer`` (graph mode or eager) or a Keras optimizer (Keras 3, or
    ``tf_keras``'s new and legacy ones with ``TF_USE_LEGACY_KERAS=1``; then the
    result is the same as ``horovod.tensorflow.keras.DistributedOptimizer``).  ``device_*`` and
    ``use_locking`` are accepted for compatibility.

    Args:
        compression: e.g. ``hvd.Compression.fp16``.
        sparse_as_dense: densify ``IndexedSlices`` gradients before reducing.
        backward_passes_per_step: accumulate this many steps' gradients locally before one reduction.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum`` (Adasum reduces the gradients).
        gradient_predivide_factor: with Average, scale by ``1/f`` before the sum and ``f`` after.
        average_aggregated_gradients: with ``backward_passes_per_step`` > 1, average instead of sum the passes.
        num_groups / groups: how gradients are grouped into atomic reductions.
        process_set: ranks to reduce over.
        scale_local_gradients: divide gradients of variables registered with ``register_local_var`` by the
            set size.

    Raises:
        ValueError: the optimizer is neither kind, or the arguments are inconsistent.
    """
    if isinstance(optimizer, _LegacyOptimizer):
        return _DistributedOptimizer(optimizer, name, use_locking, compression, sparse_as_dense, op,
                                     gradient_predivide_factor, backward_passes_per_step,
                                     average_aggregated_gradients, groups, num_groups, process_set,
                                     scale_local_gradients)
    if _is_keras_optimizer(optimizer):
        from horovod._keras.optimizer import create_distributed_optimizer

        return create_distributed_optimizer(
            None, optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups, num_groups=num_groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    raise ValueError(f"Provided optimizer doesn't inherit from either legacy TensorFlow or Keras optimizer: "
                     f"{optimizer!r}")


def broadcast_global_variables(root_rank: int):
    """The op that broadcasts every TF1 global variable from ``root_rank`` (graph mode only).

    Raises:
        RuntimeError: called eagerly (TF2 has no global variable collection).
    """
    if bridge.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """SessionRunHook that broadcasts all global variables from ``root_rank`` when the session is created.

    Use with ``tf.compat.v1.train.MonitoredTrainingSession`` so every rank starts from the same weights (random
    initialisation or a checkpoint restored on the root).
    """

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)

