"""horovod.tensorflow: distributed training for TensorFlow 2 (eager, ``tf.function``) and TF1-style graphs.

Collectives are TF ops backed by the framework-neutral engine (see :mod:`horovod.tensorflow.bridge`): they run
eagerly, inside ``tf.function`` and in ``tf.compat.v1`` sessions, and are differentiable.  All ranks of a
process set must call each collective in the same order.

Typical TF2 use::

    import horovod.tensorflow as hvd
    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
"""
from __future__ import annotations

from horovod.common.basics import (Adasum, Average, Max, Min, Product, Sum, ccl_built,  # noqa: F401
                                   cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                   init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                                   mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown,
                                   size, start_timeline, stop_timeline)
from horovod.common.basics import dump_flight_recorder  # noqa: F401,E402  (the hang doctor)
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from horovod.common.process_sets import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                                         remove_process_set)
from horovod.common.util import (handle_average_backwards_compatibility, num_rank_is_power_2,  # noqa: F401
                                 split_list)
from horovod.tensorflow.bridge import (HorovodFailedPreconditionError,  # noqa: F401
                                       HorovodInvalidArgumentError, HorovodNotInitializedError)
from horovod.tensorflow.compression import Compression  # noqa: F401
from horovod.tensorflow.functions import (allgather_object, broadcast_object, broadcast_object_fn,  # noqa: F401
                                          broadcast_variables)
from horovod.tensorflow.gradient_aggregation import LocalGradientAggregationHelper  # noqa: F401
from horovod.tensorflow.gradient_tape import (DistributedGradientTape,  # noqa: F401
                                              PartialDistributedGradientTape)
from horovod.tensorflow.mpi_ops import (allgather, alltoall, broadcast, broadcast_, grouped_allgather,  # noqa: F401
                                        join, local_rank_op, local_size_op, process_set_included_op, rank_op,
                                        size_op)
from horovod.tensorflow.optimizer import (BroadcastGlobalVariablesHook, DistributedOptimizer,  # noqa: F401
                                          broadcast_global_variables)
from horovod.tensorflow.reduction import (allreduce, grouped_allreduce, grouped_reducescatter,  # noqa: F401
                                          reducescatter)
from horovod.tensorflow.util import (_cache, _executing_eagerly, _make_subgraph, gpu_available,  # noqa: F401
                                     refs_to_vars, vars_to_refs)

# The public API, listed for `import *`, IDEs and mypy (tests/test_public_names.py holds it to the record).
__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression", "DistributedGradientTape",
    "DistributedOptimizer", "HorovodFailedPreconditionError", "HorovodInternalError", "HorovodInvalidArgumentError",
    "HorovodNotInitializedError", "HostsUpdatedInterrupt", "LocalGradientAggregationHelper", "Max", "Min",
    "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum", "add_process_set", "allgather",
    "allgather_object", "allreduce", "alltoall", "broadcast", "broadcast_", "broadcast_global_variables",
    "broadcast_object", "broadcast_object_fn", "broadcast_variables", "ccl_built", "check_num_rank_power_of_2",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "gpu_available", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter",
    "handle_average_backwards_compatibility", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "num_rank_is_power_2", "process_set_included_op", "rank", "rank_op", "reducescatter", "refs_to_vars",
    "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "split_list", "start_timeline",
    "stop_timeline", "vars_to_refs", "dump_flight_recorder"
]


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """True when ``num_rank`` is a power of two (Adasum needs it)."""
    return num_rank_is_power_2(num_rank)


def __getattr__(name: str):
    # Keras (and the elastic states) load on first use: importing horovod.tensorflow stays light.
    if name == "SyncBatchNormalization":
        # The layer of the Keras tf.keras is (Keras 3, or tf_keras with TF_USE_LEGACY_KERAS=1).
        from horovod.tensorflow.sync_batch_norm import active_class

        return active_class()
    if name in ("keras", "elastic"):
        import importlib

        return importlib.import_module(f"horovod.tensorflow.{name}")
    raise AttributeError(f"module 'horovod.tensorflow' has no attribute {name!r}")
