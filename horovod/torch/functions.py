"""Helpers that keep models, optimizers and Python objects consistent across ranks."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from horovod.common import objects as _objects
from horovod.common.basics import rank
from horovod.common.process_sets import ProcessSet, _set_id, global_process_set
from horovod.torch.engine_ops import _collectives


def broadcast_parameters(params: Union[Dict[str, torch.Tensor], Iterable], root_rank: int) -> None:
    """Overwrite every rank's parameters with ``root_rank``'s, in place.

    All ranks must call it with the same parameters.  Typically called after initialising a model (or
    restoring it on the root) so that every rank starts from the same weights.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` (or a list of ``(name, tensor)``), or a
            list of tensors.
        root_rank: the global rank whose values everyone gets.

    Raises:
        ValueError: ``params`` is not one of the accepted forms.
    """
    if isinstance(params, dict):
        items: List[Tuple[Optional[str], Any]] = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}; pass model.state_dict(), "
                         f"model.named_parameters() or a list of tensors")
    pending = []
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"broadcast_parameters: entry {name!r} is a {type(value).__name__}, not a tensor")
        # Every broadcast is issued before waiting on any (the engine fuses them); the caller waits right away.
        pending.append(_collectives.start_broadcast(value, root_rank, name, global_process_set, True, attended=True))
    for started in pending:
        _collectives.run(started)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank of the process set (any cloudpickle-able value).

    All ranks of the set must call it; unnamed calls are matched by issue order, so non-root ranks may pass a
    placeholder such as ``None``.
    """
    return _objects.broadcast_object(obj, root_rank, name, _set_id(process_set))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj``, in rank order (all ranks must call it)."""
    return _objects.allgather_object(obj, name, _set_id(process_set))


def _underlying_step(optimizer: torch.optim.Optimizer) -> None:
    """One step of the wrapped torch optimizer, bypassing a DistributedOptimizer's gradient allreduce."""
    # A DistributedOptimizer (horovod.torch.optimizer) keeps the wrapped class's own step as _hvd_base_step.
    base_step = getattr(optimizer, "_hvd_base_step", None)
    if base_step is not None:
        base_step()
    else:
        optimizer.step()


def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state with one step on zero gradients, leaving the parameters as they were.

    Freshly created optimizers have no state until their first step; a broadcast needs every rank to hold the
    same state entries, so each rank takes one local step on zero gradients (like the original) — and then puts
    the parameter values back, so that weight decay or momentum cannot move them. Gradients that existed are put
    back too; a trainable parameter that had none keeps the zero gradient, as in the original (scripts read
    ``p.grad`` right after the broadcast).
    """
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            saved.append((p, p.detach().clone(), p.grad))
            grad = torch.zeros_like(p)
            if isinstance(optimizer, torch.optim.SparseAdam):
                grad = grad.to_sparse()
            p.grad = grad
    try:
        _underlying_step(optimizer)
    finally:
        with torch.no_grad():
            for p, value, grad in saved:
                p.copy_(value)
                if grad is not None:
                    p.grad = grad


def _state_layout(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """Per parameter (in param_groups order): tensor entries as (shape, dtype), other entries by value."""
    layout = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entries: Dict[str, Tuple[Any, ...]] = {}
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    entries[key] = ("tensor", tuple(value.shape), value.dtype)
                else:
                    entries[key] = ("value", value)
            layout.append(entries)
    return layout


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model=None) -> None:
    """Overwrite every rank's optimizer state and options (learning rate, momentum, ...) with ``root_rank``'s.

    Works on a plain torch optimizer or a :func:`DistributedOptimizer`.  An optimizer without state yet gets it
    first from a local step on zero gradients (parameters are left unchanged).  Tensor state is broadcast in
    place; options and non-tensor state travel with :func:`broadcast_object`.  Ranks whose state is missing
    entries the root has (e.g. only the root restored a checkpoint) get them created.

    Args:
        optimizer: the optimizer to synchronise.
        root_rank: the global rank whose state everyone gets.
        model: unused; accepted for compatibility.

    Raises:
        ValueError: ``optimizer`` is ``torch.optim.LBFGS`` (its nested state cannot be broadcast).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state:
        _initialise_state(optimizer)

    is_root = rank() == root_rank
    options = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    root_options, root_layout = broadcast_object(
        (options, _state_layout(optimizer)) if is_root else None, root_rank,
        name="broadcast_optimizer_state.layout")
    if len(root_options) != len(optimizer.param_groups):
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank} has {len(root_options)} parameter groups, "
                         f"this rank has {len(optimizer.param_groups)}; build the optimizers identically.")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(root_layout) != len(params):
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank} optimizes {len(root_layout)} parameters, "
                         f"this rank {len(params)}; build the optimizers identically.")
    if not is_root:
        for group, opts in zip(optimizer.param_groups, root_options):
            group.update(opts)

    pending = []
    for index, (p, entries) in enumerate(zip(params, root_layout)):
        if not entries:
            optimizer.state.pop(p, None)   # the root has no state for p (e.g. it never had a gradient)
            continue
        state = optimizer.state[p]
        for key in [k for k in state if k not in entries]:
            del state[key]
        for key in sorted(entries, key=str):
            spec = entries[key]
            if spec[0] == "value":
                if not is_root:
                    state[key] = spec[1]
                continue
            _, shape, dtype = spec
            current = state.get(key)
            if not isinstance(current, torch.Tensor) or tuple(current.shape) != shape or current.dtype != dtype:
                device = current.device if isinstance(current, torch.Tensor) else p.device
                if key == "step" and not isinstance(current, torch.Tensor) and not shape:
                    device = torch.device("cpu")   # torch keeps scalar step counters on the host
                current = torch.zeros(shape, dtype=dtype, device=device)
                state[key] = current
            pending.append(_collectives.start_broadcast(current, root_rank, f"optimizer_state.{index}.{key}",
                                                        global_process_set, True, attended=True))
    for started in pending:
        _collectives.run(started)
