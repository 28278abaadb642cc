"""horovod.mxnet: distributed training for MXNet 1.x, drop-in for Horovod 0.28.1 scripts.

``import horovod.mxnet as hvd``; ``hvd.init()``; pin the context by ``hvd.local_rank()``; scale the learning rate
by ``hvd.size()``; then either wrap the optimizer in :class:`DistributedOptimizer` and train with the Module API
and ``kvstore=None``, or train Gluon blocks with :class:`DistributedTrainer`; call :func:`broadcast_parameters`
so every rank starts from rank 0's weights.  The collectives take NDArrays; everything underneath is the
framework-neutral engine in :mod:`horovod.engine`.

Needs ``mxnet`` (1.9.1, the last release, with ``numpy<1.24``): ``pip install "horovod-next[mxnet]"`` in an
environment of its own.
"""
from __future__ import annotations

try:
    import mxnet as _mx

    _mx.nd.NDArray  # noqa: B018  (an unrelated namespace package named mxnet has no nd)
except Exception as _exc:   # ImportError, or numpy>=1.24 breaking mxnet's import (AttributeError)
    raise ImportError(f"horovod.mxnet needs MXNet 1.9.1 with numpy<1.24 (pip install 'horovod-next[mxnet]' in an "
                      f"environment of its own); importing mxnet failed: {type(_exc).__name__}: {_exc}") from _exc

from horovod.common.exceptions import HorovodInternalError  # noqa: F401
from horovod.common.basics import dump_flight_recorder  # noqa: F401,E402  (the hang doctor)
from horovod.mxnet.compression import Compression  # noqa: F401
from horovod.mxnet.functions import allgather_object, broadcast_object, broadcast_parameters  # noqa: F401
from horovod.mxnet.mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,  # noqa: F401
                                   add_process_set, allgather, allreduce, allreduce_, alltoall, broadcast,
                                   broadcast_, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                                   gloo_enabled, global_process_set, grouped_allgather, grouped_allreduce,
                                   grouped_allreduce_, grouped_reducescatter, init, is_initialized, local_rank,
                                   local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                                   reducescatter, remove_process_set, rocm_built, shutdown, size, start_timeline,
                                   stop_timeline)
from horovod.mxnet.optimizer import DistributedOptimizer, DistributedTrainer  # noqa: F401
