"""Differentiable collectives: ``torch.autograd.Function`` wrappers and the blocking functions built on them.

Gradients follow Horovod 0.28.1, so that a script's training dynamics do not change when it moves here:

* allreduce: the gradient is the allreduce of the output gradients with the same op and scale factors;
* allgather: the output gradients are allreduce-**averaged**, then each rank takes the rows of its own input;
* broadcast: the output gradients are allreduce-averaged; ranks other than the root get zeros;
* alltoall: the output gradients travel back with an alltoall using the splits this rank received;
* reducescatter: the output gradients are allgathered and multiplied by the set size for Sum (by 1 for Average),
  and by the forward's scale factors; the original's gradient, kept although the true adjoint of a Sum would be
  the allgather alone.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from horovod.common import framework_rules
from horovod.common.basics import Average, rank
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.torch import engine_ops as _ops
from horovod.torch.compression import Compression

# The shared path of every collective (horovod/common/binding_ops.py): the blocking forms below start their
# operation and return its result directly, without an integer handle.
_shared = _ops._collectives


def _set_size(process_set: ProcessSet) -> int:
    return len(process_set.ranks)


def _set_rank(process_set: ProcessSet) -> int:
    return process_set.ranks.index(rank())


def _first_dims(dims: Sequence[int], process_set: ProcessSet) -> torch.Tensor:
    """Every member's first dimensions (one row per member), for slicing allgather gradients."""
    mine = torch.tensor([list(dims)], dtype=torch.int64)
    return _ops.synchronize(_ops.allgather_async(mine, process_set=process_set))


