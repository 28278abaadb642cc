"""How an engine ends: an orderly leave, a failure (the first reason wins and is relayed), releasing every resource.

A part of the engine, over its :class:`~horovod.engine.engine_state.EngineState`: it fails pending handles with
the reason, tells the other ranks (rank 0 relays to everyone), reports which rank it saw fail, and closes
connections, transports and files.
"""
from __future__ import annotations

import logging
import threading

from horovod.engine import flight_dump
from horovod.engine.engine_state import EngineState
from horovod.engine.errors import SHUTDOWN_MESSAGE, PeerFailureError, ShutdownError
from horovod.engine.messages import ControlMessage
from horovod.transport.sockets import PeerError

logger = logging.getLogger("horovod.engine.runtime")

#: Rendezvous scope where a rank that saw another fail names it (read by the launcher's failure message).
CULPRIT_SCOPE = "culprits"


class Teardown:
    """Leaving and failing (see the module docstring).

    Args:
        state: the engine's state.
    """

    def __init__(self, state: EngineState):
        self.state = state

    def leave(self, reason: str) -> None:
        """Orderly shutdown requested on this rank: tell the others, fail what is pending."""
        if self.state.coordinator is not None:
            self.state.control.broadcast(ControlMessage(shutdown=True, reason=reason))
        elif 0 in self.state.control.peers:
            try:
                self.state.control.send(0, ControlMessage(shutdown=True, reason=reason))
            except PeerError:
                pass
        self._fail_pending(ShutdownError(reason))
        self.close_lane()

    def close_lane(self) -> None:
        """No more fast-lane entries from this rank: the others decide its missing ones as slow; no more rounds."""
        if self.state.lane is not None:
            self.state.lane.close()
        if self.state.warm is not None:
            self.state.warm.close()

    def die(self, error: BaseException, notify: bool) -> None:
        with self.state.lock:
            first = self.state.dead is None
            if first:
                self.state.dead = error
        if first and isinstance(error, PeerFailureError) and error.culprit is not None:
            self._report_culprit(error)
        if first and not isinstance(error, ShutdownError):   # [hang doctor] before pending handles fail
            flight_dump.dump_once(self.state, f"engine failed: {error}", "failure")
        if notify:
            failure = isinstance(error, PeerFailureError)
            message = ControlMessage(shutdown=True, failure=failure, reason=str(error))
            if self.state.coordinator is not None:
                self.state.control.broadcast(message)
            elif 0 in self.state.control.peers:
                try:
                    self.state.control.send(0, message)
                except PeerError:
                    pass
        self._fail_pending(error)
        self.close_all()

    def die_of_peer_failure(self, exc: BaseException) -> None:
        """Fail the engine because a peer or the link to it failed, naming that rank when the error does."""
        peer = getattr(exc, "peer", None)
        culprit = peer if isinstance(peer, int) and not isinstance(peer, bool) else None
        self.die(PeerFailureError(
            f"Horovod detected that a peer failed during a collective on rank {self.state.rank}: {exc}. Check the "
            f"other ranks' output for the original error; in elastic mode the job will reset.", culprit=culprit),
            notify=True)

    def _report_culprit(self, error: PeerFailureError) -> None:
        """Tell the launcher which rank this one saw fail: it may be frozen rather than exited, and the rank that
        exits first is then only a witness (best effort, at most a second)."""
        store = self.state.job.store
        if store is None or not hasattr(store, "put"):
            return
        record = f"{error.culprit}|{str(error).split(SHUTDOWN_MESSAGE)[0].strip()}".encode()

        def report() -> None:
            try:
                store.put(CULPRIT_SCOPE, str(self.state.rank), record)
            except (OSError, ValueError):
                pass   # the launcher is gone or unreachable: the workers' own messages still say it

        thread = threading.Thread(target=report, name="horovod-report-culprit", daemon=True)
        thread.start()
        thread.join(1.0)

    def _fail_pending(self, error: BaseException) -> None:
        with self.state.lock:
            entries = list(self.state.inflight.values())
            self.state.inflight.clear()
            if self.state.dead is None:
                self.state.dead = error
        for entry in entries:
            entry.handle.fail(type(error)(str(error)))

    def close_all(self) -> None:
        if self.state.closed:
            return
        self.state.closed = True
        self.close_lane()
        if self.state.lane is not None:
            self.state.lane.release()
        self.state.liveness.stop()
        if self.state.autotuner is not None:
            self.state.autotuner.close()
        self.state.timeline.close()
        self.state.control.close()
        try:
            # After an orderly shutdown the GPU finishes what was enqueued; after a failure NCCL is aborted, so no
            # kernel waits for a dead peer.
            dead = self.state.dead
            self.state.executor.close(abort=not isinstance(dead, ShutdownError), reason=str(dead or ""))
        except Exception:
            logger.debug("closing the device data plane failed", exc_info=True)
        for info in list(self.state.sets.values()):
            if info.transport is not None and info.transport is not self.state.world:
                try:
                    info.transport.close()
                except Exception:  # closing must not mask the original error
                    logger.debug("closing a process-set transport failed", exc_info=True)
        try:
            self.state.world.close()
        except Exception:
            logger.debug("closing the world transport failed", exc_info=True)
        if self.state.job.rendezvous_server is not None:
            self.state.job.rendezvous_server.stop()
        try:
            self.state.selector.close()   # whoever closes holds the drive lock or runs after every driver stopped
        except (OSError, ValueError):
            pass
        self.state.wakeup.close()
