"""The strategy's collectives in Lightning's terms, over :mod:`horovod.torch`.

Lightning calls ``reduce(tensor, group, reduce_op)`` with ``reduce_op`` a string (``"mean"``/``"avg"``, ``"sum"``,
``"max"``, ``"min"``: ``self.log(..., reduce_fx=...)`` passes the function's name) or a
``torch.distributed.ReduceOp``; ``all_gather`` returns the tensors of every rank stacked on a new first dimension.
Neither framework knows the other: this module is the only place that translates.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

import horovod.torch as hvd

_OPS = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min,
        "product": hvd.Product}


def reduce_op(op: Any) -> int:
    """Horovod's op for Lightning's ``reduce_op`` (``None`` is the mean, as in ``Strategy.reduce``'s default).

    Raises:
        ValueError: an op Horovod does not have (``torch.distributed.ReduceOp.BAND`` ...), or an unknown string.
    """
    if op is None:
        return hvd.Average
    key = op if isinstance(op, str) else getattr(op, "name", str(op).rpartition(".")[2])
    found = _OPS.get(str(key).lower())
    if found is None:
        raise ValueError(f"HorovodStrategy.reduce: unsupported reduce_op {op!r}; expected one of "
                         f"{sorted(_OPS)} or the matching torch.distributed.ReduceOp")
    return found


def _check_group(group: Optional[Any], what: str) -> None:
    if group is not None:
        raise ValueError(f"HorovodStrategy.{what}: group={group!r} is not supported (Horovod reduces over all "
                         f"ranks here); pass group=None")


def reduce(tensor: Any, group: Optional[Any] = None, op: Any = "mean") -> Any:
    """``tensor`` reduced over every rank (a non-tensor is returned as it is, as Lightning's strategies do)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    _check_group(group, "reduce")
    hop = reduce_op(op)
    if hop == hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
        # An integer mean: sum, then divide and cast back (what Lightning's DDP reduction gives for integers).
        return (hvd.allreduce(tensor, op=hvd.Sum) / hvd.size()).to(tensor.dtype)
    return hvd.allreduce(tensor, op=hop)


def all_gather(tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
    """Every rank's ``tensor`` stacked: shape ``(size, *tensor.shape)``, rank order (the shapes must agree)."""
    _check_group(group, "all_gather")
    stacked = tensor.unsqueeze(0)
    if sync_grads:
        return hvd.allgather(stacked)   # horovod.torch's allgather is differentiable
    with torch.no_grad():
        return hvd.allgather(stacked)
