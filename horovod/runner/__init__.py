"""The launcher: ``horovodrun`` (:mod:`horovod.runner.launch`) and the Python API :func:`run`.

``run`` and ``_HorovodArgs`` are imported on first use, so that ``python -m horovod.runner.run_task`` (and
``import horovod.runner``) does not load the whole launcher first.
"""
from __future__ import annotations

from typing import Any

__all__ = ["run", "_HorovodArgs"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from horovod.runner import api

        return getattr(api, name)
    raise AttributeError(f"module 'horovod.runner' has no attribute {name!r}")
