"""The collectives every binding shares, written once over :class:`~horovod.common.adapter.TensorAdapter`.

Each operation goes validate → view → enqueue → wrap the result: the functions below take a binding's adapter,
turn its tensors into engine views, call :mod:`horovod.engine.collectives` and return ``(handle, finish)`` where
``finish(raw)`` builds the binding's result once the handle completed (for in-place forms: writes staged results
back and returns the caller's tensors).  :func:`complete` waits for such a pair (the blocking bindings: mxnet);
:class:`HandleCollectives` gives them the public signatures of ``horovod.torch`` (``horovod.numpy`` and
``horovod.torch`` expose its bound methods as their functions): asynchronous forms behind integer handles,
blocking forms that return the result directly.  Every call of a binding settles its process set, names and
reduction op once (``start_*``), so that the hot path of a small blocking allreduce stays short.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

from horovod.common import basics
from horovod.common.adapter import TensorAdapter, overrides, raise_collective_error, wait
from horovod.common.basics import Average
from horovod.common.process_sets import ProcessSet, _set_id, global_process_set
from horovod.common.util import handle_average_backwards_compatibility
from horovod.engine import collectives
from horovod.engine.handles import Handle, HandleTable
from horovod.engine.naming import group_names, tensor_name

Pending = Tuple[Handle, Callable[[Any], Any]]


def complete(pending: Pending) -> Any:
    """Wait for ``(handle, finish)`` and return the binding's result (failures as ``collective_error`` says)."""
    handle, finish = pending
    return finish(wait(handle))


# -- one function per collective: views in, (handle, finish) out ----------------------------------------------
def allreduce(adapter: TensorAdapter, tensors: Sequence[Any], names: List[str], op: int, prescale: float,
              postscale: float, set_id: int, inplace: bool, grouped: bool, attended: bool = False) -> Pending:
    if not grouped:   # one tensor, on every training step: no list comprehensions
        view = adapter.inplace_view(tensors[0]) if inplace else adapter.view(tensors[0])
        views = [view]
        outputs = [view.array if inplace else adapter.fresh_output(view)]
        arrays = [view.array]
        dtypes: Optional[List[Optional[str]]] = None if view.dtype is None else [view.dtype]
    else:
        views = [adapter.inplace_view(t) for t in tensors] if inplace else [adapter.view(t) for t in tensors]
        arrays = [v.array for v in views]
        outputs = arrays if inplace else [adapter.fresh_output(v) for v in views]
        dtypes = overrides(views)
    handle = collectives.allreduce_async(arrays, names, op=op, prescale=prescale,
                                         postscale=postscale, process_set=set_id, outputs=outputs,
                                         dtypes=dtypes, grouped=grouped, attended=attended)
    if grouped:
        if inplace:
            return handle, lambda _raw: [adapter.finish_inplace(v) for v in views]
        return handle, lambda _raw: [adapter.result(o, v) for o, v in zip(outputs, views)]
    view, output = views[0], outputs[0]
    if inplace:
        return handle, lambda _raw: adapter.finish_inplace(view)
    return handle, lambda _raw: adapter.result(output, view)


def _new_results(adapter: TensorAdapter, views, grouped: bool) -> Callable[[Any], Any]:
    """``finish`` for collectives whose engine allocates the outputs (allgather, reducescatter)."""
    if grouped:
        return lambda raw: [adapter.result(a, v) for a, v in zip(raw, views)]
    view = views[0]
    return lambda raw: adapter.result(raw, view)


def allgather(adapter: TensorAdapter, tensors: Sequence[Any], names: List[str], set_id: int,
              grouped: bool, attended: bool = False) -> Pending:
    views = [adapter.view(t) for t in tensors]
    handle = collectives.allgather_async([v.array for v in views], names, process_set=set_id,
                                         dtypes=overrides(views), grouped=grouped, attended=attended)
    return handle, _new_results(adapter, views, grouped)


def reducescatter(adapter: TensorAdapter, tensors: Sequence[Any], names: List[str], op: int, prescale: float,
                  postscale: float, set_id: int, grouped: bool, attended: bool = False) -> Pending:
    views = [adapter.view(t) for t in tensors]
    handle = collectives.reducescatter_async([v.array for v in views], names, op=op, prescale=prescale,
                                             postscale=postscale, process_set=set_id, dtypes=overrides(views),
                                             grouped=grouped, attended=attended)
    return handle, _new_results(adapter, views, grouped)


