"""How an engine ends: an orderly leave, a failure (the first reason wins and is relayed), releasing every resource.

A mixin of :class:`horovod.engine.runtime.Runtime`: it fails pending handles with the reason, tells the other ranks
(rank 0 relays to everyone), reports which rank it saw fail, and closes connections, transports and files.
"""
from __future__ import annotations

import logging
import threading

from horovod.engine import flight_dump
from horovod.engine.errors import SHUTDOWN_MESSAGE, PeerFailureError, ShutdownError
from horovod.engine.messages import ControlMessage
from horovod.transport.sockets import PeerError

logger = logging.getLogger("horovod.engine.runtime")

#: Rendezvous scope where a rank that saw another fail names it (read by the launcher's failure message).
CULPRIT_SCOPE = "culprits"


class Teardown:
    """Leaving and failing (see the module docstring)."""

    def _leave(self, reason: str) -> None:
        """Orderly shutdown requested on this rank: tell the others, fail what is pending."""
        if self.coordinator is not None:
            self.control.broadcast(ControlMessage(shutdown=True, reason=reason))
        elif 0 in self.control.peers:
            try:
                self.control.send(0, ControlMessage(shutdown=True, reason=reason))
            except PeerError:
                pass
        self._fail_pending(ShutdownError(reason))
        self._close_lane()

    def _close_lane(self) -> None:
        """No more fast-lane entries from this rank: the others decide its missing ones as slow."""
        if self._lane is not None:
            self._lane.close()

    def _die(self, error: BaseException, notify: bool) -> None:
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = error
        if first and isinstance(error, PeerFailureError) and error.culprit is not None:
            self._report_culprit(error)
        if first and not isinstance(error, ShutdownError):   # [hang doctor] before pending handles fail
            flight_dump.dump_once(self, f"engine failed: {error}", "failure")
        if notify:
            failure = isinstance(error, PeerFailureError)
            message = ControlMessage(shutdown=True, failure=failure, reason=str(error))
            if self.coordinator is not None:
                self.control.broadcast(message)
            elif 0 in self.control.peers:
                try:
                    self.control.send(0, message)
                except PeerError:
                    pass
        self._fail_pending(error)
        self._close_all()

    def _report_culprit(self, error: PeerFailureError) -> None:
        """Tell the launcher which rank this one saw fail: it may be frozen rather than exited, and the rank that
        exits first is then only a witness (best effort, at most a second)."""
        store = self.store
        if store is None or not hasattr(store, "put"):
            return
        record = f"{error.culprit}|{str(error).split(SHUTDOWN_MESSAGE)[0].strip()}".encode()

        def report() -> None:
            try:
                store.put(CULPRIT_SCOPE, str(self.rank), record)
            except (OSError, ValueError):
                pass   # the launcher is gone or unreachable: the workers' own messages still say it

        thread = threading.Thread(target=report, name="horovod-report-culprit", daemon=True)
        thread.start()
        thread.join(1.0)

    def _fail_pending(self, error: BaseException) -> None:
        with self._lock:
            entries = list(self._inflight.values())
            self._inflight.clear()
            if self._dead is None:
                self._dead = error
        for entry in entries:
            entry.handle.fail(type(error)(str(error)))

    def _close_all(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._close_lane()
        self.liveness.stop()
        if self.autotuner is not None:
            self.autotuner.close()
        self.timeline.close()
        self.control.close()
        try:
            # After an orderly shutdown the GPU finishes what was enqueued; after a failure NCCL is aborted, so no
            # kernel waits for a dead peer.
            self.executor.close(abort=not isinstance(self._dead, ShutdownError))
        except Exception:
            logger.debug("closing the device data plane failed", exc_info=True)
        for info in list(self.sets.values()):
            if info.transport is not None and info.transport is not self.world:
                try:
                    info.transport.close()
                except Exception:  # closing must not mask the original error
                    logger.debug("closing a process-set transport failed", exc_info=True)
        try:
            self.world.close()
        except Exception:
            logger.debug("closing the world transport failed", exc_info=True)
        if self.rendezvous_server is not None:
            self.rendezvous_server.stop()
        try:
            self._selector.close()   # whoever closes holds the drive lock or runs after every driver stopped
        except (OSError, ValueError):
            pass
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
