"""horovod.lightning: a Lightning 2.x strategy, ``Trainer(strategy="horovod")`` or ``strategy=HorovodStrategy()``.

Start the script with ``horovodrun -np N python train.py`` (or ``mpirun``); each process builds its ``Trainer`` and
the strategy joins the Horovod job (``hvd.init()``), shards the data loaders by rank, averages gradients with
``horovod.torch.DistributedOptimizer`` and broadcasts the initial state from rank 0.  See docs/lightning.md.

The name ``"horovod"`` is registered by ``import horovod`` (any horovod import does it; see
:mod:`horovod.lightning._registration`), so this package imports neither torch nor Lightning until
:class:`HorovodStrategy` or :class:`HorovodEnvironment` is used.  Both are the ``lightning`` package's; the classes
for the older ``pytorch_lightning`` package name are in :mod:`horovod.lightning.pl_strategy`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from horovod.lightning import _registration

if TYPE_CHECKING:
    from horovod.lightning.strategy import HorovodEnvironment, HorovodStrategy

__all__ = ["HorovodEnvironment", "HorovodStrategy"]

_registration.install()


def __getattr__(name: str) -> Any:
    # Lazily: ``import horovod`` imports this package (for the registration) and must not import torch/Lightning.
    if name in __all__:
        from horovod.lightning import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module 'horovod.lightning' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + __all__)
