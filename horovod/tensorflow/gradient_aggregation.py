"""Local gradient aggregation: ``backward_passes_per_step`` > 1.

Gradients are summed into per-variable accumulators on every step; every ``backward_passes_per_step``-th step
the sums (averaged over the passes if ``average_aggregated_gradients``) are reduced across ranks, applied, and
the accumulators and the pass counter reset.  On the other steps nothing is communicated and the optimizer's
iteration counter (or the TF1 ``global_step``) still advances, as in the original.

Works eagerly, inside ``tf.function`` and in TF1 graphs: the decision is a ``tf.cond`` on a step counter
variable, and every side effect a branch needs is tied to the branch's output, so TF1 graphs (no automatic
control dependencies) run them too.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from horovod.common.elastic import register_distributed
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.mpi_ops import _op_of


def _dense(grad):
    return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad


def _deps(values) -> List:
    return [o for o in (_op_of(v) for v in values if v is not None) if o is not None]


class LocalGradientAggregationHelper:
    """Accumulate gradients locally and reduce them every ``backward_passes_per_step`` steps.

    Args:
        backward_passes_per_step: number of steps whose gradients are summed before one reduction.
        allreduce_func: ``fn(grads, variables) -> grads`` reducing across ranks.
        sparse_as_dense: accepted for compatibility (accumulation always densifies).
        average_aggregated_gradients: divide the accumulated sums by ``backward_passes_per_step``.
        rank, optimizer_type, process_set, scale_local_gradients, name: accepted for compatibility; ``name``
            prefixes the variables this helper creates.

    Use :meth:`compute_gradients` then :meth:`apply_gradients` once per step.  Variables are created on first
    use (or supplied with :meth:`set_variables`, which Keras optimizers do so they are tracked and saved).
    """

    def __init__(self, backward_passes_per_step: int, allreduce_func: Callable, sparse_as_dense: bool = False,
                 average_aggregated_gradients: bool = False, rank: int = 0, optimizer_type: Optional[str] = None,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
                 name: str = ""):
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step <= 0:
            raise ValueError(f"backward_passes_per_step must be a positive int, got {backward_passes_per_step!r}.")
        self.backward_passes_per_step = backward_passes_per_step
        self.allreduce_func = allreduce_func
        self.average_aggregated_gradients = average_aggregated_gradients
        self.name = name
        self.counter: Any = None   # the int64 tf.Variable counting passes (made with the accumulators)
        self.accumulators: Optional[List] = None
        self._apply_flag = None
        register_distributed(self)

    def _hvd_reset(self) -> None:
        """Elastic reset: no pass counted, nothing accumulated, as after construction.

        Every rank resets, so the ranks count passes alike again (a newcomer starts from zero); a Keras optimizer
        whose counter and accumulators are its own variables gets the committed ones back with the state.
        """
        self._apply_flag = None
        if self.counter is None or not tf.executing_eagerly():
            return   # not built yet; or a TF1 graph, where the session's variables are the user's state
        self.counter.assign(tf.zeros_like(self.counter))
        for acc in self.accumulators or []:
            acc.assign(tf.zeros_like(acc))

    def set_variables(self, counter, accumulators: Sequence) -> None:
        """Use these variables: an int64 scalar counter and one zero-initialised accumulator per variable."""
        self.counter = counter
        self.accumulators = list(accumulators)

    def _make_variables(self, variables: Sequence) -> List:
        prefix = f"{self.name}_" if self.name else ""
        # init_scope lifts creation out of tf.function / tf.cond, so the variables exist once, outside the step.
        with tf.init_scope():
            counter = tf.Variable(tf.constant(0, tf.int64), trainable=False, name=f"{prefix}aggregation_counter")
            accumulators = [tf.Variable(tf.zeros(v.shape, dtype=v.dtype), trainable=False,
                                        name=f"{prefix}aggregated_gradient_{i}")
                            for i, v in enumerate(variables)]
        self.set_variables(counter, accumulators)
        return accumulators

    @not_converted
    def compute_gradients(self, grads: Sequence, variables: Sequence) -> List:
        """Accumulate ``grads``; returns the reduced accumulated gradients (meaningful on the reducing step)."""
        grads = [_dense(g) for g in grads]
        accumulators = self.accumulators
        if accumulators is None:
            accumulators = self._make_variables(variables)
        live = [i for i, g in enumerate(grads) if g is not None]
        updates = [accumulators[i].assign_add(tf.cast(grads[i], accumulators[i].dtype)) for i in live]
        with tf.control_dependencies(_deps(updates)):
            new_count = self.counter.assign_add(1)
            with tf.control_dependencies(_deps([new_count])):
                count = tf.convert_to_tensor(self.counter)
        flag = tf.equal(count % self.backward_passes_per_step, 0)
        self._apply_flag = flag
        if not live:
            return list(grads)
        passes = self.backward_passes_per_step

        def reduce_branch():
            values = [tf.convert_to_tensor(self.accumulators[i]) for i in live]
            if self.average_aggregated_gradients and passes > 1:
                values = [v / tf.cast(passes, v.dtype) for v in values]
            return list(self.allreduce_func(values, [variables[i] for i in live]))

        def local_branch():
            return [tf.identity(self.accumulators[i]) for i in live]

        chosen = tf.cond(flag, reduce_branch, local_branch)
        out = [None] * len(grads)
        for i, value in zip(live, chosen if isinstance(chosen, (list, tuple)) else [chosen]):
            out[i] = value
        return out

    @not_converted
    def apply_gradients(self, apply_fn: Callable[[], object], skip_fn: Optional[Callable[[], object]] = None):
        """On the reducing step run ``apply_fn`` and reset the accumulators; otherwise run ``skip_fn``.

        Returns:
            A boolean tensor (True when gradients were applied) carrying the step's side effects.
        """
        if self._apply_flag is None:
            raise RuntimeError("compute_gradients() must be called before apply_gradients().")
        flag = self._apply_flag

        def apply_branch():
            applied = apply_fn()
            with tf.control_dependencies(_deps([applied])):
                # The counter restarts too, so it always reads the passes accumulated so far (as the original's).
                resets = [acc.assign(tf.zeros_like(acc)) for acc in self.accumulators]
                resets.append(self.counter.assign(tf.zeros_like(self.counter)))
                with tf.control_dependencies(_deps(resets)):
                    return tf.constant(True)

        def skip_branch():
            skipped = skip_fn() if skip_fn is not None else None
            with tf.control_dependencies(_deps([skipped])):
                return tf.constant(False)

        return tf.cond(flag, apply_branch, skip_branch)
