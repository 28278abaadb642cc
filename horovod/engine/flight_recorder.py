"""The flight recorder: a bounded ring of what this rank's last collectives did, kept for the hang doctor.

The hot path only appends a tuple to a ``deque`` (no formatting, no lookups): the request or response objects
the engine already holds, a monotonic timestamp and an event code.  Everything readable — one record per
collective with its sequence number, times and state — is rebuilt from those events when a dump is taken
(:meth:`FlightRecorder.snapshot`), which is rare.  The ring keeps ``EVENTS_PER_COLLECTIVE`` events per collective
of capacity, so about the last ``capacity`` collectives survive; a collective whose enqueue event has fallen out of
the ring is left out of the snapshot rather than shown half known.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Dict, List, Sequence, Tuple

from horovod.engine import ops

# Event codes (the second element of every event tuple).
ENQUEUED, NEGOTIATED, STARTED, FINISHED, FAILED, LANE_DONE = range(6)
# An enqueue, a negotiation, a start and a finish per collective, plus the odd failure.
EVENTS_PER_COLLECTIVE = 4

KIND_NAMES = {ops.ALLREDUCE: "allreduce", ops.ALLGATHER: "allgather", ops.BROADCAST: "broadcast",
              ops.JOIN: "join", ops.ALLTOALL: "alltoall", ops.BARRIER: "barrier",
              ops.REDUCESCATTER: "reducescatter", ops.ADD_PROCESS_SET: "add_process_set",
              ops.REMOVE_PROCESS_SET: "remove_process_set"}


class FlightRecorder:
    """This rank's ring of collective events (see the module docstring).

    Args:
        capacity: about how many collectives to keep; 0 turns recording off (every hook is then a no-op).
    """

    __slots__ = ("capacity", "_events", "_count", "enabled")

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"HOROVOD_FLIGHT_RECORDER_SIZE must be >= 0 (0 disables the recorder), got {capacity}")
        self.capacity = capacity
        self.enabled = capacity > 0
        self._events: deque = deque(maxlen=max(1, capacity * EVENTS_PER_COLLECTIVE))
        self._count = 0   # collectives enqueued so far on this rank: the next one's sequence number minus one

    # -- hot path (called by the engine; must stay a tuple append) -------------------------------------------
    def enqueued(self, requests: Sequence[Any]) -> None:
        if self.enabled:
            now = time.monotonic()
            append = self._events.append
            for req in requests:
                self._count += 1
                append((now, ENQUEUED, req, self._count))

    def negotiated(self, responses: Sequence[Any]) -> None:
        if self.enabled and responses:
            self._events.append((time.monotonic(), NEGOTIATED, responses))

    def started(self, response: Any) -> None:
        if self.enabled:
            self._events.append((time.monotonic(), STARTED, response))

    def finished(self, response: Any) -> None:
        if self.enabled:
            self._events.append((time.monotonic(), FINISHED, response))

    def failed(self, response: Any) -> None:
        if self.enabled:
            self._events.append((time.monotonic(), FAILED, response))

    def lane_done(self, request: Any) -> None:
        """A tiny allreduce settled on the fast lane: negotiated, run and finished at once."""
        if self.enabled:
            self._events.append((time.monotonic(), LANE_DONE, request))

    # -- dump side ------------------------------------------------------------------------------------------
    def snapshot(self) -> List[Dict[str, Any]]:
        """One record per collective still in the ring, oldest first (plain data, ready for JSON).

        Safe from any thread: ``list(deque)`` copies in one C call, under the GIL, so concurrent appends never
        tear it.
        """
        events = list(self._events)
        records: List[Dict[str, Any]] = []
        open_by_key: Dict[Tuple[int, str], Dict[str, Any]] = {}

        def update(set_id: int, names, field: str, when: float, state: str, error: str = "") -> None:
            for name in names:
                rec = open_by_key.get((set_id, name))
                if rec is None:
                    continue
                rec[field] = when
                rec["state"] = state
                if error:
                    rec["error"] = error
                if state in ("done", "failed"):
                    del open_by_key[(set_id, name)]

        for event in events:
            when, code = event[0], event[1]
            if code == ENQUEUED:
                req, seq = event[2], event[3]
                rec = _record_of(req, seq, when)
                records.append(rec)
                open_by_key[(req.process_set, req.name)] = rec
            elif code == NEGOTIATED:
                for resp in event[2]:
                    update(resp.process_set, resp.names, "negotiated", when, "negotiated")
            elif code == STARTED:
                update(event[2].process_set, event[2].names, "started", when, "started")
            elif code == FINISHED:
                update(event[2].process_set, event[2].names, "finished", when, "done")
            elif code == FAILED:
                resp = event[2]
                update(resp.process_set, resp.names, "finished", when, "failed",
                       f"{getattr(resp, 'error_kind', '')}: {getattr(resp, 'error', '') or ''}")
            elif code == LANE_DONE:
                req = event[2]
                for field in ("negotiated", "started"):
                    rec = open_by_key.get((req.process_set, req.name))
                    if rec is not None:
                        rec[field] = when
                update(req.process_set, [req.name], "finished", when, "done")
        return records[-self.capacity:] if self.capacity else []

    @property
    def count(self) -> int:
        """Collectives enqueued on this rank since the engine started."""
        return self._count


def _record_of(req: Any, seq: int, when: float) -> Dict[str, Any]:
    shape = [int(d) for d in (req.shape or ())]
    try:
        itemsize = ops.storage_dtype(req.dtype).itemsize
    except (TypeError, KeyError, ValueError):
        itemsize = 0
    elems = 1
    for d in shape:
        elems *= d
    return {"seq": seq, "name": req.name, "kind": KIND_NAMES.get(req.kind, str(req.kind)),
            "process_set": req.process_set, "dtype": req.dtype, "shape": shape, "bytes": elems * itemsize,
            "device": getattr(req, "device", -1), "enqueued": when, "negotiated": None, "started": None,
            "finished": None, "state": "enqueued"}
