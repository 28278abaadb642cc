"""Elastic training on the worker side: state that survives resets, and the retry loop around training.

``run_fn`` wraps a training function.  When a collective fails (a peer died) the last committed state is
restored; when hosts were added or removed the current state is kept.  Either way the engine is shut down and
re-initialised with the new membership, and the state is then *always* synchronised — a reset never skips that
step, so survivors and newcomers always agree on what was committed.

The synchronisation comes from the rank holding the newest commit (the lowest such rank; normally the new rank
0, the oldest survivor).  A collective can fail on some ranks after it completed on others, so one survivor may
have committed a step another has not; taking the newest commit means no committed step is ever rolled back.
"""
from __future__ import annotations

import copy
import functools
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Type

from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

logger = logging.getLogger(__name__)

# Distributed optimizers (and tapes) of every binding, by id: each has ``_hvd_reset()``, which drops what a step
# broken by a failure left behind (pending handles, "synchronised" flags, pass counters).  Weak: registering never
# keeps an optimizer alive.
_distributed: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def register_distributed(obj: Any) -> None:
    """Have the elastic loop call ``obj._hvd_reset()`` at every reset (bindings register their optimizers)."""
    try:
        _distributed[id(obj)] = obj
    except TypeError:   # an object that cannot be weakly referenced: its binding resets it another way
        logger.debug("elastic: %s cannot be registered for resets (no weak references)", type(obj).__name__)


def reset_distributed() -> None:
    """Make every registered distributed optimizer as fresh as after construction.

    A failure can strike in the middle of a step (a peer dies while this rank is inside ``loss.backward()``):
    some gradients were handed to the engine, others not, and the engine that held them is gone.  Restoring the
    committed state brings back weights and optimizer slots, but not that bookkeeping; left behind, the next
    ``zero_grad()`` or backward pass would take the broken step for one still in progress.
    """
    for obj in list(_distributed.values()):
        try:
            obj._hvd_reset()
        except Exception:  # noqa: BLE001 - one broken object must not keep the others stale
            logger.exception("elastic: resetting %s after a failure failed", type(obj).__name__)


def _settle_device_work() -> None:
    """The GPU collectives the state was computed from must have completed, without error, before it is saved:
    an aborted collective leaves partial sums behind (its failure rolls back to the last commit instead)."""
    from horovod.engine import state as engine_state

    runtime = engine_state.current
    executor = getattr(runtime, "executor", None)
    if executor is None:
        return
    try:
        executor.settle_devices()
    except RuntimeError as exc:   # the device plane failed: a TransportError
        raise HorovodInternalError(f"commit(): a GPU collective failed, the state is not saved: {exc}") from exc


class State:
    """Base of every elastic state.

    Args:
        bcast_object: ``fn(obj, root_rank=0) -> obj`` of the binding.
        get_rank: ``fn() -> int`` of the binding.
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int]):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: List[Callable[[], None]] = []
        self._commits = 0      # commits in this state's lineage: the newest one wins at a reset
        self._sync_root = 0    # rank that sync() broadcasts from; chosen by run_fn before each sync

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions called after every reset (e.g. to rescale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: Any) -> None:
        """Kept for compatibility; host changes are read from the driver in :meth:`check_host_updates`."""

    def commit(self) -> None:
        """Save the state in memory (the point a failure rolls back to), then check for host changes."""
        _settle_device_work()
        self.save()
        self._commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank together when the driver changed the hosts.

        Rank 0 asks the driver and broadcasts the answer, so all ranks decide the same way.
        """
        from horovod.common import basics
        from horovod.engine import membership

        runtime = basics.runtime()
        if runtime.epoch is None:
            return
        # Every rank passes a value of the same type: bindings name the broadcast after the object's type.
        info = {"version": -1, "removal_only": False}
        if basics.rank() == 0:
            info = membership.hosts_version(runtime.store)
        info = self._bcast_object(info, root_rank=0) if basics.size() > 1 else info
        if info["version"] > runtime.epoch.hosts_version:
            raise HostsUpdatedInterrupt(bool(info.get("removal_only", False)))

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Hook for subclasses (e.g. re-partition a sampler); called after each reset."""


class ObjectState(State):
    """State made of plain Python values, given as keyword arguments and kept as attributes.

    ``sync()`` broadcasts them from rank 0; ``save()`` / ``restore()`` keep a deep copy in memory.
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int], **kwargs: Any):
        self._saved_state: Dict[str, Any] = kwargs
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, root_rank=self._sync_root)
            self._set_attrs()


#: How many times a worker retries joining a new epoch whose rendezvous failed (a member died meanwhile).
_JOIN_RETRIES = 3


def _cause(exc: BaseException, kind: Type[BaseException]) -> Optional[BaseException]:
    seen = set()
    link: Optional[BaseException] = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, kind):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _sync_from_newest(state: State) -> None:
    """``state.sync()`` from the lowest rank holding the newest commit (everyone adopts its commit count)."""
    from horovod.common import basics, objects

    root = 0
    if basics.size() > 1:
        counts = objects.allgather_object(int(getattr(state, "_commits", 0)), name="elastic.commits")
        root = counts.index(max(counts))
        state._commits = counts[root]
    state._sync_root = root
    state.sync()


def _rejoin(reset: Callable[[], None]) -> None:
    """Run ``reset`` (shut down, join the next epoch), retrying when the new epoch's rendezvous fails.

    A worker the driver dropped from the job exits quietly (status 0): its host was removed.
    """
    from horovod.engine import membership

    for attempt in range(_JOIN_RETRIES + 1):
        try:
            reset()
            return
        except Exception as exc:  # noqa: BLE001 - init() wraps the cause; we classify it below
            removed = _cause(exc, membership.RemovedFromJob)
            if removed is not None:
                logger.warning("elastic: %s; this worker exits", removed)
                raise SystemExit(0) from None
            if _cause(exc, membership.AssignmentTimeout) is not None or attempt == _JOIN_RETRIES:
                raise
            # A member of the new epoch died before it connected: the driver will publish another epoch.
            logger.warning("elastic: joining the new epoch failed (%s); waiting for the next one", exc)


def run_fn(func: Callable, reset: Callable[[], None]) -> Callable:
    """Wrap ``func(state, *args, **kwargs)`` in the elastic retry loop.

    Args:
        func: the training function; its first argument is the :class:`State`.
        reset: re-initialises the engine with the new membership (``shutdown(); init()``).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any):
        from horovod.common import basics

        resets = 0
        while True:
            try:
                _sync_from_newest(state)
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                logger.warning("elastic: collective failed (%s); restoring the last commit", exc)
                reset_distributed()
                state.restore()
            except HostsUpdatedInterrupt:
                logger.info("elastic: hosts changed; resetting with the current state")
                reset_distributed()
            resets += 1
            _rejoin(reset)
            logger.info("elastic: reset %d done: rank %d of %d", resets, basics.rank(), basics.size())
            state.on_reset()

    return wrapper


def default_reset() -> None:
    """Shut the engine down and join the driver's next epoch."""
    from horovod.common import basics

    basics.shutdown()
    basics.init()
