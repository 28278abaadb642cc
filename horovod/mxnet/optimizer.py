"""Data-parallel training for MXNet: :class:`DistributedOptimizer` (Module API) and :class:`DistributedTrainer` (Gluon).

Both sum every rank's gradients with ``prescale_factor = 1 / gradient_predivide_factor`` and fold
``gradient_predivide_factor / process_set.size()`` into the optimizer's ``rescale_grad``, so the update sees the
average gradient, with the division split between before and after the sum as the caller asked.  All the
gradients of one step are issued before waiting for any, so the engine fuses them.
"""
from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import mxnet as mx
import numpy as np

from horovod.common.basics import is_initialized
from horovod.common.process_sets import ProcessSet, _set_id, global_process_set
from horovod.common.util import split_list
from horovod.engine import collectives
from horovod.engine.ops import Sum
from horovod.mxnet.compression import Compression, Compressor
from horovod.mxnet.mpi_ops import from_numpy, to_numpy

logger = logging.getLogger(__name__)


def _set_size(process_set: ProcessSet, who: str) -> int:
    if not is_initialized():
        raise ValueError(f"{who} needs a running Horovod: call hvd.init() before creating it.")
    n = process_set.size()
    if not n:
        raise ValueError(f"{who}: {process_set} is not registered; pass it to hvd.init(process_sets=[...]) or "
                         f"hvd.add_process_set() first.")
    return n


def _check_predivide(factor: float, who: str) -> float:
    factor = float(factor)
    if not factor > 0.0:
        raise ValueError(f"{who}: gradient_predivide_factor must be positive, got {factor}.")
    return factor


def _check_num_groups(num_groups: int, who: str) -> int:
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 0:
        raise ValueError(f"{who}: num_groups must be a non-negative int (0 = no explicit groups), got "
                         f"{num_groups!r}.")
    return int(num_groups)


