"""horovod: distributed data-parallel training, drop-in for Horovod 0.28.1 scripts."""
from __future__ import annotations

from horovod.version import __version__  # noqa: F401
# Registers Trainer(strategy="horovod") with Lightning, now or whenever Lightning is imported (imports neither).
from horovod import lightning as _lightning  # noqa: F401,E402


def run(*args, **kwargs):
    """Launch ``func`` on several processes and return the per-rank results.

    See :func:`horovod.runner.run`; imported lazily so ``import horovod`` stays cheap.
    """
    from horovod.runner import run as _run

    return _run(*args, **kwargs)
