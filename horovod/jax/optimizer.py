"""``DistributedOptimizer``: an optax ``GradientTransformation`` that averages gradients across ranks first.

.. code-block:: python

    tx = hvd.DistributedOptimizer(optax.sgd(0.1 * hvd.size()))
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)   # eagerly or inside jax.jit

``update`` reduces the gradient pytree in one call (leaves packed into buckets, see :mod:`horovod.jax.host`), then
hands the result to the inner transformation.  With ``backward_passes_per_step = k`` the gradients of ``k``
consecutive ``update`` calls are summed locally and reduced on the k-th; the calls in between return zero
updates (optax's convention for skipped steps, as in ``optax.MultiSteps``), so ``optax.apply_updates`` may be
called every time.  The pass counter lives in the optimizer state, so the choice is made by a ``jax.lax.cond``
when ``update`` is jitted; every rank takes the same branch because every rank counts the same passes.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from horovod.common.basics import Adasum, Average
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.jax.adapter import is_traced
from horovod.jax.compression import Compression
from horovod.jax.tree import allreduce_tree


class DistributedState(NamedTuple):
    """State of :func:`DistributedOptimizer`: the inner transformation's state, the gradients summed since the
    last reduction (``()`` when ``backward_passes_per_step == 1``) and how many passes they hold."""

    inner: Any
    accumulated: Any
    passes: jax.Array


def DistributedOptimizer(optimizer: optax.GradientTransformation, compression=Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         process_set: ProcessSet = global_process_set,
                         name: Optional[str] = None) -> optax.GradientTransformation:
    """Wrap ``optimizer`` so that its ``update`` sees gradients reduced across the ranks of ``process_set``.

    Args:
        optimizer: the optax transformation to apply to the reduced gradients.
        compression: how floating-point gradients travel (``Compression.fp16`` / ``bf16`` halve the bytes).
        backward_passes_per_step: gradients of this many ``update`` calls are summed locally before one reduction.
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        gradient_predivide_factor: with ``Average``, divide by this before the sum and multiply after (the sum is
            then divided by the set size as usual): keeps large sums of many ranks in range.
        average_aggregated_gradients: divide the summed gradients of ``backward_passes_per_step`` passes by their
            number (default: their sum, like ``horovod.torch``).
        process_set: the ranks to average over.
        name: the reduction's name (default: matched by issue order).

    Raises:
        ValueError: ``backward_passes_per_step`` < 1, or a predivide factor with an op other than ``Average``.
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"horovod.jax.DistributedOptimizer wraps an optax.GradientTransformation (optax.sgd(...), "
                        f"optax.adam(...)), got {type(optimizer).__name__}")
    if int(backward_passes_per_step) != backward_passes_per_step or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError(f"gradient_predivide_factor is only supported with op=Average (got op={op}, "
                         f"gradient_predivide_factor={gradient_predivide_factor})")
    if op == Adasum and compression is not Compression.none:
        raise ValueError("Adasum combines the gradients' own values; use it without compression")
    passes_per_step = int(backward_passes_per_step)
    prescale = 1.0 / gradient_predivide_factor
    postscale = float(gradient_predivide_factor)

    def reduce(grads):
        if passes_per_step > 1 and average_aggregated_gradients:
            grads = jax.tree_util.tree_map(lambda g: g / passes_per_step, grads)
        return allreduce_tree(grads, op=op, name=name, prescale_factor=prescale, postscale_factor=postscale,
                              process_set=process_set, compression=compression)

    def init_fn(params):
        accumulated = () if passes_per_step == 1 else jax.tree_util.tree_map(jnp.zeros_like, params)
        return DistributedState(optimizer.init(params), accumulated, jnp.zeros([], jnp.int32))

    def update_fn(grads, state: DistributedState, params=None):
        if passes_per_step == 1:
            updates, inner = optimizer.update(reduce(grads), state.inner, params)
            return updates, DistributedState(inner, (), state.passes)
        accumulated = jax.tree_util.tree_map(jnp.add, state.accumulated, grads)
        passes = state.passes + 1

        def apply(args):
            summed, inner = args
            updates, inner = optimizer.update(reduce(summed), inner, params)
            return updates, DistributedState(inner, jax.tree_util.tree_map(jnp.zeros_like, summed),
                                             jnp.zeros([], jnp.int32))

        def wait(args):
            summed, inner = args
            return (jax.tree_util.tree_map(jnp.zeros_like, grads), DistributedState(inner, summed, passes))

        if is_traced(passes):
            return jax.lax.cond(passes >= passes_per_step, apply, wait, (accumulated, state.inner))
        return apply((accumulated, state.inner)) if int(passes) >= passes_per_step else \
            wait((accumulated, state.inner))

    return optax.GradientTransformation(init_fn, update_fn)
