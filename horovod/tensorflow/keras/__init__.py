"""horovod.tensorflow.keras: distributed ``tf.keras`` — Keras 3 on the TensorFlow backend, or Keras 2 (``tf_keras``)
when the process runs with ``TF_USE_LEGACY_KERAS=1``.

A thin layer over :mod:`horovod._keras` (shared with :mod:`horovod.keras`)::

    import horovod.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])
"""
from __future__ import annotations

from typing import Optional

from horovod import _keras as _impl
from horovod._keras.flavour import keras as _active_keras
from horovod.common.basics import dump_flight_recorder  # noqa: F401,E402  (the hang doctor)
from horovod.common.basics import (Adasum, Average, Max, Min, Product, Sum, ccl_built,  # noqa: F401
                                   cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                   init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                                   mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown,
                                   size, start_timeline, stop_timeline)
from horovod.common.process_sets import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                                         remove_process_set)
from horovod.tensorflow import broadcast_variables  # noqa: F401
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.keras import callbacks, elastic  # noqa: F401

# The public API, listed for `import *`, IDEs and mypy (tests/test_public_names.py holds it to the record).
__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min", "PartialDistributedOptimizer",
    "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allreduce", "broadcast",
    "broadcast_global_variables", "broadcast_variables", "callbacks", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "init",
    "is_homogeneous", "is_initialized", "load_model", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "remove_process_set", "rocm_built", "shutdown",
    "size", "start_timeline", "stop_timeline", "dump_flight_recorder"
]


def DistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "", device_sparse: str = "",
                         compression=Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: int = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups=None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True):
    """Wrap a Keras optimizer so that gradients are averaged (by default) across ranks before being applied.

    Works with ``model.compile``/``model.fit`` and with ``optimizer.apply_gradients`` in custom loops, eagerly
    or inside ``tf.function``.  ``device_*`` are accepted for compatibility.

    Args:
        optimizer: a Keras 3 ``keras.optimizers.Optimizer`` (also ``LossScaleOptimizer``), or with ``tf_keras`` a
            ``tf.keras.optimizers.Optimizer`` or ``tf.keras.optimizers.legacy.Optimizer``; subclasses too.
        name: name scope of the reduction ops.
        compression: e.g. ``hvd.Compression.fp16``.
        sparse_as_dense: densify ``IndexedSlices`` gradients (embeddings) before reducing.
        gradient_predivide_factor: with Average, scale by ``1/f`` before the sum and ``f`` after.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
        backward_passes_per_step: accumulate this many steps locally, then reduce and apply once.
        average_aggregated_gradients: average (instead of sum) the accumulated passes.
        num_groups / groups: grouping of the gradient reductions.
        process_set: ranks to reduce over.
        scale_local_gradients: divide gradients of ``register_local_var`` variables by the set size.

    Returns:
        An optimizer of a dynamically created subclass of ``type(optimizer)``.
    """
    return _impl.create_distributed_optimizer(
        None, optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups, num_groups=num_groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)


def PartialDistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression=Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: int = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups=None,
                                process_set: ProcessSet = global_process_set, local_layers=None,
                                scale_local_gradients: bool = True):
    """A :func:`DistributedOptimizer` that keeps the gradients of ``local_layers`` on this rank."""
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, backward_passes_per_step,
                               average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    if local_layers is not None:
        layers = local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
        for layer in layers:
            for var in layer.trainable_weights:
                opt.register_local_var(var)
    return opt


def broadcast_global_variables(root_rank: int):
    """TF1 graphs only; with Keras 3 use ``callbacks.BroadcastGlobalVariablesCallback`` (raises eagerly)."""
    return _impl.broadcast_global_variables(_active_keras().backend, root_rank)


def allreduce(value, name: Optional[str] = None, average=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op=None, compression=Compression.none):
    """Reduce a value (array, number or tensor) across ranks (default: average); returns a tensor."""
    return _impl.allreduce(_active_keras().backend, value, name, average, prescale_factor, postscale_factor, op,
                           compression)


def allgather(value, name: Optional[str] = None):
    """Concatenate a value from every rank along dimension 0; returns a tensor."""
    return _impl.allgather(_active_keras().backend, value, name)


def broadcast(value, root_rank: int, name: Optional[str] = None):
    """Return ``root_rank``'s value on every rank (a tensor)."""
    return _impl.broadcast(_active_keras().backend, value, root_rank, name)


def reducescatter(value, name: Optional[str] = None, op: int = Average):
    """Reduce a value across ranks and return this rank's block of rows (a tensor)."""
    return _impl.reducescatter(_active_keras().backend, value, name, op)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts: bool = False):
    """Load a model saved by Keras and wrap its optimizer in :func:`DistributedOptimizer` (state kept)."""

    def wrap_optimizer(optimizer):
        return DistributedOptimizer(optimizer, compression=compression)

    return _impl.load_model(_active_keras(), wrap_optimizer, filepath, custom_optimizers, custom_objects,
                            legacy_opts)
