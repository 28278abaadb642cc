"""What the strategy does, written once for both Lightning package names (``lightning`` and ``pytorch_lightning``).

Lightning 2.x ships the same classes under two package names that do not share them, so a strategy for each needs
its own base class.  The behaviour lives here, in mixins placed before Lightning's ``ParallelStrategy`` /
``ClusterEnvironment``: :mod:`horovod.lightning.strategy` and :mod:`horovod.lightning.pl_strategy` only combine
them.  Everything Lightning-specific that is used here is reached through ``super()`` or duck typing.

Facts that carry over from Lightning 1.x's Horovod strategy: processes are started by ``horovodrun``/``mpirun``,
never by Lightning; ranks come from Horovod; ``accumulate_grad_batches`` becomes the optimizer's
``backward_passes_per_step``; rank 0's parameters and optimizer state are broadcast before the first step.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

import horovod.torch as hvd
from horovod.lightning import _collectives

if TYPE_CHECKING:
    # The mixins are only ever used as the first base before these (type-checked as the classes they extend).
    from lightning.fabric.plugins import ClusterEnvironment as _EnvironmentBase
    from lightning.pytorch.strategies import ParallelStrategy as _StrategyBase
else:
    _EnvironmentBase = _StrategyBase = object

logger = logging.getLogger("horovod.lightning")


def _init() -> None:
    if not hvd.is_initialized():
        hvd.init()


class _HorovodEnvironmentMixin(_EnvironmentBase):
    """Ranks and sizes from Horovod (``hvd.init()`` on first use): the processes are started outside Lightning."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        raise RuntimeError("HorovodEnvironment has no main address: Horovod's ranks meet through horovodrun's "
                           "rendezvous (or MPI), not torch.distributed; use HorovodStrategy with it")

    @property
    def main_port(self) -> int:
        raise RuntimeError("HorovodEnvironment has no main port: Horovod's ranks meet through horovodrun's "
                           "rendezvous (or MPI), not torch.distributed; use HorovodStrategy with it")

    @staticmethod
    def detect() -> bool:
        """Never chosen automatically: ``strategy="horovod"`` brings it."""
        return False

    def world_size(self) -> int:
        _init()
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        if size != self.world_size():
            logger.debug("HorovodEnvironment: ignoring world size %d set by Lightning (Horovod has %d ranks)",
                         size, self.world_size())

    def global_rank(self) -> int:
        _init()
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        if rank != self.global_rank():
            logger.debug("HorovodEnvironment: ignoring global rank %d set by Lightning (Horovod rank %d)",
                         rank, self.global_rank())

    def local_rank(self) -> int:
        _init()
        return hvd.local_rank()

    def node_rank(self) -> int:
        _init()
        return hvd.cross_rank()


