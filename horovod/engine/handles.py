"""Asynchronous handles and the per-tensor entries the background thread works on."""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, List, Optional, Sequence

import numpy as np

from horovod.engine.device import ArrayT, DeviceArray
from horovod.engine.messages import Request


#: Guards every handle's slot count: one lock for all of them (a handle is created per collective, and what the
#: lock guards takes nanoseconds, so sharing it costs nothing while a lock per handle costs its creation).
_COUNTS = threading.Lock()


class Handle:
    """Completion of one enqueued operation (one tensor, or a whole group).

    The engine fills :attr:`results` slot by slot; the handle completes when every slot is filled or the first
    error arrives.  A thread that has to block for it waits on a *gate*, a plain lock held until then (an ``Event``
    costs several times more to create); the gate is made only when someone has to block, since most blocking
    collectives complete before their caller waits.  ``single``: :meth:`wait` returns the one result rather than
    the list.
    """

    __slots__ = ("_gate", "_remaining", "_done", "results", "error", "names", "single", "driver", "settled")

    def __init__(self, count: int, names: List[str], single: bool = False):
        self._gate: Optional[threading.Lock] = None
        self._remaining = count
        self._done = False
        self.results: List[Any] = [None] * count
        self.error: Optional[BaseException] = None
        self.names = names
        self.single = single
        # Set by the engine at enqueue: ``driver(handle, timeout)`` lets the waiting thread make progress itself.
        self.driver: Optional[Callable[["Handle", Optional[float]], None]] = None
        # Set by the device executor: whether the GPU work behind the results has finished (``poll`` asks).
        self.settled: Optional[Callable[[], bool]] = None
        if count == 0:
            self._open()

    def _open(self) -> None:
        """Under ``_COUNTS`` (or before anyone else holds the handle): complete it, once."""
        if not self._done:
            self._done = True
            if self._gate is not None:
                self._gate.release()

    def done(self) -> bool:
        """True once the operation completed (successfully or not)."""
        return self._done

    def complete(self, index: int, value: Any) -> None:
        with _COUNTS:
            self.results[index] = value
            self._remaining -= 1
            if self._remaining == 0:
                self._open()

    def fail(self, error: BaseException) -> None:
        with _COUNTS:
            if self.error is None:
                self.error = error
            self._open()

    def _wait_done(self, timeout: Optional[float]) -> bool:
        with _COUNTS:
            if self._done:
                return True
            gate = self._gate
            if gate is None:
                gate = self._gate = threading.Lock()
                gate.acquire()
        if not gate.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        gate.release()   # let any other waiter through too
        return True

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done; return the result (a single value, or the list for groups).

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
            HorovodInternalError: the collective failed (mismatch, peer failure, shutdown).
        """
        if not self._done:
            remaining = timeout
            if self.driver is not None:
                deadline = None if timeout is None else time.monotonic() + timeout
                self.driver(self, timeout)
                if deadline is not None:
                    remaining = deadline - time.monotonic()
            if not self._wait_done(remaining):
                raise TimeoutError(f"collective {self.names[:3]} did not complete within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.results[0] if self.single else self.results


@dataclass
class Entry(Generic[ArrayT]):
    """One tensor of an enqueued operation, as the background thread sees it.

    Attributes:
        request: what is sent to the coordinator.
        tensor: the input array (C-contiguous; bfloat16 as uint16); ``None`` for the requests that carry no data
            (barrier, join, process-set changes).
        output: where the result goes (may be ``tensor`` for in-place ops); ``None`` to let the engine allocate.
        handle: the handle to complete.
        index: this tensor's slot in the handle.
    """

    request: Request
    tensor: Optional[ArrayT]
    output: Optional[ArrayT]
    handle: Handle
    index: int = 0

    def input(self) -> ArrayT:
        """:attr:`tensor`, for a collective that moves data (every such request carries its tensor)."""
        tensor = self.tensor
        if tensor is None:
            raise RuntimeError(f"tensor '{self.request.name}' reached the data plane without an input array: only "
                               f"barrier, join and process-set requests carry none (an engine defect; please report)")
        return tensor


# The host executor's entries, and the device path's.  One response's entries are all one kind: negotiation refuses
# a tensor that is on the GPU on one rank and on the host on another.
HostEntry = Entry[np.ndarray]
DeviceEntry = Entry[DeviceArray]


def own_entries(entries: Sequence[Optional[Entry[ArrayT]]], kind: str) -> List[Entry[ArrayT]]:
    """``entries`` of a response that no joined rank takes part in, all of them this rank's own.

    A joined rank's slots are ``None``, and only allreduce runs while a rank has joined (negotiation refuses the
    other kinds then), so a ``None`` here is an engine defect.
    """
    own = [entry for entry in entries if entry is not None]
    if len(own) != len(entries):
        raise RuntimeError(f"a {kind} response reached the data plane with a joined rank's empty slot; only "
                           f"allreduce runs while a rank has joined (an engine defect; please report)")
    return own


class HandleTable:
    """Integer handles for bindings whose API passes ints around (``poll(handle)``, ``synchronize(handle)``).

    Every table of the process is forgotten together (:meth:`clear_all`) when any binding's ``init()`` or
    ``shutdown()`` runs: handles of a previous engine can never complete.
    """

    _tables: "weakref.WeakSet[HandleTable]" = weakref.WeakSet()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._handles: dict = {}
        HandleTable._tables.add(self)

    def add(self, handle: Handle, wrap: Optional[Callable[[Any], Any]] = None) -> int:
        with self._lock:
            key = self._next
            self._next += 1
            self._handles[key] = (handle, wrap)
            return key

    def poll(self, key: int) -> bool:
        with self._lock:
            item = self._handles.get(key)
        if item is None:
            raise ValueError(f"Handle {key} was not created or has been cleared.")
        handle = item[0]
        # A GPU collective's results exist once it is enqueued; it is done when the GPU finished it (or it failed).
        return handle.done() and (handle.error is not None or handle.settled is None or handle.settled())

    def synchronize(self, key: int) -> Any:
        """Wait for ``key`` and return its (wrapped) result; unknown handles give ``None``."""
        with self._lock:
            item = self._handles.get(key)
        if item is None:
            return None
        handle, wrap = item
        try:
            result = handle.wait()
        finally:
            with self._lock:
                self._handles.pop(key, None)
        return wrap(result) if wrap is not None else result

    def clear(self) -> None:
        with self._lock:
            self._handles.clear()

    @classmethod
    def clear_all(cls) -> None:
        """Forget the handles of every table (keys keep counting up, so an old key never names a new handle)."""
        for table in list(cls._tables):
            table.clear()
