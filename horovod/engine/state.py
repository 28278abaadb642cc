"""The one running engine of this process, held where every layer above the engine can reach it.

``horovod.common.basics`` starts and stops the engine (``init``/``shutdown``) and records it here; the engine's
own API (:mod:`horovod.engine.collectives`) and every binding read it through :func:`runtime`, so nothing in the
engine has to import the layer above it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:   # the runtime never imports this module, so this is no ring
    from horovod.engine.runtime import Runtime

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."

#: The running engine (a :class:`horovod.engine.runtime.Runtime`), or ``None``.
current: Optional["Runtime"] = None


def runtime() -> "Runtime":
    """The running engine.

    Raises:
        ValueError: not initialised.
    """
    rt = current
    if rt is None:
        raise ValueError(NOT_INITIALIZED)
    return rt
