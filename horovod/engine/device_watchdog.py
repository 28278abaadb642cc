"""The watchdog of the device data plane: no GPU collective hangs silently.

The device executor only *enqueues* work on the GPU; the handle's results exist at once and the consumer's stream
waits for the completion event.  The watchdog keeps every enqueued piece of work (its completion event, what it
was, its handles and communicators) until the event completes.  A thread checks them every
:attr:`Watchdog.period` seconds, and the communicators' asynchronous errors with them (so the hot path never asks
NCCL).  When a piece is not done within ``HOROVOD_GPU_OPERATION_TIMEOUT_SECONDS``, or NCCL reports an
asynchronous error, the watchdog fails: it logs what was pending, aborts every communicator (ending kernels that
wait for a peer, so no stream waits for ever), fails every handle of pending work with the message, and tells its
owner (the engine then dumps its flight recorder and fails every other pending handle: every rank's watchdog
or the engine's relayed failure does the same on the other ranks).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Deque, Iterable, List, Optional, Sequence

from horovod.engine.errors import PeerFailureError
from horovod.transport.base import TransportError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Pending:
    """One response's work on the GPU, from its enqueue until its completion event."""

    event: Any
    backend: Any
    describe: Callable[[], str]   # what it was (made only when a message needs it: not on the hot path)
    handles: List[Any]
    comms: Sequence[Any]
    since: float
    finished: bool = False   # the watchdog saw the event complete (and released it)

    @property
    def what(self) -> str:
        return self.describe()


