"""What ranks tell the coordinator (requests) and what it tells them back (responses).

Both travel pickled over authenticated control connections.  They are plain data: no tensors, only the
metadata the coordinator needs to check that ranks agree and to plan one execution order for everyone.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Tuple


def _pickled_as_tuple(cls):
    """Pickle instances as ``cls(*values)``: half the bytes and twice as fast to load as the default ``__dict__``."""
    names = tuple(f.name for f in fields(cls))

    def __reduce__(self):
        return cls, tuple([getattr(self, name) for name in names])

    cls.__reduce__ = __reduce__
    return cls


@_pickled_as_tuple
@dataclass
class Request:
    """One rank's announcement that a named collective is ready on its side.

    Attributes:
        rank: global rank of the sender.
        name: the tensor name (matches requests across ranks).
        kind: request kind (ops.ALLREDUCE, ...).
        dtype: engine dtype name.
        shape: the tensor's shape on this rank.
        op: reduce op (ops.Sum, ...), for reductions.
        root: root rank (global) for broadcast.
        prescale, postscale: scale factors for reductions.
        process_set: id of the process set.
        group: (the group's first tensor name, group size) for grouped ops, else None.
        splits: for alltoall, rows sent to each member of the set.
        payload: extra data (process-set ranks for ADD_PROCESS_SET), or the bytes of an inline allreduce.
        slot: the sender's response-cache slot holding this request, or -1 (see :mod:`horovod.engine.cache`).
        blocking: the caller waits on it right away (so it cannot issue anything else from that thread first);
            the coordinator uses it to tell a barrier against a collective from a late rank.
        device: the GPU the tensor lives on (this rank's index), or -1 for host memory.
    """

    rank: int
    name: str
    kind: int
    dtype: str = "float32"
    shape: Tuple[int, ...] = ()
    op: int = 1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    process_set: int = 0
    group: Optional[Tuple[str, int]] = None
    splits: Optional[Tuple[int, ...]] = None
    payload: object = None
    slot: int = -1
    blocking: bool = False
    device: int = -1


@_pickled_as_tuple
@dataclass
class Response:
    """An instruction every member of a process set executes, in the order the coordinator sent them.

    Attributes:
        kind: request kind, or ``ERROR``.
        names: tensors covered (several when fused).
        process_set: id of the process set.
        dtype, op, root, prescale, postscale: shared parameters of the tensors.
        shapes: the agreed shape of each tensor (joined ranks allocate zeros from it).
        first_dims: per tensor, the first dimension each member sent (allgather).
        splits: per tensor, the split matrix ``splits[src][dst]`` in rows (alltoall).
        error: the message every rank raises (kind ERROR).
        joined: ranks of the set that had joined when this was planned (they contribute zeros).
        last_joined: the rank that joined last (JOIN responses).
        payload: extra data (id of a new process set), or the reduced bytes of an inline allreduce.
        group: key of the explicit group the tensors belong to (``HOROVOD_DISABLE_GROUP_FUSION``).
        error_kind: what went wrong (ERROR): ``mismatch`` (ranks disagreed), ``stall`` (missing ranks past the
            stall shutdown time) or ``usage`` (a request no rank could have made valid); picks the exception.
        slots: per tensor, the response-cache slot the coordinator assigned to it (-1: none); every rank stores
            the tensor's response there, so that repeating it takes the warm path (:mod:`horovod.engine.rounds`).
        device: >= 0 when the tensors live on GPUs (the executor's device path), else -1.
    """

    kind: int
    names: List[str]
    process_set: int = 0
    dtype: str = "float32"
    op: int = 1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    shapes: List[Tuple[int, ...]] = field(default_factory=list)
    first_dims: List[List[int]] = field(default_factory=list)
    splits: List[List[List[int]]] = field(default_factory=list)
    error: Optional[str] = None
    joined: Tuple[int, ...] = ()
    last_joined: int = -1
    payload: object = None
    group: Optional[str] = None
    error_kind: str = "mismatch"
    slots: List[int] = field(default_factory=list)
    device: int = -1


ERROR = 8


@_pickled_as_tuple
@dataclass
class ControlMessage:
    """One frame on the control plane: requests up, responses down, or a shutdown notice.

    Attributes:
        requests: new requests (worker → coordinator), in full or as response-cache slots.
        responses: planned responses (coordinator → worker).
        shutdown: the sender is shutting down (or tells everyone to).
        failure: the shutdown is caused by a failure (peer died, crash), not an orderly ``shutdown()``.
        reason: why, for the error every pending collective gets.
        params: tuned knob values the coordinator broadcasts (autotune).
        round: with the warm path, the coordinator's last posted round: the responses run after that round's
            and before the next one's on every rank (:mod:`horovod.engine.rounds`).
        invalidate: response-cache slots every rank drops (before this message's responses assign any).
        fence: with the warm path across hosts, the last message the coordinator sent before posting round
            ``round + 1``: a rank that has it has every message run before that round (:mod:`horovod.engine.warm`).
    """

    requests: List[object] = field(default_factory=list)
    responses: List[Response] = field(default_factory=list)
    shutdown: bool = False
    failure: bool = False
    reason: str = ""
    params: Optional[Dict[str, object]] = None
    round: int = 0
    invalidate: List[int] = field(default_factory=list)
    fence: bool = False
