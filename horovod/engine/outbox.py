"""This rank's requests on their way to the coordinator.

Requests queue here; whoever drives next hands them over in one batch (a worker sends them to rank 0 in one
control message, rank 0 records its own in the coordinator), so a burst of asynchronous calls leaves together.
With the warm path, requests whose response sits in a cache slot stay behind as hits (see
:mod:`horovod.engine.rounds`) and only the rest leave.
"""
from __future__ import annotations

import threading
import time
from typing import List

from horovod.engine.engine_state import EngineState
from horovod.engine.messages import ControlMessage, Request


class Outbox:
    """The requests this rank has not handed to the coordinator yet (see the module docstring).

    Args:
        state: the engine's state.
    """

    def __init__(self, state: EngineState):
        self.state = state
        #: Requests queued, not yet sent (read it to ask whether any wait; only this class changes it).
        self.queued: List[Request] = []
        self._lock = threading.Lock()   # held while flushing: concurrent flushers must not reorder requests
        self._invalidations: List[int] = []   # rank 0: slots every rank must drop, sent with the next message

    def add(self, requests: List[Request]) -> bool:
        """Queue ``requests``; True when the outbox was empty before."""
        with self._lock:
            first = not self.queued
            self.queued.extend(requests)
        return first

    def flush(self) -> None:
        """Hand queued requests to the coordinator: in one message from a worker, directly on rank 0."""
        state = self.state
        with self._lock:
            batch, self.queued = self.queued, []
            if not batch:
                return
            if state.warm is not None:
                batch = state.warm.take(batch, time.monotonic())
                if not batch:
                    return
            if state.coordinator is None:
                state.control.send(0, ControlMessage(requests=[state.request_cache.encode(r) for r in batch]))
                return
            now = time.monotonic()
            for req in batch:
                state.timeline.negotiate(req, now)
                template, data, _ = state.request_cache.canonical(req)
                self.note_cold(template)
                state.coordinator.add(template, now, data)

    def send_cold(self, requests: List[Request]) -> None:
        """Hand waiting hits of the warm path to the coordinator in full (see horovod/engine/rounds.py)."""
        state = self.state
        if state.coordinator is None:
            state.control.send(0, ControlMessage(requests=[state.request_cache.encode(r) for r in requests]))
            return
        now = time.monotonic()
        for req in requests:
            template, data, _ = state.request_cache.canonical(req)
            self.note_cold(template)
            state.coordinator.add(template, now, data)

    def note_cold(self, req: Request) -> None:
        """Rank 0: a request of the global set that reaches the coordinator drops its name's cache slot on every
        rank, so that the other ranks' hits for it come here too and every request is checked as before."""
        table = self.state.slot_table
        if table is not None and req.process_set == 0:
            slot = table.invalidate((0, req.name))
            if slot is not None:
                self._invalidations.append(slot)

    def has_invalidations(self) -> bool:
        return bool(self._invalidations)

    def take_invalidations(self) -> List[int]:
        taken, self._invalidations = self._invalidations, []
        return taken
