"""The Adasum form of DistributedOptimizer: local steps, parameter deltas combined across ranks with Adasum."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from horovod.common.basics import Adasum
from horovod.torch.engine_ops import allreduce_async_, synchronize
from horovod.torch.optimizer_base import _TOO_MANY_PASSES, _HorovodOptimizerBase


class _DistributedAdasumOptimizer(_HorovodOptimizerBase):
    """Adasum: each rank takes its own optimizer step, and the parameter *deltas* are combined with Adasum.

    While backward runs, a parameter whose gradient is ready takes a local step of the wrapped optimizer (for
    that parameter alone); its delta (new value - old value) is then Adasum-allreduced in place.  ``step()`` adds
    the combined delta to the old value.
    """

    def _hvd_setup(self, *args, **kwargs) -> None:
        super()._hvd_setup(*args, **kwargs)
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False)
                                 for group in self.param_groups for p in group["params"]}

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] == 0:
            self._handles[p] = self._allreduce_grad_async(p)
        else:
            self._handles[p] = (None, None)

    def _allreduce_grad_async(self, p: torch.Tensor):
        start = self._starting_models[p]
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p] if any(p is q for q in group["params"]) else []
            with torch.no_grad():
                start.copy_(p)
            self._hvd_base_step()
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        with torch.no_grad():
            p.sub_(start)   # p now holds this rank's delta
        compressed, ctx = self._compression.compress(p.detach())
        handle = allreduce_async_(compressed, name=self._name(p), op=Adasum, process_set=self.process_set)
        return handle, (ctx, compressed)

    def synchronize(self) -> None:
        """Nothing to do: Adasum deltas are combined in :meth:`step`."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Accepted for API compatibility; Adasum has no separate synchronize."""
        yield

    def step(self, closure=None):
        """Combine every parameter's delta across ranks with Adasum and apply it."""
        loss = closure() if closure is not None else None
        for p in self._requires_update:
            entry = self._handles.get(p)
            if entry is None or entry[0] is None:
                self._handles[p] = self._allreduce_grad_async(p)
        try:
            for p, (handle, (ctx, _compressed)) in list(self._handles.items()):
                delta = self._compression.decompress(synchronize(handle), ctx)
                start = self._starting_models[p]
                with torch.no_grad():
                    start.add_(delta)
                    p.copy_(start)
        finally:
            self._handles.clear()
            for p in self._allreduce_delay:
                self._allreduce_delay[p] = self.backward_passes_per_step
        return loss

    step.hooked = True  # type: ignore[attr-defined]
