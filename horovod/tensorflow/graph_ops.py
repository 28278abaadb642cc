"""Graph nodes for Horovod collectives that wait without holding one of TensorFlow's inter-op threads.

Why.  A TF1 session runs the ready nodes of a step on its inter-op thread pool (``inter_op_parallelism_threads``
threads, often 1 or 2).  A collective kernel is Python (a ``tf.numpy_function``) that waits until every rank of
the process set has submitted the same collective; while it waits it holds its thread.  Independent collectives
of one ``session.run`` start in whatever order each rank's executor picks, so with more independent Horovod ops
than pool threads every thread of rank 0 can wait for a collective rank 1 has not started, while rank 1's
threads wait for ones rank 0 has not started: a deadlock.  The original's kernels were asynchronous C++ ops and
never held a thread.

How.  The engine itself does not care about local order: a collective runs once every rank submitted it, by
name, whatever else is pending.  So it is enough that a waiting kernel does not take a pool thread away from
the collectives that have not been submitted yet.  :func:`off_pool_call` therefore runs the kernel inside a
one-element ``tf.data`` pipeline evaluated by ``DatasetToSingleElement``: that op is asynchronous in TF's
executor (it hands its work to a thread pool of its own that grows on demand and returns the inter-op thread at
once), and a map built with ``use_inter_op_parallelism=False`` runs its function on that same thread, not on
the inter-op pool.  Every Horovod op of a step can then wait at the same time, each on its own thread, however
small the session's pool is, and each kernel submits its collective as soon as its inputs are ready.  No
control dependencies are added between Horovod ops, so fetching one op never runs another.

Cost: ~0.1 ms more per op and step than a bare ``numpy_function`` and one idle native thread per Horovod node
of the graph (TF keeps each op's worker thread).  Inside ``tf.function`` none of this is needed: TF's automatic
control dependencies chain stateful ops in program order, so every rank runs the same collectives in the same
order one after the other (see :func:`orders_stateful_ops`).
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import tensorflow as tf

try:   # TF >= 2.12 keeps the map dataset here; Dataset.map does not expose use_inter_op_parallelism
    from tensorflow.python.data.ops.map_op import _MapDataset as _TFMapDataset
except ImportError:   # pragma: no cover - a TensorFlow that moved it
    _TFMapDataset = None


def orders_stateful_ops(graph: tf.Graph) -> bool:
    """True when ``graph`` chains its stateful ops in program order (``tf.function`` bodies, also their
    ``tf.cond`` / ``tf.while_loop`` branches); False for TF1 graphs, including v2 control flow inside them."""
    flag = getattr(graph, "_add_control_dependencies", None)
    if flag is None:   # pragma: no cover - attribute of every FuncGraph in supported TF versions
        return tf.inside_function()
    return bool(flag)


def _single_threaded_map(dataset: tf.data.Dataset, fn: Callable) -> tf.data.Dataset:
    """``dataset.map(fn)`` whose function runs on the calling (dataset) thread, not on the inter-op pool."""
    if _TFMapDataset is None:   # pragma: no cover - checked by the tests on every supported TF
        raise RuntimeError(
            f"Horovod collectives in TF1 graphs need tensorflow.python.data.ops.map_op._MapDataset, which "
            f"TensorFlow {tf.__version__} does not have. Run the collectives eagerly or inside tf.function, or "
            f"use a TensorFlow version from 2.16 to 2.21.")
    return _TFMapDataset(dataset, fn, use_inter_op_parallelism=False)


def _pipeline_options() -> tf.data.Options:
    # The pipeline is rebuilt every step: skip tf.data's graph rewrites and autotuning, which cost time per step
    # and could move the function to another thread.
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.autotune.enabled = False
    return options


def off_pool_call(func: Callable, inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
                  name: str) -> List[tf.Tensor]:
    """One node computing ``func(*numpy inputs)`` on a thread of its own (see the module docstring).

    ``func`` gets numpy arrays and returns one numpy array per entry of ``out_dtypes``.  The node is stateful
    (``DatasetToSingleElement`` is), so TF neither folds nor merges it, and it runs each time it is fetched.
    """
    out_dtypes = list(out_dtypes)
    inputs = list(inputs)
    no_inputs = not inputs
    if no_inputs:
        # A dataset element cannot be empty (queries and join take no input): carry one ignored scalar.
        inputs = [tf.constant(0, tf.int8)]

    def call(*arrays):
        return func() if no_inputs else func(*arrays)

    @tf.autograph.experimental.do_not_convert
    def body(*arrays):
        return tuple(tf.numpy_function(call, list(arrays), out_dtypes, stateful=True, name=name))

    with tf.name_scope(name):
        dataset = tf.data.Dataset.from_tensors(tuple(inputs))
        dataset = _single_threaded_map(dataset, body).with_options(_pipeline_options())
        outputs = dataset.get_single_element()
    return list(outputs)
