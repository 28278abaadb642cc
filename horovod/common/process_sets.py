"""Process sets: collectives over a subset of the ranks.

``global_process_set`` (id 0) spans every rank.  Static sets are passed to ``hvd.init(process_sets=[...])`` and
get ids 1, 2, ... in order; dynamic ones are registered with :func:`add_process_set` (all ranks, same order)
when ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``init(process_sets="dynamic")``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Dict, List, Optional, Sequence, Union

from horovod.engine import ops
from horovod.engine import state as _state


class ProcessSet:
    """A set of global ranks that can run collectives among themselves.

    Args:
        ranks_or_comm: global ranks (any order; stored sorted) or an mpi4py communicator.

    Attributes:
        process_set_id: id once registered (``None`` before).
        ranks: sorted global ranks.
        mpi_comm: the communicator it was made from, if any.
    """

    def __init__(self, ranks_or_comm: Union[Sequence[int], object]):
        self.process_set_id: Optional[int] = None
        self.mpi_comm: Any = None   # an mpi4py communicator (mpi4py is optional, so untyped)
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            self.ranks: List[int] = _world_ranks_of(ranks_or_comm)
        else:
            if not isinstance(ranks_or_comm, Iterable):
                raise TypeError(f"ProcessSet takes a list of ranks or an mpi4py communicator, got {ranks_or_comm!r}")
            given = list(ranks_or_comm)
            self.ranks = sorted(int(r) for r in given)
            if len(set(self.ranks)) != len(self.ranks):
                raise ValueError(f"ProcessSet ranks must be unique, got {given}")

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks, or ``None`` before registration."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (``None`` if unregistered; ValueError-free: -1 if excluded)."""
        if self.process_set_id is None:
            return None
        me = _state.runtime().rank
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> Optional[bool]:
        """Whether this process is a member (``None`` before registration)."""
        if self.process_set_id is None:
            return None
        return _state.runtime().rank in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessSet) and other.ranks == self.ranks \
            and other.process_set_id == self.process_set_id

    def __hash__(self) -> int:
        return hash((tuple(self.ranks), self.process_set_id))


def _world_ranks_of(comm) -> List[int]:
    from mpi4py import MPI

    group = comm.Get_group()
    world = MPI.COMM_WORLD.Get_group()
    return sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

#: The registered sets of the running job by id (0 is the global set); filled by ``hvd.init`` and
#: :func:`add_process_set`, emptied by ``hvd.shutdown``.
_registry: Dict[int, ProcessSet] = {}


def registered_process_sets() -> Dict[int, ProcessSet]:
    return _registry


def _set_id(process_set: Optional[ProcessSet]) -> int:
    """The id collectives send for ``process_set`` (raises if it was never registered)."""
    if process_set is None:
        return 0
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} has not been registered: pass it to hvd.init(process_sets=[...]) or "
                         f"hvd.add_process_set() first.")
    return process_set.process_set_id


def op_name(prefix: str, name: Optional[str], process_set: Optional[ProcessSet]) -> str:
    """The tensor name a binding sends; unnamed ops are numbered in issue order within their process set."""
    from horovod.engine import collectives

    return collectives.tensor_name(prefix, name, _set_id(process_set))


def group_op_names(prefix: str, name: Optional[str], count: int, process_set: Optional[ProcessSet]):
    """Member names of a grouped op and the group's key (see :func:`horovod.engine.collectives.group_names`)."""
    from horovod.engine import collectives

    return collectives.group_names(prefix, name, count, _set_id(process_set))


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a new process set on every rank (collective: all ranks call it in the same order).

    Requires ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or ``init(process_sets="dynamic")``).

    Returns:
        the registered :class:`ProcessSet` with its id.

    Raises:
        ValueError: dynamic process sets are disabled, or a set with these ranks exists already.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    runtime = _state.runtime()
    if not runtime.config.dynamic_process_sets:
        raise ValueError("Dynamic process sets are disabled: set HOROVOD_DYNAMIC_PROCESS_SETS=1 or call "
                         "hvd.init(process_sets='dynamic') to use add_process_set / remove_process_set.")
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is already registered.")
    for existing in registered_process_sets().values():
        if existing.ranks == process_set.ranks:
            raise ValueError(f"A process set with ranks {process_set.ranks} is already registered "
                             f"(id {existing.process_set_id}).")
    if not process_set.ranks:
        raise ValueError("A process set needs at least one rank, got an empty list; pass the global ranks that "
                         "belong to it, e.g. hvd.add_process_set([0, 1]).")
    bad = [r for r in process_set.ranks if not 0 <= r < runtime.size]
    if bad:
        raise ValueError(f"Process set ranks {bad} are out of range for a job of size {runtime.size}.")
    from horovod.engine import collectives

    set_id = collectives.process_set_change(ops.ADD_PROCESS_SET, list(process_set.ranks))
    assert isinstance(set_id, int)   # adding answers the new id (removing answers whether it existed)
    process_set.process_set_id = set_id
    registered_process_sets()[set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (collective).  Returns False for the global set or an unknown one."""
    if process_set.process_set_id in (None, 0):
        return False
    if not _state.runtime().config.dynamic_process_sets:
        raise ValueError("Dynamic process sets are disabled: set HOROVOD_DYNAMIC_PROCESS_SETS=1 or call "
                         "hvd.init(process_sets='dynamic') to use add_process_set / remove_process_set.")
    from horovod.engine import collectives

    existed = collectives.process_set_change(ops.REMOVE_PROCESS_SET, process_set.process_set_id)
    registered_process_sets().pop(process_set.process_set_id, None)
    process_set._invalidate()
    return bool(existed)
