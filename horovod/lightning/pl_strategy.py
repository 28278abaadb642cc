"""``HorovodStrategy`` for the older ``pytorch_lightning`` package name (``import pytorch_lightning as pl``).

Usage, in a script started by ``horovodrun -np 4 python train.py``::

    import pytorch_lightning as pl
    import horovod.lightning  # noqa: F401  (any horovod import registers the name)

    trainer = pl.Trainer(strategy="horovod", max_epochs=10)   # or strategy=HorovodStrategy(...)
    trainer.fit(model, train_loader, val_loader)

What the strategy does is described in :mod:`horovod.lightning._base` and docs/lightning.md.
"""
from __future__ import annotations

from lightning_fabric.plugins import ClusterEnvironment
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry

from horovod.lightning._base import _HorovodEnvironmentMixin, _HorovodStrategyMixin

__all__ = ["HorovodEnvironment", "HorovodStrategy"]


class HorovodEnvironment(_HorovodEnvironmentMixin, ClusterEnvironment):
    """Lightning's cluster environment for a Horovod job: ranks and sizes from ``horovod.torch``."""


# misc: the mixin is type-checked as lightning.pytorch's ParallelStrategy, this base is pytorch_lightning's copy.
class HorovodStrategy(_HorovodStrategyMixin, ParallelStrategy):  # type: ignore[misc, unused-ignore]
    """Data-parallel training over the ranks ``horovodrun`` (or ``mpirun``) started: one process per device
    (the same as :class:`horovod.lightning.strategy.HorovodStrategy`, for ``pytorch_lightning``).

    Args:
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for Lightning's other strategies (the
            Trainer fills them in; ``parallel_devices`` only chooses CPU or GPU: each process uses the device of
            its local rank).
        compression, op, gradient_predivide_factor, groups, sparse_as_dense: passed to
            ``horovod.torch.DistributedOptimizer`` for every optimizer ``configure_optimizers`` returns.
        backward_passes_per_step: the optimizer's; default: the Trainer's ``accumulate_grad_batches``.
        scale_learning_rate: multiply every learning rate (and scheduler base rate) by the number of ranks, as
            Lightning 1.x's Horovod strategy always did. Default ``False``, as Lightning's DDP strategy.
    """

    _environment_class = HorovodEnvironment


HorovodStrategy.register_strategies(StrategyRegistry)