# -- allreduce -------------------------------------------------------------------------------------------
class HorovodAllreduce(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce of the output gradient (same op and factors)."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op = _ops.handle_average_backwards_compatibility(op, average)
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        ctx.process_set = process_set
        return _shared.run(_shared.start_allreduce([tensor], name, ctx.op, None, prescale_factor, postscale_factor,
                                                   process_set, False, False, attended=True))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=ctx.op, prescale_factor=ctx.prescale_factor,
                         postscale_factor=ctx.postscale_factor, process_set=ctx.process_set)
        return grad, None, None, None, None, None, None


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce; gradients are the grouped allreduce of the output gradients."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.op = _ops.handle_average_backwards_compatibility(op, average)
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        ctx.process_set = process_set
        return tuple(_shared.run(_shared.start_allreduce(list(tensors), name, ctx.op, None, prescale_factor,
                                                         postscale_factor, process_set, False, True, attended=True)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = grouped_allreduce(list(grad_outputs), op=ctx.op, prescale_factor=ctx.prescale_factor,
                                  postscale_factor=ctx.postscale_factor, process_set=ctx.process_set)
        return (None, None, None, None, None, None, *grads)


def allreduce(tensor: torch.Tensor, average=None, name: Optional[str] = None, compression=Compression.none,
              op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across the process set and return the result as a new tensor (differentiable).

    Args:
        tensor: the tensor to reduce.
        average: deprecated; use ``op``.
        name: the operation's name (must match across ranks); unnamed ops are matched by issue order.
        compression: how the tensor travels (``Compression.none``, ``.fp16``, ``.bf16``).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        process_set: the ranks taking part; all of them must call this.

    Raises:
        HorovodInternalError: the ranks disagreed about the operation, or a peer failed.
    """
    # The forward settles ``op`` / ``average`` (once; the original passes both to it too).
    compressed, ctx = compression.compress(tensor)
    reduced = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average=None, name: Optional[str] = None,
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Reduce a list of tensors as one group (negotiated and fused together); differentiable."""
    if not tensors:
        _ops.handle_average_backwards_compatibility(op, average)   # a conflicting op / average still raises
        return []
    pairs = [compression.compress(t) for t in tensors]
    reduced = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                            *[c for c, _ in pairs])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


# -- allgather -------------------------------------------------------------------------------------------
class HorovodAllgather(torch.autograd.Function):
    """Allgather; the gradient is this rank's rows of the allreduce-averaged output gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return _shared.run(_shared.start_allgather([tensor], name, process_set, False, attended=True))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        dims = _first_dims([ctx.dim], ctx.process_set)[:, 0]
        offset = int(dims[:_set_rank(ctx.process_set)].sum())
        return reduced.narrow(0, offset, ctx.dim), None, None


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather; gradients as for :class:`HorovodAllgather`, per tensor."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(_shared.run(_shared.start_allgather(list(tensors), name, process_set, True, attended=True)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        reduced = grouped_allreduce(list(grad_outputs), op=Average, process_set=ctx.process_set)
        dims = _first_dims(ctx.dims, ctx.process_set)
        before = dims[:_set_rank(ctx.process_set)].sum(dim=0)
        grads = [g.narrow(0, int(before[i]), ctx.dims[i]) for i, g in enumerate(reduced)]
        return (None, None, *grads)


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (differentiable).

    Every dimension but the first must agree across ranks.
    """
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Allgather a list of tensors as one group (differentiable)."""
    if not tensors:
        return []
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast -------------------------------------------------------------------------------------------
class HorovodBroadcast(torch.autograd.Function):
    """Broadcast; the root's gradient is the allreduce-averaged output gradient, the others get zeros."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _shared.run(_shared.start_broadcast(tensor, root_rank, name, process_set, False, attended=True))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return a copy of ``root_rank``'s ``tensor`` on every rank (differentiable; root is a global rank)."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall --------------------------------------------------------------------------------------------
class HorovodAlltoall(torch.autograd.Function):
    """Alltoall; the gradient travels back with an alltoall using the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = _shared.run(_shared.start_alltoall(tensor, splits, name, process_set, attended=True))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = _ops.synchronize(_ops.alltoall_async(grad_output.contiguous(), ctx.received,
                                                       process_set=ctx.process_set))
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits=None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set):
    """Scatter row blocks of ``tensor`` to the ranks of the set and gather theirs (differentiable).

    Returns:
        ``output`` when ``splits`` is None (equal split), else ``(output, received_splits)``.
    """
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


# -- reducescatter ---------------------------------------------------------------------------------------
def _reducescatter_grad_scale(op, prescale_factor, postscale_factor, process_set) -> float:
    return framework_rules.reducescatter_grad_scale(op, prescale_factor, postscale_factor, _set_size(process_set))


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter; the gradient is the allgather of the output gradients, scaled (see the module docstring)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.scale = _reducescatter_grad_scale(op, prescale_factor, postscale_factor, process_set)
        ctx.process_set = process_set
        return _shared.run(_shared.start_reducescatter([tensor], name, op, prescale_factor, postscale_factor,
                                                       process_set, False, attended=True))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allgather(grad_output, process_set=ctx.process_set)
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        return grad, None, None, None, None, None


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter; gradients are the grouped allgather of the output gradients."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.scale = _reducescatter_grad_scale(op, prescale_factor, postscale_factor, process_set)
        ctx.process_set = process_set
        return tuple(_shared.run(_shared.start_reducescatter(list(tensors), name, op, prescale_factor,
                                                             postscale_factor, process_set, True, attended=True)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = grouped_allgather(list(grad_outputs), process_set=ctx.process_set)
        if ctx.scale != 1.0:
            grads = [g * ctx.scale for g in grads]
        return (None, None, None, None, None, *grads)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression=Compression.none, op=Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` across the set (Sum or Average) and return this rank's block of rows (differentiable).

    Rank r gets ``d0 // n`` rows, plus one when ``r < d0 % n``.

    Raises:
        ValueError: ``op`` is not Sum/Average, or ``tensor`` is a scalar.
    """
    op = Average if op is None else op
    compressed, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression=Compression.none, op=Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Reduce-scatter a list of tensors as one group (differentiable)."""
    op = Average if op is None else op
    if not tensors:
        return []
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                             *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]
