"""A lone asynchronous collective held back for a moment, so that a caller who waits for it at once can still take
the fast lane.

Every collective on the global set takes the next lane number when it is issued (:mod:`horovod.engine.fast_lane`),
and only a blocking one may be proposed there: an asynchronous call is numbered *slow* at once and goes through the
coordinator (or the warm path's rounds), two synchronisations and a hand-off to the background thread, although
its caller very often waits for it right away (``synchronize(allreduce_async_(...))``, a metric, a broadcast of
parameters one by one). So a lone asynchronous call that could go on the lane is *held*: in flight, but not yet
numbered.

* Its caller waits for it within ``HOROVOD_FAST_LANE_HOLD_US``: it is proposed on the lane then, as a blocking
  call would have been (:meth:`horovod.engine.lane_use.LaneUse.drive_held`).
* Anything else is issued on this rank first: the held call is numbered slow before it, in issue order.
* Nobody waits for it: when the hold ends the background thread numbers it slow and carries it out as any
  asynchronous call (it overlaps with the caller's computation from there on).

Whichever way the held call leaves, the lane's numbering is as if it had been numbered when issued, so the ranks'
numbers still pair up; ranks that treat the same call differently only make its number slow.
"""
from __future__ import annotations

import time
from typing import Optional, Tuple

from horovod.engine.engine_state import EngineState
from horovod.engine.fast_lane import FastLane
from horovod.engine.handles import Entry, Handle
from horovod.engine.messages import Request
from horovod.engine.outbox import Outbox


class Hold:
    """At most one held asynchronous call of this rank (see the module docstring); every method but :meth:`due`,
    :meth:`holding` and :meth:`end` runs under the state's lock.

    Args:
        state: the engine's state.
        lane: the fast lane the held call may still take.
        outbox: where a call goes when its hold ends.
        hold_s: how long a call is held.
    """

    def __init__(self, state: EngineState, lane: FastLane, outbox: Outbox, hold_s: float):
        self.state = state
        self.lane = lane
        self.outbox = outbox
        self.hold_s = hold_s
        #: The held call, or None (read it to ask; only this class changes it).
        self.entry: Optional[Entry] = None
        self._on_board = False
        self._until = 0.0

    def keep(self, entry: Entry, on_board: bool) -> None:
        """Hold ``entry`` (a lone asynchronous call the lane would take; ``on_board`` as its placement said)."""
        self.entry, self._on_board = entry, on_board
        self._until = time.monotonic() + self.hold_s

    def take(self, handle: Handle) -> Tuple[Optional[Entry], bool]:
        """The held entry of ``handle`` and its placement, no longer held; ``(None, False)`` when it is not held
        (any more)."""
        entry = self.entry
        if entry is None or entry.handle is not handle:
            return None, False
        self.entry = None
        return (entry, self._on_board) if self._live(entry) else (None, False)

    def release(self, ended_by: Optional[float] = None) -> Optional[Request]:
        """End the hold (only if it ended by ``ended_by``, when given): the held call, numbered slow on the lane
        now, to be queued for the coordinator by the caller (after the lock, before anything issued later); None
        when nothing is released."""
        entry = self.entry
        if entry is None or (ended_by is not None and self._until > ended_by):
            return None
        self.entry = None
        if not self._live(entry):
            return None
        self.lane.note([entry.request])
        return entry.request

    def end(self, ended_by: Optional[float] = None) -> None:
        """Outside the state's lock: :meth:`release` the held call and queue it for the coordinator."""
        with self.state.lock:
            request = self.release(ended_by)
        if request is not None:
            self.outbox.add([request])

    def due(self) -> Optional[float]:
        """When the current hold ends (``time.monotonic()``), or None when nothing is held.  Read without the lock:
        a stale answer only makes the background thread look again."""
        return self._until if self.entry is not None else None

    def holding(self) -> bool:
        """Whether a call is held and its hold has not ended: then it is all this rank has in flight, and nobody
        needs to drive until its caller waits or the hold ends."""
        return self.entry is not None and time.monotonic() < self._until

    def _live(self, entry: Entry) -> bool:
        """Whether ``entry`` is still the engine's to carry out (teardown fails and forgets every entry)."""
        req = entry.request
        return self.state.inflight.get((req.process_set, req.name)) is entry
