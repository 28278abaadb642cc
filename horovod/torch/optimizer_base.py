"""What both distributed torch optimizers share: naming parameters, the gradient hooks, the wrapped class's step.

:mod:`horovod.torch.optimizer` (averaging gradients, in buckets) and :mod:`horovod.torch.adasum_optimizer`
(combining parameter deltas with Adasum) derive from :class:`_HorovodOptimizerBase`.
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from horovod.common.basics import Average, size
from horovod.common.elastic import register_distributed
from horovod.common.process_sets import ProcessSet
from horovod.common.util import split_list
from horovod.engine import config as _config
from horovod.torch.functions import broadcast_object

logger = logging.getLogger("horovod.torch.optimizer")  # one logger for DistributedOptimizer

_ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                   "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")


def _find_duplicates(names: Sequence[str]) -> List[str]:
    seen, dups = set(), []
    for name in names:
        if name in seen and name not in dups:
            dups.append(name)
        seen.add(name)
    return dups


if TYPE_CHECKING:
    # The mixin is only ever used as the first base of a class built over the wrapped optimizer's class
    # (optimizer._distributed_class): type-check it as the torch optimizer it extends.  Imported by name (not an
    # alias of torch.optim.Optimizer) so that mypy without torch installed sees a base of type Any, not a variable.
    from torch.optim import Optimizer as _OptimizerBase
else:
    _OptimizerBase = object


class _HorovodOptimizerBase(_OptimizerBase):
    """What both distributed optimizers share: parameter naming, hook registration, the wrapped base step."""

    _hvd_wrapped: torch.optim.Optimizer   # the optimizer it wraps (set by DistributedOptimizer)

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step: int, op: int,
                   gradient_predivide_factor: float, groups, sparse_as_dense: bool,
                   process_set: ProcessSet) -> None:
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", p)
                                for i, group in enumerate(self.param_groups)
                                for j, p in enumerate(group["params"])]
        if any(not isinstance(item, tuple) for item in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                             "by model.named_parameters().")
        dups = _find_duplicates([name for name, _ in named_parameters])
        if dups:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                             f"{', '.join(dups)}")
        named_ids = {id(p) for _, p in named_parameters}
        unnamed = [id(p) for p in all_params if id(p) not in named_ids]
        if unnamed:
            raise ValueError(f"named_parameters was specified, but one or more model parameters were not named. "
                             f"Python object ids: {', '.join(str(i) for i in unnamed)}")
        # Keyed by tensor identity (torch tensors hash by id); sorted so a name shared by tied weights is stable.
        self._parameter_names: Dict[torch.Tensor, str] = {p: name for name, p in sorted(
            named_parameters, key=lambda item: item[0])}
        self._handles: Dict[Any, Tuple[Any, Any]] = {}
        self._hook_handles: List[Any] = []
        self._requires_update: List[torch.Tensor] = []
        self._allreduce_delay: Dict[torch.Tensor, int] = {p: backward_passes_per_step for p in all_params}
        self._synchronized = False
        self._should_synchronize = True
        self._groups_spec = groups
        self._groups: Optional[List[Tuple[torch.Tensor, ...]]] = None
        self._p_to_group: Dict[torch.Tensor, Tuple[torch.Tensor, ...]] = {}
        self._group_ready: Dict[Tuple[torch.Tensor, ...], set] = {}
        self._buckets: set = set()   # automatic groups reduced as one flat tensor (see _plan_buckets)
        register_distributed(self)
        hooks_wanted = size() > 1 or _config.load().elastic
        if hooks_wanted and process_set.included() is not False:
            self._register_hooks()
        logger.debug("DistributedOptimizer(%s): %d parameters, %d gradient hooks, %s groups, op %s",
                     type(self).__name__, len(all_params), len(self._hook_handles),
                     len(self._groups) if self._groups is not None else "no", op)

    # -- naming and grouping --------------------------------------------------------------------------------
    def _name(self, p: torch.Tensor) -> str:
        return self._parameter_names[p]

    def _form_groups(self, trainable: List[torch.Tensor]) -> None:
        spec = self._groups_spec
        if spec is None:
            return
        if isinstance(spec, int):
            # Every rank must form the same groups in the same order: use rank 0's parameter order.
            names = broadcast_object([self._name(p) for p in trainable], root_rank=0,
                                     name="DistributedOptimizer.groups", process_set=self.process_set)
            by_name = {self._name(p): p for p in trainable}
            ordered = [by_name[n] for n in names if n in by_name]
            groups = [tuple(g) for g in split_list(ordered, spec) if g]
        else:
            trainable_ids = {id(p) for p in trainable}
            groups = [tuple(p for p in group if id(p) in trainable_ids) for group in spec]
            groups = [g for g in groups if g]
        self._groups = groups
        for group in groups:
            self._add_group(group)

    def _add_group(self, group: Tuple[torch.Tensor, ...]) -> None:
        for p in group:
            self._p_to_group[p] = group
        self._group_ready[group] = set()

    def _register_hooks(self) -> None:
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._requires_update = trainable
        self._form_groups(trainable)
        ref = weakref.ref(self)
        for p in trainable:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref)))

    def _scale_factors(self) -> Tuple[float, float]:
        if self.op == Average:
            # The engine applies 1/size on top of postscale for Average.
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _hvd_base_step(self, closure=None):
        """The wrapped optimizer class's own step (no gradient communication)."""
        return super().step(closure)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before gradients are allreduced."""
        if passes <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {passes}")
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _hvd_forget_step(self) -> None:
        """Forget the step in progress: as after construction, no allreduce pending, no pass counted.

        A step broken by a failure leaves handles of a dead engine, members of half-issued groups and pass
        counters already decremented; kept, they make the next ``zero_grad()`` refuse (``_ZERO_GRAD_RACE``) or
        the next backward count one pass too many (``_TOO_MANY_PASSES``).
        """
        self._handles.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        for group in self._group_ready:
            self._group_ready[group] = set()
        self._synchronized = False
        self._should_synchronize = True

    def _hvd_reset(self) -> None:
        """Elastic reset (:func:`horovod.common.elastic.reset_distributed`): forget the step in progress and its
        gradients, which hold a mix of local and partly reduced values."""
        self._hvd_forget_step()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def load_state_dict(self, state_dict) -> None:
        """Load state like the wrapped optimizer, and keep sharing it with the wrapped optimizer object.

        The step in progress, if any, is forgotten (as after construction): the loaded state is not the one its
        pending allreduces and pass counts belong to.
        """
        self._hvd_forget_step()
        super().load_state_dict(state_dict)
        wrapped = getattr(self, "_hvd_wrapped", None)
        if wrapped is not None:
            wrapped.__dict__["state"] = self.state
            wrapped.__dict__["param_groups"] = self.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like the wrapped optimizer's, but refuses while allreduces of this step are outstanding.

        Raises:
            AssertionError: called after ``backward()`` and before ``step()`` / ``synchronize()``.
        """
        if self._handles:
            raise AssertionError(_ZERO_GRAD_RACE)
        return super().zero_grad(set_to_none)


def _make_hook(ref: "weakref.ReferenceType"):
    def hook(p: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._on_grad_ready(p)

    return hook
