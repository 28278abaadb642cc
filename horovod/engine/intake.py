"""Where a collective enters the engine: the checks every rank makes alone, then the route it takes.

A lone blocking collective on the global set may be agreed on and carried out on the fast lane
(:mod:`horovod.engine.lane_use`); a job of one process plans and executes right in the caller; everything else
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
from horovod.engine.handles import Entry
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
    """

    def __init__(self, state: EngineState, outbox: Outbox, driver: Driver, lane_use: Optional[LaneUse]):
        self.state = state
        self.outbox = outbox
        self.driver = driver
        self.lane_use = lane_use

    def enqueue(self, entries: List[Entry], attended: bool = False) -> None:
        """Queue entries for negotiation.

        ``attended``: the caller waits on these handles right away and so drives their progress itself; the
        background thread is not woken (waking it costs more than the whole small collective on a small host).

        Raises:
            ValueError: a name is already in flight, or this rank is not a member of the process set.
            HorovodInternalError: the engine has failed or shut down.
        """
        state = self.state
        if os.getpid() != state.pid:
            raise forked_error()
        lane_seq, on_board = 0, False
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
                lane_seq, on_board = self.lane_use.post(entries, attended)
            for key, entry in zip(keys, entries):
                state.inflight[key] = entry
                entry.handle.driver = self.driver.drive
            state.recorder.enqueued(direct)   # [hang doctor]
        if lane_seq and self.lane_use is not None and self.lane_use.settle(lane_seq, entries[0], on_board):
            return
        if state.size == 1:
            self.run_alone(direct)
            return
        first = self.outbox.add(direct)
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
