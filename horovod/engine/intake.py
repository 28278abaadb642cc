"""Where a collective enters the engine: the checks every rank makes alone, then the route it takes.

A lone blocking collective on the global set may be agreed on and carried out on the fast lane
(:mod:`horovod.engine.lane_use`), and a lone asynchronous one is held a moment in case its caller waits for it at
once (:mod:`horovod.engine.hold`); a job of one process plans and executes right in the caller; everything else
queues in the outbox (:mod:`horovod.engine.outbox`) for whoever drives next.
"""
from __future__ import annotations

import os
import time
from typing import List, Optional

from horovod.engine import fusion
from horovod.engine.drive import Driver
from horovod.engine.engine_state import EngineState, Key
from horovod.engine.errors import SHUTDOWN_MESSAGE, NameInFlightError, PeerFailureError, ShutdownError
from horovod.engine.handles import Entry, Handle
from horovod.engine.hold import Hold
from horovod.engine.job import forked_error
from horovod.engine.lane_use import LaneUse
from horovod.engine.messages import Request
from horovod.engine.outbox import Outbox
from horovod.transport.sockets import PeerError


class Intake:
    """Accepting collectives from user threads (see the module docstring).

    Args:
        state: the engine's state.
        outbox: requests on their way to the coordinator.
        driver: the drive loop (woken or called for asynchronous work).
        lane_use: the fast lane, when this engine has one.
        hold: where a lone asynchronous call waits a moment for its caller (with the lane; None: never held).
    """

    def __init__(self, state: EngineState, outbox: Outbox, driver: Driver, lane_use: Optional[LaneUse],
                 hold: Optional[Hold] = None):
        self.state = state
        self.outbox = outbox
        self.driver = driver
        self.lane_use = lane_use
        self.hold = hold

    def enqueue(self, entries: List[Entry], attended: bool = False) -> None:
        """Queue entries for negotiation.

        ``attended``: the caller waits on these handles right away and so drives their progress itself; the
        background thread is not woken (waking it costs more than the whole small collective on a small host).

        Raises:
            ValueError: a name is already in flight, or this rank is not a member of the process set.
            HorovodInternalError: the engine has failed or shut down.
        """
        state, hold = self.state, self.hold
        if os.getpid() != state.pid:
            raise forked_error()
        lane_seq, on_board, held = 0, False, False
        released: Optional[Request] = None
        with state.lock:
            if state.dead is not None:
                raise type(state.dead)(str(state.dead))
            if state.stop_requested:
                raise ShutdownError(SHUTDOWN_MESSAGE)
            keys = self._check(entries)
            direct = [e.request for e in entries]
            if attended:
                for req in direct:
                    req.blocking = True
            if self.lane_use is not None:
                if hold is not None:
                    released = hold.release()   # a held call is numbered before anything issued after it
                    if not attended and released is None:
                        placement = self.lane_use.placement(entries)
                        if placement is not None:
                            hold.keep(entries[0], placement)
                            held = True
                if not held:
                    lane_seq, on_board = self.lane_use.post(entries, attended)
            for key, entry in zip(keys, entries):
                state.inflight[key] = entry
                entry.handle.driver = self.drive_held if held else self.driver.drive
            state.recorder.enqueued(direct)   # [hang doctor]
        if released is not None:
            self.outbox.add([released])
        if held:
            self.driver.call_background()   # it ends the hold unless the caller waits first
            return
        if lane_seq and self.lane_use is not None and self.lane_use.settle(lane_seq, entries[0], on_board):
            return
        if state.size == 1:
            self.run_alone(direct)
            return
        self._send(entries, attended)

    def _send(self, entries: List[Entry], attended: bool) -> None:
        """Queue ``entries`` for the coordinator; a caller about to wait sends at once, else whoever drives does."""
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

    def drive_held(self, handle: Handle, timeout: Optional[float] = None) -> None:
        """The driver of a held call's handle (:mod:`horovod.engine.hold`): its caller waits for it now, so it goes
        on the fast lane as a blocking call would have; once it is no longer held, :meth:`Driver.drive`."""
        state, hold, lane_use = self.state, self.hold, self.lane_use
        assert hold is not None and lane_use is not None, "only a lane holds calls"
        if timeout is not None:   # the lane waits for every rank, however long: the coordinator's way
            with state.lock:
                released = hold.release()
            if released is not None:
                self.outbox.add([released])
            self.driver.drive(handle, timeout)
            return
        # Whoever holds the drive lock now (the background thread, looking whether it is needed) lets go of it
        # soon, or ends the hold itself when the hold is over.
        due = hold.due()
        if state.drive_lock.acquire(timeout=0.0 if due is None else max(0.0, due - time.monotonic())):
            seq = 0
            with state.lock:
                entry, on_board = hold.take(handle)
                if entry is not None:
                    seq = lane_use.propose_held(entry, on_board)
            if not seq:
                state.drive_lock.release()
            elif entry is not None and lane_use.settle(seq, entry, on_board):   # (releases the drive lock)
                return
            if entry is not None:   # not decided on the lane: the coordinator's way, driven right here
                self._send([entry], attended=True)
        self.driver.drive(handle, timeout)

    def _check(self, entries: List[Entry]) -> List[Key]:
        """Under the state's lock: each entry's key, after the checks a rank makes on its own."""
        state = self.state
        keys: List[Key] = []
        seen = set()   # a group may hold thousands of tensors: no list scans
        for entry in entries:
            req = entry.request
            pset = state.sets.get(req.process_set)
            if pset is None:
                raise ValueError(f"Process set {req.process_set} is not registered (it may have been removed); "
                                 f"register it with hvd.add_process_set() on every rank first.")
            if req.process_set and not pset.included(state.rank):   # (the global set holds every rank)
                raise ValueError(f"Rank {state.rank} is not a member of the provided process set "
                                 f"(ranks {list(pset.ranks)}).")
            key = (req.process_set, req.name)
            if key in state.inflight or key in seen:
                raise NameInFlightError(
                    f"Requested a collective on tensor name '{req.name}', but a collective with that name is "
                    f"still in progress on this rank. Wait for it (synchronize) or use a different name.")
            keys.append(key)
            seen.add(key)
        return keys

    def run_alone(self, requests: List[Request]) -> None:
        """A job of one process has nobody to wait for: plan and execute right here, without any hand-off."""
        state = self.state
        coord = state.coordinator
        assert coord is not None, "a job of one process coordinates itself"
        with state.drive_lock:   # other user threads may call collectives at the same time
            now = time.monotonic()
            for req in requests:
                state.timeline.negotiate(req, now)
                coord.add(req, now)
            ready = coord.take_ready()
            state.timeline.negotiated(ready, now)
            config = state.config
            self.driver.responses.execute_all(fusion.plan(ready, config.fusion_threshold,
                                                          config.disable_group_fusion))
