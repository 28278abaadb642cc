"""Horovod on Ray: run Horovod jobs on Ray actors (``RayExecutor``), statically or elastically, or on Ray Train
(``HorovodTrainer``, with its ``HorovodConfig``).

See docs/ray.md.  Needs ``ray`` (``pip install 'horovod-next[ray]'``); ``HorovodTrainer`` needs Ray Train
(``ray[train]``) and is imported only when first used, so ``RayExecutor`` users do not pay for it.
"""
from horovod.ray.elastic import ElasticRayExecutor
from horovod.ray.runner import RayExecutor
from horovod.ray.worker import BaseHorovodWorker

__all__ = ["RayExecutor", "BaseHorovodWorker", "ElasticRayExecutor", "HorovodTrainer", "HorovodConfig"]

# Lazily: importing ray.train pulls in pandas, pyarrow and pydantic.
_LAZY = {"HorovodTrainer": "horovod.ray.train", "HorovodConfig": "horovod.ray.train_backend"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'horovod.ray' has no attribute {name!r}")
