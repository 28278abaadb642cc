"""Collectives on torch tensors as engine calls: the asynchronous operations, their handles, in-place forms.

Every function here converts tensors to numpy views (:mod:`horovod.torch.staging`) and calls the
framework-neutral engine API through the glue every binding shares (:mod:`horovod.common.binding_ops`).
``*_async*`` functions return an integer handle for :func:`poll` / :func:`synchronize`; names ending in ``_``
work in place, writing into the tensor's own memory.
The differentiable blocking forms (``allreduce``, ``allgather``, ...) build on these in
:mod:`horovod.torch.autograd_ops`; :mod:`horovod.torch.mpi_ops` (the original's module) offers both.

All ranks of the process set must call each collective, in the same order for unnamed tensors (unnamed
operations are matched by issue order); named operations must agree on dtype, shape, op and scale factors.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from horovod.common.basics import (Adasum, Average, Max, Min, Product, Sum, ccl_built, cross_rank,  # noqa: F401
                                   cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous,
                                   is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                   mpi_threads_supported, nccl_built, rank, rocm_built, size, start_timeline,
                                   stop_timeline)
from horovod.common import framework_rules
from horovod.common.binding_ops import HandleCollectives
from horovod.common.exceptions import HorovodInternalError  # noqa: F401  (re-exported)
from horovod.common.process_sets import (ProcessSet, add_process_set,  # noqa: F401
                                         global_process_set, remove_process_set)
from horovod.common.util import handle_average_backwards_compatibility  # noqa: F401  (re-exported)
from horovod.torch.staging import TorchAdapter

# The collectives are shared with horovod.numpy (horovod/common/binding_ops.py); this binding's part is how its
# tensors become engine arrays (TorchAdapter).  Its public functions are the shared object's bound methods.
_collectives = HandleCollectives(TorchAdapter(), __name__)

# Its public functions are the shared object's bound methods (MODULE_FUNCTIONS; tests/test_public_names.py checks
# that this list is complete), spelled out so that IDEs, mypy and readers see them.
init = _collectives.init
shutdown = _collectives.shutdown
poll = _collectives.poll
synchronize = _collectives.synchronize
allreduce_async = _collectives.allreduce_async
allreduce_async_ = _collectives.allreduce_async_
allreduce_ = _collectives.allreduce_
grouped_allreduce_async = _collectives.grouped_allreduce_async
grouped_allreduce_async_ = _collectives.grouped_allreduce_async_
grouped_allreduce_ = _collectives.grouped_allreduce_
allgather_async = _collectives.allgather_async
grouped_allgather_async = _collectives.grouped_allgather_async
broadcast_async = _collectives.broadcast_async
broadcast_async_ = _collectives.broadcast_async_
broadcast_ = _collectives.broadcast_
alltoall_async = _collectives.alltoall_async
reducescatter_async = _collectives.reducescatter_async
grouped_reducescatter_async = _collectives.grouped_reducescatter_async
join = _collectives.join
barrier = _collectives.barrier


def _check_has_gpu() -> bool:
    """Whether collectives can run on GPU memory directly: CUDA is usable and NCCL loads."""
    return torch.cuda.is_available() and nccl_built() > 0


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor by allgathering its indices and values.

    Returns:
        A callable (not an int handle) that waits and returns the reduced sparse tensor (uncoalesced: entries
        from different ranks at the same index add up when it is coalesced).  ``Average`` divides the values
        by the size of the process set.
    """
    indices = tensor._indices().t().contiguous()   # allgather concatenates dim 0: one row per non-zero
    values = tensor._values().contiguous()
    base = None if name is None else str(name)
    h_values = _collectives.allgather_async(values, None if base is None else f"{base}.values", process_set)
    h_indices = _collectives.allgather_async(indices, None if base is None else f"{base}.indices", process_set)
    set_size = len(process_set.ranks) if process_set.ranks else size()

    def result() -> torch.Tensor:
        all_values = _collectives.synchronize(h_values)
        all_indices = _collectives.synchronize(h_indices)
        divisor = framework_rules.sparse_average_divisor(op, set_size)
        if divisor is not None:
            all_values = all_values / divisor
        return torch.sparse_coo_tensor(all_indices.t(), all_values, tensor.size(), dtype=all_values.dtype,
                                       device=tensor.device)

    return result