def broadcast(adapter: TensorAdapter, tensor: Any, name: str, root_rank: int, set_id: int,
              inplace: bool, attended: bool = False) -> Pending:
    view = adapter.inplace_view(tensor) if inplace else adapter.view(tensor)
    output = view.array if inplace else adapter.fresh_output(view)
    handle = collectives.broadcast_async([view.array], [name], root_rank, process_set=set_id, outputs=[output],
                                         dtypes=overrides([view]), attended=attended)
    if inplace:
        return handle, lambda _raw: adapter.finish_inplace(view)
    return handle, lambda _raw: adapter.result(output, view)


def grouped_broadcast(adapter: TensorAdapter, tensors: Sequence[Any], names: List[str], root_rank: int, set_id: int,
                      attended: bool = False) -> Pending:
    """Broadcast ``tensors`` as one group (negotiated and fused together) into new results; a list."""
    views = [adapter.view(t) for t in tensors]
    outputs = [adapter.fresh_output(v) for v in views]
    handle = collectives.broadcast_async([v.array for v in views], names, root_rank, process_set=set_id,
                                         outputs=outputs, dtypes=overrides(views), grouped=True, attended=attended)
    return handle, lambda _raw: [adapter.result(o, v) for o, v in zip(outputs, views)]


def alltoall(adapter: TensorAdapter, tensor: Any, name: str, splits: Any, set_id: int,
             attended: bool = False) -> Pending:
    """Result ``(output, received_splits)`` in the binding's types."""
    view = adapter.view(tensor)
    handle = collectives.alltoall_async(view.array, name, adapter.splits(splits), process_set=set_id,
                                        dtype=view.dtype, attended=attended)

    def finish(raw):
        out, received = raw
        return adapter.result(out, view), adapter.received_splits(received)

    return handle, finish


# -- lifecycle: every binding's init()/shutdown() ------------------------------------------------------------
def init(*args, **kwargs) -> None:
    """Start Horovod (see :func:`horovod.common.basics.init`); forgets every binding's handles of a previous run."""
    HandleTable.clear_all()
    basics.init(*args, **kwargs)


def shutdown() -> None:
    """Stop Horovod; pending operations fail and every binding's handles are forgotten.  ``init()`` may follow."""
    basics.shutdown()
    HandleTable.clear_all()


# -- the integer-handle API (horovod.numpy, horovod.torch) ----------------------------------------------------
def _collectives_of(module: str) -> "HandleCollectives":
    return importlib.import_module(module)._collectives


#: The methods a handle-based binding module (``horovod.numpy``, ``horovod.torch``) exposes as its functions.
MODULE_FUNCTIONS = (
    "init", "shutdown", "poll", "synchronize", "allreduce_async", "allreduce_async_", "allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_allreduce_", "allgather_async",
    "grouped_allgather_async", "broadcast_async", "broadcast_async_", "broadcast_", "alltoall_async",
    "reducescatter_async", "grouped_reducescatter_async", "join", "barrier")


