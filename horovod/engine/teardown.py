"""How an engine ends: an orderly leave, a failure (the first reason wins and is relayed), releasing every resource.

A part of :class:`horovod.engine.runtime.Runtime`: it fails pending handles with the reason, tells the other ranks
(rank 0 relays to everyone), reports which rank it saw fail, and closes connections, transports and files.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from horovod.engine import flight_dump
from horovod.engine.errors import SHUTDOWN_MESSAGE, PeerFailureError, ShutdownError
from horovod.engine.messages import ControlMessage
from horovod.transport.sockets import PeerError

if TYPE_CHECKING:
    from horovod.engine.runtime import Runtime

logger = logging.getLogger("horovod.engine.runtime")

#: Rendezvous scope where a rank that saw another fail names it (read by the launcher's failure message).
CULPRIT_SCOPE = "culprits"


class Teardown:
    """Leaving and failing (see the module docstring).

    Args:
        rt: the engine whose state this part works on.
    """

    def __init__(self, rt: "Runtime"):
        self.rt = rt

    def _leave(self, reason: str) -> None:
        """Orderly shutdown requested on this rank: tell the others, fail what is pending."""
        if self.rt.coordinator is not None:
            self.rt.control.broadcast(ControlMessage(shutdown=True, reason=reason))
        elif 0 in self.rt.control.peers:
            try:
                self.rt.control.send(0, ControlMessage(shutdown=True, reason=reason))
            except PeerError:
                pass
        self._fail_pending(ShutdownError(reason))
        self._close_lane()

    def _close_lane(self) -> None:
        """No more fast-lane entries from this rank: the others decide its missing ones as slow; no more rounds."""
        if self.rt._lane is not None:
            self.rt._lane.close()
        if self.rt._warm is not None:
            self.rt._warm.close()

    def _die(self, error: BaseException, notify: bool) -> None:
        with self.rt._lock:
            first = self.rt._dead is None
            if first:
                self.rt._dead = error
        if first and isinstance(error, PeerFailureError) and error.culprit is not None:
            self._report_culprit(error)
        if first and not isinstance(error, ShutdownError):   # [hang doctor] before pending handles fail
            flight_dump.dump_once(self.rt, f"engine failed: {error}", "failure")
        if notify:
            failure = isinstance(error, PeerFailureError)
            message = ControlMessage(shutdown=True, failure=failure, reason=str(error))
            if self.rt.coordinator is not None:
                self.rt.control.broadcast(message)
            elif 0 in self.rt.control.peers:
                try:
                    self.rt.control.send(0, message)
                except PeerError:
                    pass
        self._fail_pending(error)
        self._close_all()

    def _report_culprit(self, error: PeerFailureError) -> None:
        """Tell the launcher which rank this one saw fail: it may be frozen rather than exited, and the rank that
        exits first is then only a witness (best effort, at most a second)."""
        store = self.rt.store
        if store is None or not hasattr(store, "put"):
            return
        record = f"{error.culprit}|{str(error).split(SHUTDOWN_MESSAGE)[0].strip()}".encode()

        def report() -> None:
            try:
                store.put(CULPRIT_SCOPE, str(self.rt.rank), record)
            except (OSError, ValueError):
                pass   # the launcher is gone or unreachable: the workers' own messages still say it

        thread = threading.Thread(target=report, name="horovod-report-culprit", daemon=True)
        thread.start()
        thread.join(1.0)

    def _fail_pending(self, error: BaseException) -> None:
        with self.rt._lock:
            entries = list(self.rt._inflight.values())
            self.rt._inflight.clear()
            if self.rt._dead is None:
                self.rt._dead = error
        for entry in entries:
            entry.handle.fail(type(error)(str(error)))

    def _close_all(self) -> None:
        if self.rt._closed:
            return
        self.rt._closed = True
        self._close_lane()
        self.rt.liveness.stop()
        if self.rt.autotuner is not None:
            self.rt.autotuner.close()
        self.rt.timeline.close()
        self.rt.control.close()
        try:
            # After an orderly shutdown the GPU finishes what was enqueued; after a failure NCCL is aborted, so no
            # kernel waits for a dead peer.
            self.rt.executor.close(abort=not isinstance(self.rt._dead, ShutdownError))
        except Exception:
            logger.debug("closing the device data plane failed", exc_info=True)
        for info in list(self.rt.sets.values()):
            if info.transport is not None and info.transport is not self.rt.world:
                try:
                    info.transport.close()
                except Exception:  # closing must not mask the original error
                    logger.debug("closing a process-set transport failed", exc_info=True)
        try:
            self.rt.world.close()
        except Exception:
            logger.debug("closing the world transport failed", exc_info=True)
        if self.rt.rendezvous_server is not None:
            self.rt.rendezvous_server.stop()
        try:
            self.rt._selector.close()   # whoever closes holds the drive lock or runs after every driver stopped
        except (OSError, ValueError):
            pass
        for s in (self.rt._wake_r, self.rt._wake_w):
            try:
                s.close()
            except OSError:
                pass
