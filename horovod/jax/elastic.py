"""Elastic training for JAX: :class:`JaxState` and the :func:`run` decorator.

.. code-block:: python

    import horovod.jax as hvd

    hvd.init()
    state = hvd.elastic.JaxState(params=params, opt_state=opt_state, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.params, state.opt_state, loss = train_step(state.params, state.opt_state, batch)
            state.commit()

    train(state)

JAX arrays are immutable, so a commit keeps references to the current trees (no copy) and a restore puts them
back; a sync broadcasts the trees as tensors (one bucketed call each) and the plain values as objects, from the
rank holding the newest commit.  After every reset JAX's compilation caches are cleared: jitted functions bake the
job's size and this process's rank into their programs (the shapes of allgather / reducescatter results), so they
must be traced again for the new membership.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax

from horovod.common.basics import init, rank, shutdown
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError
from horovod.jax.functions import broadcast_object
from horovod.jax.tree import broadcast_tree

__all__ = ["JaxState", "run"]

#: What the text of a failed jit callback contains when a collective failed (the engine's error classes).
_HOROVOD_MARKERS = ("HorovodInternalError", "PeerFailureError", "ShutdownError", "MismatchError", "StallError")


def _reset() -> None:
    shutdown()
    jax.clear_caches()   # re-trace jitted steps for the new size and rank
    init()


def _as_horovod_error(exc: BaseException) -> Optional[HorovodInternalError]:
    """A collective that failed inside ``jax.jit`` reaches Python as JAX's runtime error carrying the host
    callback's traceback; the engine's error class names in it mark it as a Horovod failure."""
    if isinstance(exc, HorovodInternalError):
        return None
    runtime_error = getattr(jax.errors, "JaxRuntimeError", None)
    if runtime_error is not None and isinstance(exc, runtime_error) and any(m in str(exc) for m in _HOROVOD_MARKERS):
        return HorovodInternalError(str(exc))
    return None


def translate_errors(func: Callable) -> Callable:
    """Wrap ``func`` so that Horovod failures inside jitted code raise ``HorovodInternalError``."""

    @functools.wraps(func)
    def translated(*args: Any, **kwargs: Any):
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            error = _as_horovod_error(exc)
            if error is not None:
                raise error from exc
            raise

    return translated


def run(func: Callable) -> Callable:
    """Decorator: run ``func(state, ...)`` and, whenever workers fail or hosts change, restore (failure) or keep
    (host change) the state, re-initialise Horovod with the new workers, synchronise the state and call ``func``
    again.  Failures of collectives inside ``jax.jit`` count as ``HorovodInternalError``."""
    return run_fn(translate_errors(func), _reset)


class JaxState(ObjectState):
    """Elastic state of a JAX model: parameters and optimizer state (pytrees of arrays), plus plain values.

    Args:
        params: the parameters (any pytree of arrays), read and assigned as ``state.params``.
        opt_state: the optax optimizer state (any pytree of arrays), as ``state.opt_state``.
        kwargs: plain values (``epoch=0, batch=0`` ...), read and assigned as attributes; they are deep-copied at
            each commit and synchronised with ``broadcast_object``.  Pytrees of arrays among them are better
            passed as ``params`` / ``opt_state`` (or a dict in one of them): those travel as tensors.
    """

    _TREES = ("params", "opt_state")

    def __init__(self, params: Any = None, opt_state: Any = None, **kwargs: Any):
        self.params = params
        self.opt_state = opt_state
        self._saved_trees = (params, opt_state)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        self._saved_trees = (self.params, self.opt_state)   # immutable arrays: references are a snapshot
        super().save()

    def restore(self) -> None:
        self.params, self.opt_state = self._saved_trees
        super().restore()

    def sync(self) -> None:
        root = getattr(self, "_sync_root", 0)
        for attr in self._TREES:
            value = getattr(self, attr)
            if jax.tree_util.tree_leaves(value):
                setattr(self, attr, broadcast_tree(value, root, name=f"elastic.{attr}"))
        self._saved_trees = (self.params, self.opt_state)   # what restore() returns to: the synced values
        super().sync()