class Settled:
    """A handle's ``settled`` hook: whether every completion event of its results has completed (``poll``)."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: List[Pending] = []

    def __call__(self) -> bool:
        # Done once the watchdog has swept the work: it reads NCCL's asynchronous errors before it marks completed
        # work finished, so a collective whose kernels ended with an error never looks done here.
        for item in self.items:
            if not item.finished:
                return False
        self.items.clear()
        return True


class Watchdog:
    """Tracks pending GPU work (see the module docstring).

    Args:
        timeout: seconds a piece of work may stay pending (0: no limit; asynchronous errors are still watched).
        abort_all: aborts every communicator of the owner (called once, on failure).
        on_failure: tells the owner (the engine) that the device plane failed.
        rank: this process's rank, for messages.
    """

    def __init__(self, timeout: float, abort_all: Callable[[], None], on_failure: Callable[[BaseException], None],
                 rank: int):
        self.timeout = float(timeout)
        self.period = min(0.1, self.timeout / 10) if self.timeout > 0 else 0.1
        self._abort_all, self._on_failure, self._rank = abort_all, on_failure, rank
        self._cond = threading.Condition(threading.Lock())
        self._pending: Deque[Pending] = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self.failure: Optional[TransportError] = None

    # -- the engine's side ------------------------------------------------------------------------------------
    def track(self, item: Pending) -> None:
        with self._cond:
            failure = self.failure
            if failure is None:
                self._pending.append(item)
                if self._thread is None and not self._stopped:
                    self._thread = threading.Thread(target=self._run, name="horovod-gpu-watchdog", daemon=True)
                    self._thread.start()
                elif len(self._pending) == 1:
                    self._cond.notify()
        if failure is not None:
            # The plane failed while this work was being enqueued (an asynchronous error its own NCCL call raised
            # can be read before it is tracked): it fails with that error, never completes as if it were whole.
            for handle in item.handles:
                handle.fail(PeerFailureError(str(failure)))

    def busy(self, comms: Iterable[Any]) -> bool:
        """Whether pending work uses any of ``comms``."""
        wanted = {id(c) for c in comms}
        with self._cond:
            return any(id(c) in wanted for item in self._pending for c in item.comms)

    def settle(self, timeout: Optional[float]) -> None:
        """Wait until every piece of pending work completed; raise the failure if the watchdog failed.

        Raises:
            TransportError: the watchdog failed (before or while waiting).
            TimeoutError: still pending after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending and self.failure is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"GPU work is still pending after {timeout} s: {self._pending[0].what}")
                self._cond.wait(self.period if left is None else min(self.period, left))
                self._sweep_locked()
        if self.failure is not None:
            raise self.failure

    def abandon(self, why: str) -> Optional[TransportError]:
        """The engine ends and its communicators are aborted: work still pending is lost.  Fail its handles (and
        the plane, so ``settle`` raises) with ``why``; returns the plane's failure (``None``: nothing was lost)."""
        with self._cond:
            # Work that completed but was not swept yet is not lost (its results are whole): only what the GPU has
            # not finished is named and failed.  Called before the communicators are aborted, so this is truthful.
            self._sweep_locked()
            pending = list(self._pending)
            self._pending.clear()
            if pending and self.failure is None:
                self.failure = TransportError(
                    f"{why}; {len(pending)} GPU collective(s) were still pending ({_names(pending)}) and were "
                    f"aborted: their results are not valid")
            failure = self.failure
            self._cond.notify_all()
        for item in pending:
            for handle in item.handles:
                handle.fail(PeerFailureError(str(failure)))
        return failure

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    # -- the thread ---------------------------------------------------------------------------------------
    def _sweep_locked(self) -> None:
        """Drop completed work from the front (and anywhere: several streams complete out of order)."""
        if not self._pending:
            return
        done = [item for item in self._pending if item.event is None or item.backend.query(item.event)]
        if done:
            for item in done:
                item.finished = True
                self._pending.remove(item)
                if item.event is not None:
                    item.backend.release(item.event)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                tracked = list(self._pending)
            # Asynchronous errors first, over everything tracked: work whose event completed may still have failed
            # (its completion must not count as success), then drop what completed, then time out what is left.
            reason = self._async_error(tracked)
            if reason is None:
                with self._cond:
                    self._sweep_locked()
                    pending = list(self._pending)
                reason = self._timed_out(pending)
            if reason is not None:
                self.fail(reason)
                return
            with self._cond:
                if self._stopped:
                    return
                self._cond.wait(self.period)

    def _async_error(self, pending: List[Pending]) -> Optional[str]:
        seen = set()
        for item in pending:
            for comm in item.comms:
                if id(comm) in seen:
                    continue
                seen.add(id(comm))
                try:
                    error = comm.async_error()
                except Exception as exc:  # noqa: BLE001  (a failing query is itself the failure to report)
                    error = exc
                if error is not None:
                    using = [p for p in pending if any(c is comm for c in p.comms)]
                    return (f"NCCL reported an asynchronous error on rank {self._rank} while {_names(using)} "
                            f"{'was' if len(using) == 1 else 'were'} pending on the GPU: {error}; a peer may have died "
                            f"or its GPU or network failed")
        return None

    def _timed_out(self, pending: List[Pending]) -> Optional[str]:
        if pending and self.timeout > 0:
            oldest = pending[0]
            waited = time.monotonic() - oldest.since
            if waited > self.timeout:
                return (f"{oldest.what} did not complete on the GPU of rank {self._rank} within {self.timeout:g} s "
                        f"(HOROVOD_GPU_OPERATION_TIMEOUT_SECONDS); a peer's GPU may be stuck or dead, or the ranks "
                        f"issued different collectives. {len(pending)} GPU collective(s) were pending; the NCCL "
                        f"communicators were aborted")
        return None

    def fail(self, reason: str) -> None:
        """Fail the device plane with ``reason`` (once): abort, fail pending handles, tell the owner."""
        with self._cond:
            if self.failure is not None:
                return
            self.failure = TransportError(reason)
            pending = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        logger.error("horovod: %s. Pending GPU work: %s", reason, "; ".join(p.what for p in pending[:10]))
        for item in pending:   # first: once aborted, the events complete and poll() would say "done"
            for handle in item.handles:
                handle.fail(PeerFailureError(reason))
        try:
            self._abort_all()
        except Exception:  # noqa: BLE001  (aborting must not hide the failure)
            logger.debug("aborting NCCL communicators failed", exc_info=True)
        try:
            self._on_failure(self.failure)
        except Exception:  # noqa: BLE001
            logger.debug("reporting the device failure failed", exc_info=True)


def _names(pending: Sequence[Pending], most: int = 4) -> str:
    """The first ``most`` pieces of work, oldest first, and how many more."""
    shown = "; ".join(p.what for p in pending[:most])
    return shown + (f" and {len(pending) - most} more" if len(pending) > most else "")
