"""DistributedOptimizer: averages gradients across ranks while backward is still running.

The returned object is an instance of a class created on the fly that derives from the wrapped optimizer's
class, and it shares the wrapped optimizer's ``state`` and ``param_groups``: learning-rate schedulers, checkpoints
and ``isinstance`` checks keep working.  A ``register_post_accumulate_grad_hook`` on every parameter starts that
parameter's allreduce (in place on ``p.grad``, or on its compressed copy) the moment its gradient is complete, so
communication overlaps with the rest of the backward pass; ``step()`` waits for the allreduces and then runs the
real optimizer step.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Dict, Iterator, List, Sequence, Set, Tuple, Type, cast

import torch

from horovod.common.basics import Adasum, Average, size
from horovod.common.buckets import plan_buckets
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.engine import config as _config
from horovod.torch.compression import Compression
from horovod.torch.adasum_optimizer import _DistributedAdasumOptimizer
from horovod.torch.engine_ops import allreduce_async_, grouped_allreduce_async_, sparse_allreduce_async, synchronize
from horovod.torch.optimizer_base import _TOO_MANY_PASSES, _HorovodOptimizerBase

logger = logging.getLogger(__name__)


def _plan_buckets(params: Sequence[torch.Tensor], cap: int) -> List[Tuple[torch.Tensor, ...]]:
    """Pack small parameters into buckets of at most ``cap`` bytes of one dtype.

    Parameters are taken in reverse registration order, roughly the order in which backward produces their
    gradients, so a bucket fills early and its allreduce overlaps the rest of backward.  A bucket's gradients
    travel as one flat tensor: one request and one collective instead of one per parameter, which is what a
    model of many small layers pays most for.  A parameter larger than ``cap``, or alone in its bucket, keeps
    the per-tensor path.
    """
    ordered = list(reversed(list(params)))
    plan = plan_buckets([p.numel() * p.element_size() for p in ordered], [p.dtype for p in ordered], cap)
    return [tuple(ordered[i] for i in bucket) for bucket in plan]


class _DistributedOptimizer(_HorovodOptimizerBase):
    """Gradient-averaging optimizer (all ops but Adasum)."""

    def _form_groups(self, trainable: List[torch.Tensor]) -> None:
        if self._groups_spec is not None:
            super()._form_groups(trainable)
            return
        self._buckets = set(_plan_buckets(trainable, _config.load().gradient_bucket_bytes))
        for bucket in self._buckets:
            self._add_group(bucket)

    # -- the backward hook ----------------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] > 0:
            self._handles[p] = (None, None)   # accumulating locally; step() before the last pass still reduces
            return
        group = self._p_to_group.get(p)
        if group is None:
            self._handles[p] = self._allreduce_grad_async(p)
            return
        ready = self._group_ready[group]
        ready.add(p)
        if len(ready) == len(group):
            self._issue_group(group)
        else:
            self._handles[p] = (None, None)

    def _issue_group(self, group: Tuple[torch.Tensor, ...]) -> None:
        for gp in group:
            self._handles.pop(gp, None)
        if group in self._buckets:
            self._handles[group] = self._bucket_allreduce_async(group)
        else:
            self._handles[group] = self._grouped_allreduce_grad_async(group)
        self._group_ready[group] = set()

    # -- issuing ----------------------------------------------------------------------------------------------
    def _dense_grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:
            # Another rank may have a gradient for p (dynamic graphs): contribute zeros rather than nothing.
            p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
        grad = p.grad
        if grad.is_sparse:
            grad = grad.to_dense()
        return grad

    def _allreduce_grad_async(self, p: torch.Tensor):
        name = self._name(p)
        if p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense:
            return sparse_allreduce_async(p.grad, name=name, op=self.op, process_set=self.process_set), None
        grad = self._dense_grad(p)
        compressed, ctx = self._compression.compress(grad)
        pre, post = self._scale_factors()
        handle = allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre, postscale_factor=post,
                                  process_set=self.process_set)
        return handle, (ctx, grad)

    def _grouped_allreduce_grad_async(self, group: Tuple[torch.Tensor, ...]):
        grads = [self._dense_grad(p) for p in group]
        pairs = [self._compression.compress(g) for g in grads]
        pre, post = self._scale_factors()
        handle = grouped_allreduce_async_([c for c, _ in pairs], name=self._name(group[0]), op=self.op,
                                          prescale_factor=pre, postscale_factor=post,
                                          process_set=self.process_set)
        return handle, [(ctx, g) for (_, ctx), g in zip(pairs, grads)]

    def _bucket_allreduce_async(self, bucket: Tuple[torch.Tensor, ...]):
        """Allreduce a bucket's gradients as one flat tensor; the handle is a callable giving one view per grad."""
        grads = [self._dense_grad(p) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        compressed, ctx = self._compression.compress(flat)
        pre, post = self._scale_factors()
        handle = allreduce_async_(compressed, name=f"bucket.{self._name(bucket[0])}+{len(bucket) - 1}", op=self.op,
                                  prescale_factor=pre, postscale_factor=post, process_set=self.process_set)

        def unpack() -> List[torch.Tensor]:
            reduced = self._compression.decompress(synchronize(handle), ctx)
            return [piece.view_as(g) for piece, g in zip(reduced.split([g.numel() for g in grads]), grads)]

        # Each piece is already decompressed: _apply_result gets no compression context for it.
        return unpack, [(None, g) for g in grads]

    # -- completing -------------------------------------------------------------------------------------------
    def _apply_result(self, p: torch.Tensor, output, ctx) -> None:
        if ctx is None:   # sparse allgather path: ``output`` is already the reduced sparse gradient
            p.grad = output
            return
        decompress_ctx, grad = ctx
        result = self._compression.decompress(output, decompress_ctx)
        target = p.grad if p.grad is not None else grad
        if target.is_sparse:   # sparse_as_dense: reduced densely, handed back in the layout autograd produced
            p.grad = result.to_sparse()
        elif result is not target:
            target.copy_(result)
            p.grad = target

    def synchronize(self) -> None:
        """Wait for every gradient allreduce of this step and write the averaged gradients into ``p.grad``.

        Parameters whose gradient was not computed on this rank contribute zeros, so ranks with different
        graphs still agree.  Call it yourself to work on the averaged gradients before ``step()`` (e.g. to clip
        them), then call ``step()`` inside :meth:`skip_synchronize`.
        """
        if self.process_set.included() is False:
            self._synchronized = True
            return
        issued: Set[torch.Tensor] = set()
        for key in self._handles:
            if isinstance(key, tuple):
                issued.update(key)
        # Launch what the backward hooks did not: groups still waiting for members, accumulating or unused params.
        for p in self._requires_update:
            if p in issued:
                continue
            group = self._p_to_group.get(p)
            if group is not None:
                if group not in self._handles:
                    self._issue_group(group)
                    issued.update(group)
                continue
            entry = self._handles.get(p)
            if entry is None or entry[0] is None:
                self._handles[p] = self._allreduce_grad_async(p)
        try:
            for key, (handle, ctx) in list(self._handles.items()):
                output = handle() if callable(handle) else synchronize(handle)
                if isinstance(key, tuple):
                    for gp, out, gctx in zip(key, output, ctx):
                        self._apply_result(gp, out, gctx)
                else:
                    self._apply_result(key, output, ctx)
        finally:
            self._handles.clear()
            for p in self._allreduce_delay:
                self._allreduce_delay[p] = self.backward_passes_per_step
            for group in self._group_ready:
                self._group_ready[group] = set()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not synchronize (use after an explicit :meth:`synchronize`)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Wait for the averaged gradients (unless inside :meth:`skip_synchronize`), then take the real step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    # torch wraps ``step`` of classes it has not seen with its profiling / step-hook wrapper; the base class's
    # step already is wrapped, so marking ours keeps step hooks from running twice.
    step.hooked = True  # type: ignore[attr-defined]


_CLASS_CACHE: Dict[Tuple[type, type], Type[_HorovodOptimizerBase]] = {}


def _distributed_class(base: Type[torch.optim.Optimizer],
                       mixin: Type[_HorovodOptimizerBase]) -> Type[_HorovodOptimizerBase]:
    key = (base, mixin)
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        cls = cast(Type[_HorovodOptimizerBase], type(base.__name__, (mixin, base), {"__module__": __name__}))
        _CLASS_CACHE[key] = cls
    return cls


def _is_distributed(optimizer) -> bool:
    return isinstance(optimizer, _HorovodOptimizerBase)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap a torch optimizer so that ``step()`` uses gradients averaged over all ranks.

    Allreduces start from backward hooks while backward continues; ``step()`` waits for them.  The returned
    optimizer is an instance of a subclass of ``type(optimizer)`` and shares its state and param_groups.

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names the allreduces (recommended: unnamed parameters
            are named by position, which must then agree across ranks).
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16``.
        backward_passes_per_step: backward passes accumulated locally before gradients are allreduced.
        op: ``Average`` (default), ``Sum`` or ``Adasum`` (delta-based; power-of-two number of ranks).
        gradient_predivide_factor: with Average, divide gradients by this before the sum and multiply by
            ``factor / size`` after it.
        num_groups: deprecated; use ``groups``.
        groups: an int (split the parameters into that many groups that are allreduced together), or a list of
            lists of parameters.
        sparse_as_dense: allreduce sparse gradients densely instead of allgathering them.
        process_set: the ranks that average their gradients.

    Raises:
        ValueError: duplicate or missing parameter names, ``backward_passes_per_step <= 0``, a predivide factor
            with an op other than Average, or malformed ``groups``.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None:
        if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups >= 0)):
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        if isinstance(groups, list):
            for group in groups:
                if not isinstance(group, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in group):
                    raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        elif groups == 0:
            groups = None
    if _is_distributed(optimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer; wrap the plain torch optimizer once")

    world = size()
    if op == Adasum and world & (world - 1):
        raise NotImplementedError(f"Adasum requires a power-of-two number of ranks; this job has {world}.")
    mixin = _DistributedAdasumOptimizer if op == Adasum and world > 1 else _DistributedOptimizer
    cls = _distributed_class(type(optimizer), mixin)
    wrapped = cls.__new__(cls)
    # Share (not copy) the wrapped optimizer's attributes: state, param_groups, defaults, hooks.  Instance-level
    # overrides of methods are left behind: an LR scheduler built on the plain optimizer wraps its ``step`` in an
    # instance attribute bound to the plain optimizer, which would bypass the gradient allreduce.
    base = type(optimizer)
    wrapped.__dict__.update({key: value for key, value in optimizer.__dict__.items()
                             if not callable(getattr(base, key, None))})
    wrapped._hvd_wrapped = optimizer
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                       groups, sparse_as_dense, process_set)
    return wrapped
