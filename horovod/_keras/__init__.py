"""The one Keras implementation behind ``horovod.tensorflow.keras`` and ``horovod.keras`` (Keras 3, TF backend).

``DistributedOptimizer`` returns an instance of a dynamically created subclass of the wrapped optimizer's class
whose ``apply`` (which ``apply_gradients`` and ``model.fit``'s train step call) reduces the gradients across ranks
first.  ``model.fit`` runs the train step inside ``tf.function``; the reduction is a graph op there (see
:mod:`horovod.tensorflow.bridge`).  The subclass keeps the wrapped class's name and module, so saved models
contain a plain Keras optimizer and load without Horovod; :func:`load_model` re-wraps it.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import tensorflow as tf

import horovod.tensorflow as hvd
from horovod.common.basics import Average
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from horovod.tensorflow.gradient_reducer import GradientReducer


def _keras():
    import keras

    return keras


class _HorovodState:
    """What the distributed optimizer adds: the reducer and, with local aggregation, its variables."""

    def __init__(self) -> None:
        self.reducer: Optional[GradientReducer] = None
        self.passes = 1
        self.aggregation: Optional[LocalGradientAggregationHelper] = None
        self.counter = None
        self.accumulators: Dict[int, object] = {}


class _DistributedOptimizerMixin:
    """Placed in front of the wrapped optimizer's class by :func:`create_distributed_optimizer`."""

    def _hvd_configure(self, reducer: GradientReducer, backward_passes_per_step: int,
                       average_aggregated_gradients: bool) -> None:
        # One plain holder object: Keras would wrap (and track) lists and dicts assigned to the optimizer.
        state = _HorovodState()
        state.reducer = reducer
        state.passes = backward_passes_per_step
        if backward_passes_per_step > 1:
            state.aggregation = LocalGradientAggregationHelper(
                backward_passes_per_step, reducer, average_aggregated_gradients=average_aggregated_gradients,
                optimizer_type="keras", name="hvd")
        self._hvd = state

    def build(self, variables):
        super().build(variables)
        state = getattr(self, "_hvd", None)
        if state is not None and state.passes > 1:
            # Keras variables of the optimizer: tracked, saved, and broadcast with optimizer.variables.
            state.counter = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                              name="hvd_aggregation_counter")
            for var in variables:
                state.accumulators[self._var_key(var)] = self.add_variable_from_reference(
                    var, name="hvd_aggregated_gradient")

    @not_converted
    def apply(self, grads, trainable_variables=None):
        """Reduce ``grads`` across ranks, then apply them with the wrapped optimizer's ``apply``."""
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError("When passing `grads` without `variables`, the optimizer must already be built; "
                                 "call `optimizer.build(trainable_variables)` first.")
            variables = list(self._trainable_variables)
        else:
            variables = list(trainable_variables)
        state = self._hvd
        if state.aggregation is None:
            return super().apply(state.reducer(grads, variables), trainable_variables)
        if not self.built:
            self.build(variables)
            self.built = True
        state.aggregation.set_variables(state.counter, [state.accumulators[self._var_key(v)] for v in variables])
        reduced = state.aggregation.compute_gradients(grads, variables)
        parent_apply = super().apply

        def apply_fn():
            parent_apply(reduced, variables)

        def skip_fn():
            # The original advances the iteration counter on accumulation-only steps too.
            return self._iterations.assign_add(1)

        state.aggregation.apply_gradients(apply_fn, skip_fn)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (not reduced; scaled by ``scale_local_gradients``)."""
        self._hvd.reducer.register_local(var)


_optimizer_classes: Dict[type, type] = {}


def _check_backend() -> None:
    keras = _keras()
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"horovod's Keras DistributedOptimizer needs the TensorFlow backend; Keras is using "
                         f"'{keras.backend.backend()}' (set KERAS_BACKEND=tensorflow).")


def create_distributed_optimizer(keras, optimizer, name: Optional[str] = None, device_dense: str = "",
                                 device_sparse: str = "", compression=Compression.none,
                                 sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                 op: int = Average, backward_passes_per_step: int = 1,
                                 average_aggregated_gradients: bool = False, groups=None, num_groups: int = 0,
                                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True):
    """Build the distributed version of a Keras 3 optimizer (see ``horovod.tensorflow.keras.DistributedOptimizer``).

    The new optimizer is created from ``optimizer.get_config()``; if ``optimizer`` was already built (e.g. it
    came from a loaded model), its variables (slots, iteration count) are copied over.
    """
    keras = keras or _keras()
    _check_backend()
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer needs a keras.optimizers.Optimizer, got {optimizer!r}.")
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("The optimizer is already a DistributedOptimizer; wrap the plain optimizer once.")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}.")
    base = type(optimizer)
    cls = _optimizer_classes.get(base)
    if cls is None:
        cls = _optimizer_classes[base] = type(base.__name__, (_DistributedOptimizerMixin, base),
                                              {"__module__": base.__module__, "__qualname__": base.__qualname__})
    new = cls.from_config(optimizer.get_config())
    reducer = GradientReducer(name or f"Distributed{base.__name__}", compression, sparse_as_dense, op,
                              gradient_predivide_factor, groups, num_groups, process_set, scale_local_gradients)
    new._hvd_configure(reducer, backward_passes_per_step, average_aggregated_gradients)
    if getattr(optimizer, "built", False) and getattr(optimizer, "_trainable_variables", None):
        new.build(list(optimizer._trainable_variables))
        for dst, src in zip(new.variables, optimizer.variables):
            dst.assign(src)
    return new


def broadcast_global_variables(backend, root_rank: int):
    """TF1 graphs: run the broadcast of every global variable.  Keras 3 keeps no global variable list, so
    eagerly this raises and points at the callback.

    Raises:
        RuntimeError: called eagerly.
    """
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() needs TF1 graph mode; with Keras 3 use "
                           "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in model.fit, or "
                           "hvd.broadcast_variables(model.variables, root_rank) in a custom loop.")
    return hvd.broadcast_global_variables(root_rank)


def allreduce(backend, value, name: Optional[str], average, prescale_factor: float, postscale_factor: float,
              op, compression):
    """Allreduce a value (array, tensor or number); returns a tensor."""
    return hvd.allreduce(tf.convert_to_tensor(value), average=average, name=name, op=op,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         compression=compression)


def allgather(backend, value, name: Optional[str]):
    """Allgather a value along dimension 0; returns a tensor."""
    return hvd.allgather(tf.convert_to_tensor(value), name=name)


def broadcast(backend, value, root_rank: int, name: Optional[str]):
    """Broadcast a value from ``root_rank``; returns a tensor."""
    return hvd.broadcast(tf.convert_to_tensor(value), root_rank, name=name)


def reducescatter(backend, value, name: Optional[str], op):
    """Reducescatter a value; returns this rank's block as a tensor."""
    return hvd.reducescatter(tf.convert_to_tensor(value), name=name, op=op)


def load_model(keras, wrap_optimizer: Callable, filepath, custom_optimizers=None, custom_objects=None,
               legacy_opts: bool = False):
    """Load a saved Keras model and wrap its optimizer with ``wrap_optimizer`` (state preserved).

    Args:
        custom_optimizers: optimizer classes the file refers to that Keras does not know.
        custom_objects: passed to ``keras.models.load_model``.
        legacy_opts: accepted for compatibility.
    """
    keras = keras or _keras()
    objects = {cls.__name__: cls for cls in (custom_optimizers or [])}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, _DistributedOptimizerMixin):
        model.optimizer = wrap_optimizer(optimizer)
        model.train_function = None
    return model