class _HorovodStrategyMixin(_StrategyBase):
    """Lightning's ``ParallelStrategy`` API over Horovod's ranks (see the subclasses' docstring)."""

    strategy_name = "horovod"
    _environment_class: Callable[[], Any]   # the package's HorovodEnvironment (set by each subclass)

    def __init__(self, accelerator: Any = None, parallel_devices: Optional[List[torch.device]] = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, *, compression: Any = None,
                 op: Any = None, gradient_predivide_factor: float = 1.0, groups: Any = None,
                 sparse_as_dense: bool = False, backward_passes_per_step: Optional[int] = None,
                 scale_learning_rate: bool = False) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=self._environment_class(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        _init()
        self._hvd_optimizer_kwargs: Dict[str, Any] = dict(
            compression=compression if compression is not None else hvd.Compression.none,
            op=op if op is not None else hvd.Average, gradient_predivide_factor=gradient_predivide_factor,
            groups=groups, sparse_as_dense=sparse_as_dense)
        if backward_passes_per_step is not None and backward_passes_per_step < 1:
            raise ValueError(f"HorovodStrategy: backward_passes_per_step must be >= 1 (or None: the Trainer's "
                             f"accumulate_grad_batches), got {backward_passes_per_step}")
        self._hvd_backward_passes = backward_passes_per_step
        self._hvd_scale_lr = scale_learning_rate
        self._hvd_wrapped: List[torch.optim.Optimizer] = []
        logger.debug("HorovodStrategy: rank %d of %d (local rank %d)", hvd.rank(), hvd.size(), hvd.local_rank())

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``strategy_registry.register("horovod", cls)``, replacing the lazy factory of :mod:`._registration`."""
        strategy_registry.register(cls.strategy_name, cls, description=f"{cls.__name__} from {cls.__module__}",
                                   override=True)

    # -- where this rank runs -------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Read by Lightning for custom strategies: distributed samplers and ``self.log(sync_dist=True)``."""
        return True

    @property
    def root_device(self) -> torch.device:
        """CPU, or the GPU of this rank's local rank (when only one GPU is visible, that one)."""
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cpu":
            return devices[0]
        local = hvd.local_rank()
        if local < len(devices):
            return devices[local]
        if len(devices) == 1:
            return devices[0]
        raise RuntimeError(f"HorovodStrategy: local rank {local} has no device of its own among the "
                           f"{len(devices)} visible ({devices}); start at most {len(devices)} processes per host, "
                           f"or make one device visible to each process (CUDA_VISIBLE_DEVICES)")

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": hvd.size(), "rank": hvd.rank()}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def set_world_ranks(self) -> None:
        """Called while the Trainer is built: Lightning's ``rank_zero_only`` (shared by both package names)
        decides which rank prints and logs."""
        from lightning_utilities.core.rank_zero import rank_zero_only

        _init()
        rank_zero_only.rank = hvd.rank()  # type: ignore[attr-defined, unused-ignore]

    # -- set-up: optimizers wrapped, rank 0's state everywhere ----------------------------------------------
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        assert self.model is not None
        # Every rank starts from rank 0's weights and buffers (for validate/test/predict too).
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if trainer.state.fn == "fit":
            for optimizer in self.optimizers:  # type: ignore[has-type, unused-ignore]  # Any without Lightning
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        passes = self._hvd_backward_passes or max(1, int(getattr(trainer, "accumulate_grad_batches", 1)))
        self._hvd_unwrap_all()
        optimizers = list(self.optimizers)  # type: ignore[has-type, unused-ignore]  # Any without Lightning
        wrapped = [self._hvd_wrap(opt, passes) for opt in optimizers]
        self._hvd_wrapped = [w for w, o in zip(wrapped, optimizers) if w is not o]
        if self._hvd_scale_lr:
            self._hvd_scale_learning_rates(wrapped)
        self.optimizers = wrapped

    def _hvd_wrap(self, optimizer: torch.optim.Optimizer, passes: int) -> torch.optim.Optimizer:
        if hasattr(optimizer, "skip_synchronize"):
            return optimizer   # configure_optimizers returned a DistributedOptimizer already
        assert self.lightning_module is not None
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = [(name, p) for name, p in self.lightning_module.named_parameters() if id(p) in ids]
        return hvd.DistributedOptimizer(optimizer, named_parameters=named, backward_passes_per_step=passes,
                                        **self._hvd_optimizer_kwargs)

    def _hvd_scale_learning_rates(self, optimizers: List[torch.optim.Optimizer]) -> None:
        """Lightning 1.x's Horovod behaviour, on request: every learning rate times the number of ranks."""
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * hvd.size()
        for config in self.lr_scheduler_configs:
            base_lrs = getattr(config.scheduler, "base_lrs", None)
            if base_lrs is not None:
                config.scheduler.base_lrs = [lr * hvd.size() for lr in base_lrs]

    # -- the step: gradients averaged after the closure's backward ------------------------------------------
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run Lightning's closure (forward, backward), wait for the averaged gradients, then take the step.

        The gradients are averaged before Lightning's ``on_before_optimizer_step`` and gradient clipping, which
        therefore see what every rank sees.
        """
        if not hasattr(optimizer, "skip_synchronize"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_synchronize() -> Any:
            result = closure()
            optimizer.synchronize()
            return result

        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    # -- collectives for metrics, callbacks and the loops ---------------------------------------------------
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """``tensor`` reduced over every rank: ``"mean"`` (default), ``"sum"``, ``"max"``, ``"min"``."""
        return _collectives.reduce(tensor, group, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        """Every rank's ``tensor``, stacked in rank order: shape ``(world_size, *tensor.shape)``."""
        return _collectives.all_gather(tensor, group, sync_grads)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        hvd.barrier()

    # -- the end of a run -----------------------------------------------------------------------------------
    def _hvd_unwrap_all(self) -> None:
        # A DistributedOptimizer's gradient hooks stay on the parameters while it lives: a later fit() on the same
        # model must not have the previous run's hooks start allreduces nobody waits for.
        for optimizer in self._hvd_wrapped:
            for handle in getattr(optimizer, "_hook_handles", []):
                handle.remove()
            if hasattr(optimizer, "_hook_handles"):
                optimizer._hook_handles = []
        self._hvd_wrapped = []

    def teardown(self) -> None:
        self._hvd_unwrap_all()
        super().teardown()

