"""horovod.jax: data-parallel JAX on the same engine as ``horovod.torch`` and ``horovod.tensorflow``.

.. code-block:: python

    import horovod.jax as hvd

    hvd.init()
    params = hvd.broadcast_parameters(params, root_rank=0)       # returns the broadcast pytree
    tx = hvd.DistributedOptimizer(optax.sgd(0.1 * hvd.size()))    # averages gradients across ranks
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)  # the allreduce runs as a host callback
        return optax.apply_updates(params, updates), opt_state

The collectives take ``jax.Array`` values (CPU; other devices are staged through host memory) with the names of
the other bindings; inside ``jax.jit`` the blocking ones run as ordered host callbacks.  JAX arrays are
immutable, so results are always new arrays (no ``allreduce_`` / ``broadcast_``).  See docs/jax.md for what works
under ``jit``, ``vmap``, ``grad`` and ``pmap``.

Needs ``jax`` (a CPU ``jaxlib`` is enough) and ``optax``: ``pip install "horovod-next[jax]"``.
"""
from __future__ import annotations

try:
    import jax as _jax

    _jax.Array  # noqa: B018  (tests/jax on sys.path would make an empty namespace package named jax)
    import optax as _optax  # noqa: F401
except Exception as _exc:   # ImportError, or a namespace package without the real modules
    raise ImportError(f"horovod.jax needs jax and optax (pip install 'horovod-next[jax]'); importing them failed: "
                      f"{type(_exc).__name__}: {_exc}") from _exc

from horovod.common.basics import (Adasum, Average, Max, Min, Product, Sum, ccl_built, cross_rank,  # noqa: F401
                                   cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous,
                                   is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                   mpi_threads_supported, nccl_built, rank, rocm_built, size, start_timeline,
                                   stop_timeline)
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from horovod.common.process_sets import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                                         remove_process_set)
from horovod.jax import elastic  # noqa: F401
from horovod.jax.compression import Compression  # noqa: F401
from horovod.jax.functions import allgather_object, broadcast_object  # noqa: F401
from horovod.jax.mpi_ops import INPLACE as _INPLACE
from horovod.jax.mpi_ops import (allgather, allgather_async, allreduce, allreduce_async,  # noqa: F401
                                 alltoall, alltoall_async, barrier, broadcast, broadcast_async, grouped_allgather,
                                 grouped_allgather_async, grouped_allreduce, grouped_allreduce_async,
                                 grouped_reducescatter, grouped_reducescatter_async, init, join, poll,
                                 reducescatter, reducescatter_async, shutdown, synchronize)
from horovod.jax.optimizer import DistributedOptimizer, DistributedState  # noqa: F401
from horovod.jax.tree import broadcast_optimizer_state, broadcast_parameters  # noqa: F401

# The public API, listed for `import *`, IDEs and mypy (tests/test_public_names.py holds it to the record).
from horovod.common.basics import dump_flight_recorder  # noqa: E402  (the hang doctor)

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "DistributedState", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "ProcessSet", "Product", "Sum", "add_process_set", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_async", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_async", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline", "synchronize", "dump_flight_recorder"
]


def __getattr__(name: str):
    if name in _INPLACE:
        instead = name.rstrip("_")
        raise AttributeError(f"horovod.jax has no {name}: JAX arrays are immutable, so there are no in-place "
                             f"collectives; call hvd.{instead}(...) instead and keep what it returns.")
    raise AttributeError(f"module 'horovod.jax' has no attribute {name!r}")
