"""The framework-neutral collective API on numpy arrays.

Every binding (numpy, torch, tensorflow, mxnet, keras, jax) converts its tensors to numpy views and calls these
functions, the one seam between the bindings and the engine; they validate arguments and enqueue entries on the
running engine under the names the binding computed once.  Each returns a :class:`Handle`; ``handle.wait()``
gives the result.

``attended=True`` says the caller waits for the handle right away: the waiting thread then drives the collective
itself and the engine does not wake its background thread for it (on a small host waking a thread costs more than
the whole small collective); left ``False``, the background thread makes progress while the caller computes.

All ranks of the process set must call each collective, in the same order (unnamed tensors are matched by
issue order).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from horovod.engine import ops, state
from horovod.engine.device import DeviceArray, HostOrDevice
from horovod.engine.errors import InvalidArgumentError, NameInFlightError
from horovod.engine.handles import Entry, Handle
from horovod.engine.messages import Request
from horovod.engine.naming import JOIN_NAME, group_names, reset_names, tensor_name  # noqa: F401  (the engine API)

if TYPE_CHECKING:   # the runtime never imports this module
    from horovod.engine.runtime import Runtime


def _runtime():
    return state.runtime()


def _contiguous(a) -> HostOrDevice:
    """A C-contiguous host array, or a device array as it is (bindings hand those over contiguous)."""
    if isinstance(a, DeviceArray):
        return a
    a = np.asarray(a)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _ndim(tensor: HostOrDevice) -> int:
    """``np.ndim`` (two Python calls) where the tensor has no ``ndim`` of its own (typed for device arrays too)."""
    return tensor.ndim if isinstance(tensor, (np.ndarray, DeviceArray)) else np.ndim(tensor)


def _enqueue(kind: int, tensors: Sequence[HostOrDevice], names: Sequence[str], *, process_set: int,
             outputs: Optional[Sequence[Optional[HostOrDevice]]] = None,
             dtypes: Optional[Sequence[Optional[str]]] = None, op: int = ops.Sum, root: int = -1,
             prescale: float = 1.0, postscale: float = 1.0,
             splits: Optional[Sequence[Optional[Sequence[int]]]] = None, grouped: bool = False,
             single: bool = False, attended: bool = False) -> Handle:
    runtime = state.runtime()
    handle = Handle(len(tensors), list(names), single)
    engine = runtime.state   # its fields, not the runtime's properties: this runs on every collective
    inline_limit = engine.config.inline_bytes if kind == ops.ALLREDUCE and op != ops.Adasum else 0
    # Ranks agree on member names, so the first name keys the group on the coordinator.
    group = (names[0], len(tensors)) if grouped and tensors else None
    entries = []
    for i, given in enumerate(tensors):
        # The bindings' views are C-contiguous numpy arrays already: the common case skips the conversion.
        host = type(given) is np.ndarray and given.flags.c_contiguous
        tensor = given if host else _contiguous(given)
        req = Request(rank=engine.rank, name=names[i], kind=kind,
                      dtype=ops.dtype_name(tensor, dtypes[i] if dtypes else None), shape=tuple(tensor.shape),
                      op=op, root=root, prescale=float(prescale), postscale=float(postscale), process_set=process_set,
                      group=group, splits=_splits_of(splits, i) if splits else None,
                      device=tensor.device if isinstance(tensor, DeviceArray) else -1)
        if tensor.nbytes <= inline_limit and isinstance(tensor, np.ndarray):   # not on a device
            # Tiny reductions ride along with the request; the coordinator reduces them (see negotiation).
            req.payload = tensor.tobytes()
        entries.append(Entry(req, tensor, outputs[i] if outputs else None, handle, i))
    while True:
        try:
            runtime.enqueue(entries, attended)
            return handle
        except NameInFlightError:
            if not attended:
                raise
            _after_same_names(runtime, entries)


def _after_same_names(runtime: "Runtime", entries: Sequence[Entry]) -> None:
    """A blocking call whose name another thread of this rank has in flight waits for that collective, then runs
    as the next one of that name (issue 38, E3). Refusing it instead depends on timing: where the first call had
    already finished, the second is a new collective, so the ranks would disagree on how many there are and one
    would hang. Waiting gives every rank the same collectives whichever order its threads came in. (The other
    collective may have finished since the refusal: then there is nothing to wait for, and the caller retries.)"""
    engine = runtime.state
    with engine.lock:
        first = [engine.inflight.get((e.request.process_set, e.request.name)) for e in entries]
    handles = {id(e.handle): e.handle for e in first if e is not None}
    for other in handles.values():
        try:
            other.wait()   # drives it when nobody else does; its failure is its own caller's to report
        except Exception:  # noqa: BLE001  (the retried enqueue raises if the engine failed)
            pass


def _splits_of(splits: Optional[Sequence[Optional[Sequence[int]]]], i: int) -> Optional[tuple]:
    rows = splits[i] if splits else None
    return tuple(map(int, rows)) if rows is not None else None


def _check_op(op: int, process_set: int, what: str = "allreduce") -> None:
    if op not in ops.OP_NAMES:
        raise InvalidArgumentError(f"Unknown reduction op {op!r}; use hvd.Sum, hvd.Average, hvd.Min, hvd.Max, "
                                   f"hvd.Product or hvd.Adasum.")
    if op == ops.Adasum:
        runtime = _runtime()
        size = len(runtime.sets[process_set].ranks) if process_set in runtime.sets else runtime.size
        if process_set != 0:
            raise NotImplementedError("Adasum is only supported on the global process set.")
        if size & (size - 1):
            raise NotImplementedError(f"Adasum requires a power-of-two number of ranks; this job has {size}.")


def allreduce_async(tensors: Sequence[HostOrDevice], names: Sequence[str], *, op: int = ops.Average,
                    prescale: float = 1.0, postscale: float = 1.0, process_set: int = 0,
                    outputs: Optional[Sequence[Optional[HostOrDevice]]] = None,
                    dtypes: Optional[Sequence[Optional[str]]] = None, grouped: bool = False,
                    attended: bool = False) -> Handle:
    """Reduce each tensor across the process set (in place when ``outputs[i] is tensors[i]``; no other output may
    overlap its tensor: the fast lane reads a rank's own payload from the tensor while it writes the output)."""
    if op == ops.Adasum or op not in ops.OP_NAMES:   # (the common ops: no call on every training step)
        _check_op(op, process_set)
    return _enqueue(ops.ALLREDUCE, tensors, names, process_set=process_set, outputs=outputs, dtypes=dtypes, op=op,
                    prescale=prescale, postscale=postscale, grouped=grouped, single=not grouped,
                    attended=attended)


def allgather_async(tensors: Sequence[HostOrDevice], names: Sequence[str], *, process_set: int = 0,
                    dtypes: Optional[Sequence[Optional[str]]] = None, grouped: bool = False,
                    attended: bool = False) -> Handle:
    """Concatenate each tensor across ranks along dimension 0 (first dimensions may differ per rank)."""
    for t in tensors:
        if _ndim(t) == 0:
            raise InvalidArgumentError("allgather needs a tensor with at least one dimension; got a scalar. "
                             "Reshape it to [1] first.")
    return _enqueue(ops.ALLGATHER, tensors, names, process_set=process_set, dtypes=dtypes, grouped=grouped,
                    single=not grouped, attended=attended)


def broadcast_async(tensors: Sequence[HostOrDevice], names: Sequence[str], root_rank: int, *, process_set: int = 0,
                    outputs: Optional[Sequence[Optional[HostOrDevice]]] = None,
                    dtypes: Optional[Sequence[Optional[str]]] = None, grouped: bool = False,
                    attended: bool = False) -> Handle:
    """Copy the root's tensors to every rank; ``root_rank`` is a global rank."""
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise InvalidArgumentError(f"broadcast root_rank {root_rank!r} is invalid: expected an integer global rank.")
    # The root's range and membership are checked by the coordinator, so that a root wrong on one rank only fails
    # every rank instead of leaving the others waiting.
    return _enqueue(ops.BROADCAST, tensors, names, process_set=process_set, outputs=outputs, dtypes=dtypes,
                    root=int(root_rank), grouped=grouped, single=not grouped, attended=attended)


def alltoall_async(tensor: HostOrDevice, name: str, splits: Optional[Sequence[int]] = None, *, process_set: int = 0,
                   dtype: Optional[str] = None, attended: bool = False) -> Handle:
    """Send rows ``splits[p]`` to set member p and receive theirs; result ``(output, received_splits)``."""
    runtime = _runtime()
    pset = runtime.sets.get(process_set)
    members = len(pset.ranks) if pset is not None else runtime.size
    array = _contiguous(tensor)
    if array.ndim == 0:
        raise InvalidArgumentError("alltoall needs a tensor with at least one dimension; got a scalar.")
    rows = array.shape[0]
    if splits is None:
        if rows % members:
            raise InvalidArgumentError(f"alltoall without splits needs the first dimension ({rows}) to be divisible "
                                       f"by the number of ranks ({members}); pass splits=[...] for an uneven "
                                       f"exchange.")
        split_list = [rows // members] * members
    else:
        split_list = [int(s) for s in np.asarray(splits).reshape(-1)]
        if len(split_list) != members:
            raise InvalidArgumentError(f"alltoall splits has {len(split_list)} entries; expected one per rank of the "
                                       f"process set ({members}).")
        if any(s < 0 for s in split_list):
            raise InvalidArgumentError(f"alltoall splits must be non-negative, got {split_list}.")
        if sum(split_list) != rows:
            raise InvalidArgumentError(f"alltoall splits sum to {sum(split_list)} but the tensor's first dimension "
                                       f"is {rows}.")
    return _enqueue(ops.ALLTOALL, [array], [name], process_set=process_set, dtypes=[dtype] if dtype else None,
                    splits=[split_list], single=True, attended=attended)


def reducescatter_async(tensors: Sequence[HostOrDevice], names: Sequence[str], *, op: int = ops.Average,
                        prescale: float = 1.0, postscale: float = 1.0, process_set: int = 0,
                        dtypes: Optional[Sequence[Optional[str]]] = None, grouped: bool = False,
                        attended: bool = False) -> Handle:
    """Reduce across ranks and give rank r its block of rows (lower ranks get the extra rows)."""
    if op not in (ops.Sum, ops.Average):
        raise InvalidArgumentError(f"reducescatter supports only Sum and Average, got {ops.OP_NAMES.get(op, op)}.")
    for t in tensors:
        if _ndim(t) == 0:
            raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension; got a scalar.")
    return _enqueue(ops.REDUCESCATTER, tensors, names, process_set=process_set, dtypes=dtypes, op=op,
                    prescale=prescale, postscale=postscale, grouped=grouped, single=not grouped,
                    attended=attended)


def barrier(process_set: int = 0) -> None:
    """Return once every rank of the process set has reached the barrier."""
    runtime = _runtime()
    handle = Handle(1, ["barrier"], single=True)
    req = Request(rank=runtime.rank, name=tensor_name("barrier", None, process_set), kind=ops.BARRIER,
                  process_set=process_set)
    runtime.enqueue([Entry(req, None, None, handle)], attended=True)
    handle.wait()


def join_async(attended: bool = False) -> Handle:
    """Announce that this rank has no more data; completes when all ranks joined, with the last joiner's rank."""
    runtime = _runtime()
    handle = Handle(1, ["join"], single=True)
    req = Request(rank=runtime.rank, name=JOIN_NAME, kind=ops.JOIN, process_set=0)
    runtime.enqueue([Entry(req, None, None, handle)], attended)
    return handle


def process_set_change(kind: int, payload) -> object:
    """Negotiate adding (ranks) or removing (id) a process set on every rank; returns the id / whether it existed."""
    runtime = _runtime()
    handle = Handle(1, ["process_set"], single=True)
    name = tensor_name("add_process_set" if kind == ops.ADD_PROCESS_SET else "remove_process_set", None)
    req = Request(rank=runtime.rank, name=name, kind=kind, process_set=0, payload=payload)
    runtime.enqueue([Entry(req, None, None, handle)], attended=True)
    return handle.wait()