class HandleCollectives:
    """A binding's asynchronous collectives behind integer handles, and ``poll`` / ``synchronize`` / ``init``.

    One per binding module (``_collectives``), whose public functions are this object's bound methods.  All of
    them share one handle semantics: a failed collective raises ``HorovodInternalError`` from ``synchronize``
    (see :func:`horovod.common.adapter.collective_error`); ``poll`` of an unknown handle raises ``ValueError``
    and ``synchronize`` of one returns ``None``; ``init()`` and ``shutdown()`` forget every binding's handles.
    """

    def __init__(self, adapter: TensorAdapter, module: str):
        self.adapter = adapter
        self.handles = HandleTable()
        self._module = module

    def __reduce__(self):
        # Functions pickled by value (cloudpickle) may reference these bound methods: find them by module.
        return _collectives_of, (self._module,)

    init = staticmethod(init)
    shutdown = staticmethod(shutdown)

    # -- lifecycle and handles -------------------------------------------------------------------------------
    def poll(self, handle: int) -> bool:
        """True once the operation behind ``handle`` has completed; :func:`synchronize` will then not block.

        Raises:
            ValueError: ``handle`` is unknown (never issued, or already synchronized).
        """
        return self.handles.poll(handle)

    def synchronize(self, handle: int):
        """Wait for an asynchronous operation and return its result.

        Returns:
            The output tensor (the input tensor itself for in-place operations), a list for grouped operations,
            ``(output, received_splits)`` for alltoall, or ``None`` for an unknown handle.

        Raises:
            HorovodInternalError: the collective failed on this or another rank (mismatched arguments across
                ranks, a peer that died, shutdown).
        """
        try:
            return self.handles.synchronize(handle)
        except (RuntimeError, OSError) as exc:
            raise_collective_error(exc)

    def run(self, pending: Pending) -> Any:
        """Wait for a blocking call's ``(handle, finish)`` and return its result: no integer handle is created only
        to be looked up on the next line.  Failures raise as from :meth:`synchronize`."""
        handle, finish = pending
        try:
            return finish(handle.wait())
        except (RuntimeError, OSError) as exc:
            raise_collective_error(exc)

    # -- the shared path: names and the op settled once, then (handle, finish) ---------------------------------
    @staticmethod
    def _names(prefix: str, name: Optional[str], count: int, set_id: int, grouped: bool) -> List[str]:
        if grouped:
            return group_names(f"grouped_{prefix}", name, count, set_id)[0]
        return [tensor_name(prefix, name, set_id)]

    def start_allreduce(self, tensors: Sequence[Any], name: Optional[str], op, average, prescale_factor: float,
                        postscale_factor: float, process_set: ProcessSet, inplace: bool, grouped: bool,
                        attended: bool = False) -> Pending:
        """Start an allreduce of ``tensors`` (one, or a group); every allreduce of this binding comes here.

        ``op`` / ``average`` are the public arguments; a caller that settled them already passes the op and
        ``average=None``, and the ``average=`` shim is not run again. ``attended``: the caller waits right away
        (every blocking form; see :mod:`horovod.engine.collectives`).
        """
        set_id = 0 if process_set is global_process_set else _set_id(process_set)
        names = self._names("allreduce", name, len(tensors), set_id, grouped) if grouped else \
            [tensor_name("allreduce", name, set_id)]
        if average is not None:   # the deprecated ``average=``: the shim checks it against ``op`` and warns
            op = handle_average_backwards_compatibility(op, average)
        elif op is None:
            op = Average
        return allreduce(self.adapter, tensors, names, op, prescale_factor, postscale_factor, set_id, inplace,
                         grouped, attended)

    def start_allgather(self, tensors: Sequence[Any], name: Optional[str], process_set: ProcessSet,
                        grouped: bool, attended: bool = False) -> Pending:
        set_id = _set_id(process_set)
        return allgather(self.adapter, tensors, self._names("allgather", name, len(tensors), set_id, grouped),
                         set_id, grouped, attended)

    def start_broadcast(self, tensor, root_rank: int, name: Optional[str], process_set: ProcessSet,
                        inplace: bool, attended: bool = False) -> Pending:
        set_id = _set_id(process_set)
        return broadcast(self.adapter, tensor, tensor_name("broadcast", name, set_id), root_rank, set_id, inplace,
                         attended)

    def start_alltoall(self, tensor, splits, name: Optional[str], process_set: ProcessSet,
                       attended: bool = False) -> Pending:
        set_id = _set_id(process_set)
        return alltoall(self.adapter, tensor, tensor_name("alltoall", name, set_id), splits, set_id, attended)

    def start_reducescatter(self, tensors: Sequence[Any], name: Optional[str], op, prescale_factor: float,
                            postscale_factor: float, process_set: ProcessSet, grouped: bool,
                            attended: bool = False) -> Pending:
        set_id = _set_id(process_set)
        return reducescatter(self.adapter, tensors, self._names("reducescatter", name, len(tensors), set_id,
                                                                grouped),
                             Average if op is None else op, prescale_factor, postscale_factor, set_id, grouped,
                             attended)

    # -- allreduce -------------------------------------------------------------------------------------------
    def allreduce_async(self, tensor, average=None, name: Optional[str] = None, op=None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set) -> int:
        """Start reducing ``tensor`` across the process set into a new tensor.

        Args:
            tensor: the tensor to reduce.
            average: deprecated; use ``op``.
            name: the operation's name (must match across ranks); unnamed ops are matched by issue order.
            op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
            prescale_factor: multiply the input by this before reducing.
            postscale_factor: multiply the result by this after reducing.
            process_set: the ranks taking part (all of them must call this).

        Returns:
            A handle for :func:`poll` / :func:`synchronize`.
        """
        return self.handles.add(*self.start_allreduce([tensor], name, op, average, prescale_factor,
                                                      postscale_factor, process_set, False, False))

    def allreduce_async_(self, tensor, average=None, name: Optional[str] = None, op=None,
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                         process_set: ProcessSet = global_process_set) -> int:
        """In-place :func:`allreduce_async`: the result is written into ``tensor``'s memory."""
        return self.handles.add(*self.start_allreduce([tensor], name, op, average, prescale_factor,
                                                      postscale_factor, process_set, True, False))

    def allreduce(self, tensor, average=None, name: Optional[str] = None, op=None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set):
        """Reduce ``tensor`` across ranks (default: average) and return the result (a new tensor)."""
        return self.run(self.start_allreduce([tensor], name, op, average, prescale_factor, postscale_factor,
                                             process_set, False, False, attended=True))

    def allreduce_(self, tensor, average=None, name: Optional[str] = None, op=None,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                   process_set: ProcessSet = global_process_set):
        """In-place, blocking allreduce; returns ``tensor`` holding the result."""
        return self.run(self.start_allreduce([tensor], name, op, average, prescale_factor, postscale_factor,
                                             process_set, True, False, attended=True))

    def grouped_allreduce_async(self, tensors: Sequence, average=None, name: Optional[str] = None, op=None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set) -> int:
        """Start reducing a list of tensors as one group (negotiated and fused together); results are new."""
        return self.handles.add(*self.start_allreduce(list(tensors), name, op, average, prescale_factor,
                                                      postscale_factor, process_set, False, True))

    def grouped_allreduce_async_(self, tensors: Sequence, average=None, name: Optional[str] = None, op=None,
                                 prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                 process_set: ProcessSet = global_process_set) -> int:
        """In-place :func:`grouped_allreduce_async`."""
        return self.handles.add(*self.start_allreduce(list(tensors), name, op, average, prescale_factor,
                                                      postscale_factor, process_set, True, True))

    def grouped_allreduce(self, tensors: Sequence, average=None, name: Optional[str] = None, op=None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list:
        """Reduce a list of tensors as one atomic group; returns a list of new tensors."""
        return self.run(self.start_allreduce(list(tensors), name, op, average, prescale_factor, postscale_factor,
                                             process_set, False, True, attended=True))

    def grouped_allreduce_(self, tensors: Sequence, average=None, name: Optional[str] = None, op=None,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                           process_set: ProcessSet = global_process_set) -> list:
        """In-place, blocking grouped allreduce; returns the input tensors holding the results."""
        return self.run(self.start_allreduce(list(tensors), name, op, average, prescale_factor, postscale_factor,
                                             process_set, True, True, attended=True))

    # -- allgather -------------------------------------------------------------------------------------------
    def allgather_async(self, tensor, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> int:
        """Start concatenating every rank's ``tensor`` along dimension 0 (first dimensions may differ)."""
        return self.handles.add(*self.start_allgather([tensor], name, process_set, False))

    def grouped_allgather_async(self, tensors: Sequence, name: Optional[str] = None,
                                process_set: ProcessSet = global_process_set) -> int:
        """Start allgathering a list of tensors as one group."""
        return self.handles.add(*self.start_allgather(list(tensors), name, process_set, True))

    def allgather(self, tensor, name: Optional[str] = None, process_set: ProcessSet = global_process_set):
        """Concatenate every rank's ``tensor`` along dimension 0."""
        return self.run(self.start_allgather([tensor], name, process_set, False, attended=True))

    def grouped_allgather(self, tensors: Sequence, name: Optional[str] = None,
                          process_set: ProcessSet = global_process_set) -> list:
        """Allgather a list of tensors as one group; returns a list."""
        return self.run(self.start_allgather(list(tensors), name, process_set, True, attended=True))

    # -- broadcast -------------------------------------------------------------------------------------------
    def broadcast_async(self, tensor, root_rank: int, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> int:
        """Start copying ``root_rank``'s ``tensor`` to every rank, into a new tensor.

        ``root_rank`` is a global rank, also when a process set is given.
        """
        return self.handles.add(*self.start_broadcast(tensor, root_rank, name, process_set, False))

    def broadcast_async_(self, tensor, root_rank: int, name: Optional[str] = None,
                         process_set: ProcessSet = global_process_set) -> int:
        """In-place :func:`broadcast_async`: non-root ranks receive into ``tensor``'s memory."""
        return self.handles.add(*self.start_broadcast(tensor, root_rank, name, process_set, True))

    def broadcast(self, tensor, root_rank: int, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set):
        """Return ``root_rank``'s ``tensor`` on every rank (a new tensor)."""
        return self.run(self.start_broadcast(tensor, root_rank, name, process_set, False, attended=True))

    def broadcast_(self, tensor, root_rank: int, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set):
        """In-place, blocking broadcast; returns ``tensor``."""
        return self.run(self.start_broadcast(tensor, root_rank, name, process_set, True, attended=True))

    # -- alltoall / reducescatter ----------------------------------------------------------------------------
    def alltoall_async(self, tensor, splits=None, name: Optional[str] = None,
                       process_set: ProcessSet = global_process_set) -> int:
        """Start sending ``splits[i]`` rows of ``tensor`` to rank ``i`` of the set and receiving theirs.

        ``splits`` (a list or an int tensor, one entry per member) defaults to an equal split of dimension 0.
        The synchronized result is ``(output, received_splits)``.
        """
        return self.handles.add(*self.start_alltoall(tensor, splits, name, process_set))

    def reducescatter_async(self, tensor, name: Optional[str] = None, op=Average,
                            process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> int:
        """Start reducing ``tensor`` (Sum or Average) and giving rank r its block of rows.

        Rank r gets ``d0 // n`` rows, plus one when ``r < d0 % n`` (n = size of the process set).
        """
        return self.handles.add(*self.start_reducescatter([tensor], name, op, prescale_factor, postscale_factor,
                                                          process_set, False))

    def grouped_reducescatter_async(self, tensors: Sequence, name: Optional[str] = None, op=Average,
                                    process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                    postscale_factor: float = 1.0) -> int:
        """Start reduce-scattering a list of tensors as one group."""
        return self.handles.add(*self.start_reducescatter(list(tensors), name, op, prescale_factor,
                                                          postscale_factor, process_set, True))

    def reducescatter(self, tensor, name: Optional[str] = None, op=Average,
                      process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0):
        """Reduce ``tensor`` and return this rank's block of rows (rank r gets block r)."""
        return self.run(self.start_reducescatter([tensor], name, op, prescale_factor, postscale_factor,
                                                 process_set, False, attended=True))

    def grouped_reducescatter(self, tensors: Sequence, name: Optional[str] = None, op=Average,
                              process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                              postscale_factor: float = 1.0) -> list:
        """Reduce-scatter a list of tensors as one group; returns a list."""
        return self.run(self.start_reducescatter(list(tensors), name, op, prescale_factor, postscale_factor,
                                                 process_set, True, attended=True))

    # -- synchronisation -------------------------------------------------------------------------------------
    def join(self, device: int = -1) -> int:
        """Declare that this rank has no more data and wait until every rank has joined.

        Until then this rank contributes zeros to the allreduces the other ranks still run (``Average`` keeps
        dividing by the full set size).

        Args:
            device: the GPU this rank's zeros live on while it takes part in GPU allreduces after joining (-1:
                the caller's current device).  Joins themselves are coordinated on the host.

        Returns:
            The rank that joined last.
        """
        from horovod.engine import device as devices

        devices.note_join(device)
        return int(wait(collectives.join_async(attended=True)))

    def barrier(self, process_set: ProcessSet = global_process_set) -> None:
        """Block until every rank of the process set has reached the barrier."""
        set_id = _set_id(process_set)
        try:
            collectives.barrier(set_id)
        except (RuntimeError, OSError) as exc:
            raise_collective_error(exc)
