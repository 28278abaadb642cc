"""The Keras DistributedOptimizer: a dynamically created subclass of the wrapped optimizer's class.

Keras 3 optimizers get :class:`_DistributedOptimizerMixin` (the reduction happens in ``apply``, which
``apply_gradients`` and ``model.fit``'s train step call); Keras 2 (``tf_keras``) optimizers, new and legacy, get
:class:`horovod._keras.keras2.Keras2DistributedOptimizerMixin`.  The subclass keeps the wrapped class's name and
module, so saved models contain a plain Keras optimizer and load without Horovod.
"""
from __future__ import annotations

from typing import Dict, Optional, Type, TypeVar, cast

from horovod.common.basics import Average
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod._keras import flavour
from horovod._keras.keras2 import Keras2DistributedOptimizerMixin, KerasOptimizerBase, copy_state, is_built
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from horovod.tensorflow.gradient_reducer import GradientReducer


class _HorovodState:
    """What the distributed optimizer adds: the reducer and, with local aggregation, its variables."""

    def __init__(self, reducer: GradientReducer) -> None:
        self.reducer = reducer
        self.passes = 1
        self.aggregation: Optional[LocalGradientAggregationHelper] = None
        self.counter = None
        self.accumulators: Dict[int, object] = {}


class _DistributedOptimizerMixin(KerasOptimizerBase):
    """Placed in front of the wrapped optimizer's class by :func:`create_distributed_optimizer`."""

    def _hvd_configure(self, reducer: GradientReducer, backward_passes_per_step: int,
                       average_aggregated_gradients: bool) -> None:
        # One plain holder object: Keras would wrap (and track) lists and dicts assigned to the optimizer.
        state = _HorovodState(reducer)
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
        state = getattr(self, "_hvd", None)
        if state is None:
            # Made by ``from_config`` on the distributed class: reduce with the defaults (average, all ranks).
            self._hvd_configure(GradientReducer(f"Distributed{type(self).__name__}"), 1, False)
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

    @property
    def _agg_helper(self) -> Optional[LocalGradientAggregationHelper]:
        """The local gradient aggregation (``backward_passes_per_step`` > 1), under the original's name."""
        state = getattr(self, "_hvd", None)
        return state.aggregation if state is not None else None

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (not reduced; scaled by ``scale_local_gradients``)."""
        if getattr(self, "_hvd", None) is None:
            self._hvd_configure(GradientReducer(f"Distributed{type(self).__name__}"), 1, False)
        self._hvd.reducer.register_local(var)


_optimizer_classes: Dict[type, type] = {}
_Mixin = TypeVar("_Mixin")


def _check_backend() -> None:
    import keras

    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"horovod's Keras DistributedOptimizer needs the TensorFlow backend; Keras is using "
                         f"'{keras.backend.backend()}' (set KERAS_BACKEND=tensorflow).")


def _distributed_class(base: type, mixin: Type[_Mixin]) -> Type[_Mixin]:
    """The subclass of ``base`` with ``mixin`` in front; it keeps ``base``'s name and module so that saved models
    name the plain optimizer."""
    cls = _optimizer_classes.get(base)
    if cls is None:
        cls = _optimizer_classes[base] = type(base.__name__, (mixin, base),
                                              {"__module__": base.__module__, "__qualname__": base.__qualname__})
    return cast(Type[_Mixin], cls)   # a class of base's kind has mixin's kind in front (one kind per base)


def is_distributed(optimizer) -> bool:
    """True for an optimizer returned by :func:`create_distributed_optimizer` (either Keras)."""
    return isinstance(optimizer, (_DistributedOptimizerMixin, Keras2DistributedOptimizerMixin))


def create_distributed_optimizer(keras, optimizer, name: Optional[str] = None, device_dense: str = "",
                                 device_sparse: str = "", compression=Compression.none,
                                 sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                 op: int = Average, backward_passes_per_step: int = 1,
                                 average_aggregated_gradients: bool = False, groups=None, num_groups: int = 0,
                                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True):
    """Build the distributed version of a Keras optimizer (see ``horovod.tensorflow.keras.DistributedOptimizer``).

    Accepts Keras 3 optimizers and Keras 2 (``tf_keras``) ones, legacy included, and subclasses of any of them.
    The new optimizer is created from ``optimizer.get_config()``; if ``optimizer`` was already built (e.g. it
    came from a loaded model), its state (slots, iteration count) carries over.
    """
    kind = flavour.optimizer_kind(optimizer)
    if kind is None:
        raise ValueError(f"DistributedOptimizer needs a Keras optimizer (keras.optimizers.Optimizer, or with "
                         f"TF_USE_LEGACY_KERAS=1 tf.keras.optimizers.Optimizer / tf.keras.optimizers.legacy."
                         f"Optimizer), got {optimizer!r}.")
    if kind == flavour.KERAS3:
        _check_backend()
    if is_distributed(optimizer):
        raise ValueError("The optimizer is already a DistributedOptimizer; wrap the plain optimizer once.")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}.")
    base = type(optimizer)
    reducer = GradientReducer(name or f"Distributed{base.__name__}", compression, sparse_as_dense, op,
                              gradient_predivide_factor, groups, num_groups, process_set, scale_local_gradients)
    if kind != flavour.KERAS3:
        cls = _distributed_class(base, Keras2DistributedOptimizerMixin)
        if is_built(optimizer):
            new = cls.__new__(cls)
            copy_state(optimizer, new)
        else:
            new = cls.from_config(optimizer.get_config())
        new._hvd_configure(reducer, backward_passes_per_step, average_aggregated_gradients)
        return new
    cls = _distributed_class(base, _DistributedOptimizerMixin)
    new = cls.from_config(optimizer.get_config())
    new._hvd_configure(reducer, backward_passes_per_step, average_aggregated_gradients)
    if getattr(optimizer, "built", False) and getattr(optimizer, "_trainable_variables", None):
        new.build(list(optimizer._trainable_variables))
        for dst, src in zip(new.variables, optimizer.variables):
            dst.assign(src)
    return new