def allreduce_gradients(grads: Sequence[Sequence[mx.nd.NDArray]], names: Sequence[str], *,
                        predivide: float, num_groups: int, process_set: ProcessSet,
                        compression: Type[Compressor] = Compression.none) -> None:
    """Sum gradients over the process set, in place.

    Args:
        grads: one entry per parameter: the list of its gradient arrays on this rank's contexts (usually one).
            Several are summed locally first, and all of them receive the result.
        names: one name per parameter, the same on every rank.
        predivide: every rank's gradient is multiplied by ``1 / predivide`` before the sum.
        num_groups: 0 — every gradient its own reduction (issued together, fused by the engine); n — n
            contiguous groups, each reduced atomically as one grouped allreduce per dtype.
        process_set: the ranks taking part.
        compression: how gradients travel (``Compression.none`` / ``Compression.fp16``).
    """
    if not grads:
        return
    set_id = _set_id(process_set)
    prescale = 1.0 / predivide
    # Compress and copy to host first: every rank then issues the same reductions in the same order.
    wire: List[Tuple[mx.nd.NDArray, Any, np.ndarray]] = []
    for arrays in grads:
        local = arrays[0] if len(arrays) == 1 else mx.nd.add_n(*[a.as_in_context(arrays[0].context) for a in arrays])
        compressed, ctx = compression.compress(local)
        wire.append((compressed, ctx, to_numpy(compressed, "DistributedTrainer")))
    handles = []
    if not num_groups:
        for (_, _, host), name in zip(wire, names):
            handles.append(collectives.allreduce_async([host], [f"allreduce.{name}"], op=Sum, prescale=prescale,
                                                       process_set=set_id, outputs=[host]))
    else:
        for members in (g for g in split_list(list(range(len(wire))), num_groups) if g):
            by_dtype: Dict[str, List[int]] = OrderedDict()
            for i in members:
                by_dtype.setdefault(wire[i][2].dtype.name, []).append(i)
            for dtype, idx in by_dtype.items():
                hosts = [wire[i][2] for i in idx]
                base = f"{names[idx[0]]}:{names[idx[-1]]}.{dtype}"
                member_names, _ = collectives.group_names("grouped_allreduce", base, len(hosts), set_id)
                handles.append(collectives.allreduce_async(hosts, member_names, op=Sum, prescale=prescale,
                                                           process_set=set_id, outputs=hosts, grouped=True))
    for handle in handles:
        handle.wait()
    for arrays, (compressed, ctx, host) in zip(grads, wire):
        result = compression.decompress(from_numpy(host, compressed), ctx)
        for array in arrays:
            array[:] = result if result.context == array.context else result.as_in_context(array.context)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an ``mx.optimizer.Optimizer`` so that ``update`` averages the gradients over the ranks first.

    Use it with the Module API and no kvstore: ``mod.fit(..., kvstore=None, optimizer=hvd.DistributedOptimizer(opt))``
    (or through ``mx.optimizer.get_updater``).  Every attribute other than the wrapper's own is read from and
    written to the wrapped optimizer, so the Module's ``idx2name``, learning-rate schedules and multipliers reach it.

    Args:
        optimizer: the optimizer doing the update.
        gradient_predivide_factor: divide gradients by this before the sum and by ``size / factor`` after it.
        num_groups: when an update covers several parameters, reduce them in this many atomic groups (0 = each
            on its own, still issued together).
        process_set: the ranks that average their gradients.
    """

    _OWN = frozenset({"_optimizer", "_gradient_predivide_factor", "_num_groups", "_process_set", "_do_allreduce",
                      "update", "update_multi_precision", "create_state", "create_state_multi_precision",
                      "__class__", "__dict__", "__getstate__", "__setstate__", "__reduce__", "__reduce_ex__",
                      "__repr__", "_OWN"})

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set):
        # Optimizer.__init__ is deliberately not called: the wrapped optimizer holds all the state.
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("DistributedOptimizer got an optimizer that is already a DistributedOptimizer; wrap "
                             "the plain mx.optimizer.Optimizer once.")
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps an mx.optimizer.Optimizer, got {type(optimizer).__name__}.")
        predivide = _check_predivide(gradient_predivide_factor, "DistributedOptimizer")
        n = _set_size(process_set, "DistributedOptimizer")
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_gradient_predivide_factor", predivide)
        object.__setattr__(self, "_num_groups", _check_num_groups(num_groups, "DistributedOptimizer"))
        object.__setattr__(self, "_process_set", process_set)
        # Averaging through rescale_grad costs nothing extra: the update multiplies by it anyway.
        optimizer.rescale_grad *= predivide / n

    def __getattribute__(self, name: str):
        if name in DistributedOptimizer._OWN:
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "_optimizer"), name)

    def __setattr__(self, name: str, value) -> None:
        if name in DistributedOptimizer._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(object.__getattribute__(self, "_optimizer"), name, value)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r}, process_set={self._process_set})"

    def _do_allreduce(self, index, grad) -> None:
        if self._process_set.size() == 1 and self._gradient_predivide_factor == 1.0:
            return
        if isinstance(index, (tuple, list)):
            grads, names = [[g] for g in grad], [str(i) for i in index]
        else:
            grads, names = [[grad]], [str(index)]
        allreduce_gradients(grads, names, predivide=self._gradient_predivide_factor, num_groups=self._num_groups,
                            process_set=self._process_set)

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def update(self, index, weight, grad, state):
        """Average ``grad`` (one parameter or a list) over the ranks, then let the wrapped optimizer update."""
        self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        """Average ``grad`` over the ranks, then run the wrapped optimizer's multi-precision update."""
        self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` whose ``step`` / ``allreduce_grads`` average gradients over the ranks (no kvstore).

    Args:
        params: ``net.collect_params()`` or a list/dict of Parameters (the same on every rank).
        optimizer: an optimizer name or ``mx.optimizer.Optimizer`` (a :class:`DistributedOptimizer` is unwrapped).
        optimizer_params: keyword arguments for a named optimizer.
        compression: how gradients travel (``hvd.Compression.none`` or ``hvd.Compression.fp16``).
        gradient_predivide_factor: divide gradients by this before the sum and by ``size / factor`` after it.
        prefix: prepended to the reduction names, so two trainers can run side by side.
        num_groups: reduce the gradients in this many atomic groups (0 = each on its own, fused by the engine).
        process_set: the ranks that average their gradients.
    """

    def __init__(self, params, optimizer, optimizer_params: Optional[dict] = None,
                 compression: Type[Compressor] = Compression.none, gradient_predivide_factor: float = 1.0,
                 prefix: Optional[str] = None, num_groups: int = 0, process_set: ProcessSet = global_process_set):
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"DistributedTrainer: prefix must be a string or None, got {prefix!r}.")
        if not (isinstance(compression, type) and issubclass(compression, Compressor)):
            raise ValueError(f"DistributedTrainer: compression must be hvd.Compression.none, hvd.Compression.fp16 "
                             f"or another Compressor class, got {compression!r}.")
        predivide = _check_predivide(gradient_predivide_factor, "DistributedTrainer")
        groups = _check_num_groups(num_groups, "DistributedTrainer")
        n = _set_size(process_set, "DistributedTrainer")
        if isinstance(optimizer, DistributedOptimizer):
            warnings.warn("DistributedTrainer reduces gradients itself and takes a plain optimizer; the "
                          "DistributedOptimizer passed to it was unwrapped.", stacklevel=2)
            inner = optimizer._optimizer
            inner.rescale_grad *= optimizer._process_set.size() / optimizer._gradient_predivide_factor
            optimizer = inner
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        # Trainer.step sets rescale_grad = _scale / batch_size; folding the average in here is free.
        self._scale *= predivide / n
        self._compression = compression
        self._gradient_predivide_factor = predivide
        self._prefix = prefix or ""
        self._num_groups = groups
        self._process_set = process_set

    def _allreduce_grads(self) -> None:
        if self._process_set.size() == 1 and self._gradient_predivide_factor == 1.0:
            if len(self._contexts) > 1:   # still sum the local devices, as the 'device' kvstore would
                self._reduce(local_only=True)
            return
        self._reduce(local_only=False)

    def _reduce(self, local_only: bool) -> None:
        grads, names = [], []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            arrays = param.list_grad()
            if arrays[0].stype != "default":
                raise NotImplementedError(f"DistributedTrainer: parameter {param.name} has a {arrays[0].stype} "
                                          f"gradient; only dense gradients are reduced (use sparse_grad=False).")
            grads.append(arrays)
            names.append(self._prefix + str(i))
        if local_only:
            for arrays in grads:
                total = mx.nd.add_n(*[a.as_in_context(arrays[0].context) for a in arrays])
                for a in arrays:
                    a[:] = total.as_in_context(a.context)
            return
        allreduce_gradients(grads, names, predivide=self._gradient_predivide_factor, num_groups=self._num_groups,
                            process_set=self._process_set, compression=self._compression)
