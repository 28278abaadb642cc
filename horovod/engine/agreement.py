"""How the ranks agree on this rank's collectives and carry them out: one interface, one strategy per situation.

:class:`~horovod.engine.intake.Intake` makes the checks a rank makes alone and registers the entries in flight; what
happens to them then is the business of the engine's :class:`Agreement`, chosen once when the engine is built:

* :class:`Alone` — a job of one process: nobody to agree with; planned and executed in the caller.
* :class:`Coordinated` — the coordinator (rank 0) negotiates cold requests, and reports errors and mismatches to
  every rank; requests whose response sits in a cache slot are agreed in the warm path's rounds instead, one AND of
  hit bits per round (:mod:`horovod.engine.rounds`; the outbox hands them there when it flushes).
* :class:`~horovod.engine.lane_use.LaneUse` — where the transport offers a fast lane: a lone collective on the
  global set is agreed on and moved in one synchronisation on the lane (a lone asynchronous one held a moment
  first, :mod:`horovod.engine.hold`); whatever the lane does not decide goes on to :class:`Coordinated`.

Every strategy is two calls: :meth:`Agreement.admit` under the state's lock (numbering, in issue order, and how a
caller waiting on the handles makes progress) and :meth:`Agreement.carry` after it (the synchronisation itself, or
handing the requests on).
"""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Protocol, Tuple

from horovod.engine import fusion
from horovod.engine.drive import Driver
from horovod.engine.engine_state import EngineState
from horovod.engine.errors import SHUTDOWN_MESSAGE, PeerFailureError
from horovod.engine.handles import Entry, Handle
from horovod.engine.outbox import Outbox
from horovod.transport.sockets import PeerError


#: What :meth:`Agreement.admit` decided: ``(drive, ticket)`` — how a caller waiting on the handles makes progress
#: (``drive(handle, timeout)``), and the strategy's own note for :meth:`Agreement.carry` (a plain tuple: this is
#: every collective's path).
Admission = Tuple[Callable[[Handle, Optional[float]], None], Any]


class Agreement(Protocol):
    """One way for this rank's collectives to be agreed on by every rank and carried out (see the module docstring)."""

    def admit(self, entries: List[Entry], attended: bool) -> Admission:
        """Under the state's lock, after the rank's own checks: take ``entries`` (one call's) in issue order.
        ``attended``: the caller waits for them right away and drives their progress itself."""

    def carry(self, ticket: Any, entries: List[Entry], attended: bool) -> None:
        """After the lock: agree on and carry out ``entries`` now, or hand them to whoever drives next (``ticket``:
        what :meth:`admit` noted)."""


class Alone:
    """A job of one process (see the module docstring)."""

    def __init__(self, state: EngineState, driver: Driver):
        self.state = state
        self.driver = driver

    def admit(self, entries: List[Entry], attended: bool) -> Admission:
        return self.driver.drive, None

    def carry(self, ticket: Any, entries: List[Entry], attended: bool) -> None:
        """Nobody to wait for: plan and execute right here, without any hand-off."""
        state = self.state
        coord = state.coordinator
        assert coord is not None, "a job of one process coordinates itself"
        with state.drive_lock:   # other user threads may call collectives at the same time
            now = time.monotonic()
            for entry in entries:
                state.timeline.negotiate(entry.request, now)
                coord.add(entry.request, now)
            ready = coord.take_ready()
            state.timeline.negotiated(ready, now)
            config = state.config
            self.driver.responses.execute_all(fusion.plan(ready, config.fusion_threshold,
                                                          config.disable_group_fusion))


class Coordinated:
    """The coordinator, and the warm path's rounds for cached requests (see the module docstring)."""

    def __init__(self, state: EngineState, outbox: Outbox, driver: Driver):
        self.state = state
        self.outbox = outbox
        self.driver = driver

    def admit(self, entries: List[Entry], attended: bool) -> Admission:
        return self.driver.drive, None

    def carry(self, ticket: Any, entries: List[Entry], attended: bool) -> None:
        """Queue the requests for the coordinator (or the warm path); a caller about to wait sends them at once,
        otherwise whoever drives next does."""
        state = self.state
        first = self.outbox.add([e.request for e in entries])
        if attended and state.coordinator is None:
            # A caller that is about to wait sends at once (behind anything queued before, to keep the order).
            try:
                self.outbox.flush()
            except PeerError as exc:
                for entry in entries:
                    state.pop_entries(entry.request.process_set, [entry.request.name])
                dead = self.driver.coordinator_last_word()
                if dead is not None:   # the coordinator said why it ended (the rank that failed first)
                    raise type(dead)(str(dead)) from exc
                raise PeerFailureError(f"cannot reach the coordinator (rank 0): {exc}. {SHUTDOWN_MESSAGE}") from exc
        elif first and state.drive_lock.locked():
            state.wakeup.wake()   # the driver may be blocked in select; otherwise the next driver sees the outbox
        if not attended:
            self.driver.call_background()
