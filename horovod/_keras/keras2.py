"""The distributed optimizer for Keras 2 (``tf_keras``): both ``tf.keras.optimizers.Optimizer`` and the legacy
``tf.keras.optimizers.legacy.Optimizer`` (OptimizerV2), and subclasses of either.

As in the original, the gradients are reduced where Keras computes them — ``_compute_gradients`` (legacy
``minimize`` and ``model.fit``), ``compute_gradients`` (the new optimizers' ``minimize``) and ``get_gradients``
(TF1 graphs) — so what those return is already averaged.  ``apply_gradients`` reduces only gradients that did not
come from there (a custom loop with a plain ``tf.GradientTape``): the tensors the compute methods returned are
remembered until the next ``apply_gradients``, so nothing is reduced twice.  With ``backward_passes_per_step`` > 1
the gradients are accumulated and reduced every n-th step, and only then applied; on the other steps only the
iteration counter advances.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from horovod.common.elastic import register_distributed
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from horovod.tensorflow.gradient_reducer import GradientReducer


class _Keras2State:
    """What the distributed optimizer adds (a plain object: Keras would track lists and dicts)."""

    def __init__(self, reducer: GradientReducer, aggregation: Optional[LocalGradientAggregationHelper]) -> None:
        self.reducer = reducer
        self.aggregation = aggregation
        # id -> tensor of the gradients the compute methods returned reduced (kept alive so ids stay unique)
        self.reduced: Dict[int, object] = {}


# The mixins are only used in front of a Keras optimizer class, which supplies the rest (from_config, build,
# get_config...). Keras is untyped, so that class is Any to mypy; at run time the mixins derive from object.
KerasOptimizerBase: Any = object


class Keras2DistributedOptimizerMixin(KerasOptimizerBase):
    """Placed in front of a ``tf_keras`` optimizer's class by ``create_distributed_optimizer``."""

    def _hvd_configure(self, reducer: GradientReducer, backward_passes_per_step: int,
                       average_aggregated_gradients: bool) -> None:
        aggregation = None
        if backward_passes_per_step > 1:
            # Its counter and accumulators are created on first use, outside any tf.function (init_scope).
            aggregation = LocalGradientAggregationHelper(
                backward_passes_per_step, reducer, average_aggregated_gradients=average_aggregated_gradients,
                optimizer_type="keras", name="hvd")
        self._hvd = _Keras2State(reducer, aggregation)
        register_distributed(self)

    def _hvd_reset(self) -> None:
        """Elastic reset: forget the gradients the compute methods reduced in a step that never reached
        ``apply_gradients`` (the aggregation helper resets itself)."""
        state = self.__dict__.get("_hvd")
        if state is not None:
            state.reduced.clear()

    def _hvd_state(self) -> _Keras2State:
        state = self.__dict__.get("_hvd")
        if state is None:
            # Made by ``from_config`` on the distributed class: reduce with the defaults (average, all ranks).
            self._hvd_configure(GradientReducer(f"Distributed{type(self).__name__}"), 1, False)
            state = self._hvd
        return state

    @property
    def _agg_helper(self) -> Optional[LocalGradientAggregationHelper]:
        """The local gradient aggregation (``backward_passes_per_step`` > 1), under the original's name."""
        return self._hvd_state().aggregation

    def _hvd_reduce(self, grads: Sequence, variables: Sequence) -> List:
        state = self._hvd_state()
        if state.aggregation is not None:
            reduced = state.aggregation.compute_gradients(list(grads), list(variables))
        else:
            reduced = state.reducer(list(grads), list(variables))
        state.reduced.update((id(g), g) for g in reduced if g is not None)
        return list(reduced)

    @not_converted
    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """The wrapped optimizer's ``_compute_gradients``, reduced across ranks (legacy ``minimize``/``fit``).

        The new ``tf_keras`` optimizers have no ``_compute_gradients``: there it falls back to their
        ``compute_gradients`` (``grad_loss`` unused), as the original did, so scripts calling it keep working.
        """
        parent = super()
        if hasattr(parent, "_compute_gradients"):
            pairs = list(parent._compute_gradients(loss, var_list, grad_loss, tape=tape))
        else:
            pairs = list(parent.compute_gradients(loss, var_list, tape=tape))
        variables = [v for _, v in pairs]
        return list(zip(self._hvd_reduce([g for g, _ in pairs], variables), variables))

    @not_converted
    def compute_gradients(self, loss, var_list, *args, **kwargs):
        """The wrapped optimizer's ``compute_gradients``, reduced across ranks (the new optimizers' ``minimize``)."""
        pairs = list(super().compute_gradients(loss, var_list, *args, **kwargs))
        variables = [v for _, v in pairs]
        return list(zip(self._hvd_reduce([g for g, _ in pairs], variables), variables))

    @not_converted
    def get_gradients(self, loss, params):
        """The wrapped optimizer's ``get_gradients`` (TF1 graphs), reduced across ranks."""
        return self._hvd_reduce(super().get_gradients(loss, params), params)

    @not_converted
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """Apply the gradients with the wrapped optimizer's ``apply_gradients``, reducing them first unless they
        came reduced from this optimizer's compute methods."""
        pairs = list(grads_and_vars)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        state = self._hvd_state()
        already = bool(grads) and all(g is None or state.reduced.get(id(g)) is g for g in grads)
        state.reduced.clear()
        if not already:
            grads = self._hvd_reduce(grads, variables)
            state.reduced.clear()
        parent_apply = super().apply_gradients
        if state.aggregation is None:
            return parent_apply(list(zip(grads, variables)), *args, **kwargs)

        def apply_fn():
            return parent_apply(list(zip(grads, variables)), *args, **kwargs)

        def skip_fn():
            return self.iterations.assign_add(1)

        return state.aggregation.apply_gradients(apply_fn, skip_fn)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (not reduced; scaled by ``scale_local_gradients``)."""
        self._hvd_state().reducer.register_local(var)


def copy_state(optimizer, new) -> None:
    """Give ``new`` (a fresh optimizer of a subclass of ``type(optimizer)``) the state ``optimizer`` built.

    Keras 2 optimizers do not keep the list of variables they were built for, so the built state (slots,
    iteration count) is shared rather than copied: the wrapped optimizer is usually dropped by its owner.
    """
    shared = dict(optimizer.__dict__)
    shared.pop("_hvd", None)
    new.__dict__.update(shared)


def is_built(optimizer) -> bool:
    """True when a ``tf_keras`` optimizer already holds state beyond its hyperparameters."""
    if hasattr(optimizer, "_index_dict"):          # tf_keras.optimizers.Optimizer: set by build()
        return bool(getattr(optimizer, "_index_dict", None))
    return bool(getattr(optimizer, "_slots", None)) or bool(getattr(optimizer, "_weights", None))
