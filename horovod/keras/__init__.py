"""horovod.keras: distributed training with Keras on the TensorFlow backend.

The original bound the standalone ``keras`` package here.  This one follows the Keras the process uses — Keras
3, or Keras 2 (``tf_keras``) with ``TF_USE_LEGACY_KERAS=1`` — so it is the same implementation as
:mod:`horovod.tensorflow.keras` (both are thin layers over :mod:`horovod._keras`); only the defaults of the
original ``horovod.keras`` differ (``allreduce`` averages unless told otherwise).
"""
from __future__ import annotations

from typing import Optional

from horovod import _keras as _impl
from horovod._keras.flavour import keras as _active_keras
from horovod.common.basics import dump_flight_recorder  # noqa: F401,E402  (the hang doctor)
from horovod.keras import callbacks, elastic  # noqa: F401
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.keras import (Adasum, Average, Max, Min, Product, Sum, DistributedOptimizer,  # noqa: F401
                                      PartialDistributedOptimizer, ProcessSet, add_process_set,
                                      allgather, broadcast, broadcast_global_variables, broadcast_variables,
                                      ccl_built, cross_rank, cross_size, cuda_built, ddl_built, global_process_set,
                                      gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, load_model,
                                      local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                                      nccl_built, rank, reducescatter, remove_process_set, rocm_built, shutdown,
                                      size, start_timeline, stop_timeline)

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


def allreduce(value, name: Optional[str] = None, average=True, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op=None, compression=Compression.none):
    """Reduce a value across ranks; averages by default (``average=True``).  Returns a tensor.

    Passing ``op`` selects the reduction (the default ``average=True`` then does not conflict with it).
    """
    if op is not None and average is True:
        average = None
    return _impl.allreduce(_active_keras().backend, value, name, average, prescale_factor, postscale_factor, op,
                           compression)
