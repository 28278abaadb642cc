"""The flight recorder: a bounded ring of what this rank's last collectives did, kept for the hang doctor.

The hot path only appends a tuple to a ``deque`` (no formatting, no lookups): the request or response objects
the engine already holds, a monotonic timestamp and an event code.  Everything readable — one record per
collective with its sequence number, times and state — is rebuilt from those events when a dump is taken
(:meth:`FlightRecorder.snapshot`), which is rare.  The ring keeps ``EVENTS_PER_COLLECTIVE`` events per collective
of capacity, so about the last ``capacity`` collectives survive; a collective whose enqueue event has fallen out of
the ring is left out of the snapshot rather than shown half known.
"""
from __future__ import annotations

import threading
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
    # Events hold only strings, numbers and the engine's own name lists, never the Request / Response objects:
    # keeping thousands of those alive would make the garbage collector promote and rescan them.
    def enqueued(self, entries: Sequence[Any]) -> None:
        """Called on the thread that issued the collectives (``entries``: theirs): its id is recorded, so the doctor
        names the line of that thread (a collective issued from a worker thread, not the main thread's ``join()``)."""
        if self.enabled:
            now = time.monotonic()
            thread = threading.get_ident()
            append = self._events.append
            for entry in entries:
                req = entry.request
                self._count += 1
                append((now, ENQUEUED, req.process_set, req.name, req.kind, req.dtype, req.shape, req.device,
                        self._count, thread))

    def negotiated(self) -> None:
        """A batch of responses arrived (worker) or was planned (coordinator)."""
        if self.enabled:
            self._events.append((time.monotonic(), NEGOTIATED))

    def started(self, response: Any) -> None:
        if self.enabled:
            self._events.append((time.monotonic(), STARTED, response.process_set, response.names))

    def finished(self, response: Any) -> None:
        if self.enabled:
            self._events.append((time.monotonic(), FINISHED, response.process_set, response.names))

    def failed(self, response: Any) -> None:
        if self.enabled:
            self._events.append((time.monotonic(), FAILED, response.process_set, response.names,
                                 f"{response.error_kind}: {response.error}"))

    def lane_done(self, request: Any) -> None:
        """A small collective settled on the fast lane: negotiated, run and finished at once."""
        if self.enabled:
            self._events.append((time.monotonic(), LANE_DONE, request.process_set, (request.name,)))

    # -- dump side ------------------------------------------------------------------------------------------
    def snapshot(self) -> List[Dict[str, Any]]:
        """One record per collective still in the ring, oldest first (plain data, ready for JSON).

        Safe from any thread: ``list(deque)`` copies in one C call, under the GIL, so concurrent appends never
        tear it.  A record's negotiation time is that of the last batch of responses that arrived before the first
        response naming it.
        """
        events = list(self._events)
        records: List[Dict[str, Any]] = []
        open_by_key: Dict[Tuple[int, str], Dict[str, Any]] = {}
        batch_time = None
        fields = {STARTED: ("started", "started"), FINISHED: ("finished", "done"), FAILED: ("finished", "failed"),
                  LANE_DONE: ("finished", "done")}
        for event in events:
            when, code = event[0], event[1]
            if code == ENQUEUED:
                new = _record_of(event)
                records.append(new)
                open_by_key[(new["process_set"], new["name"])] = new
                continue
            if code == NEGOTIATED:
                batch_time = when
                continue
            field, state = fields[code]
            set_id, names = event[2], event[3]
            for name in names:
                rec = open_by_key.get((set_id, name))
                if rec is None:
                    continue
                if rec["negotiated"] is None:
                    rec["negotiated"] = batch_time if batch_time is not None and batch_time >= rec["enqueued"] \
                        and code != LANE_DONE else when
                if code == LANE_DONE:
                    rec["started"] = when
                rec[field] = when
                rec["state"] = state
                if code == FAILED:
                    rec["error"] = event[4]
                if state in ("done", "failed"):
                    del open_by_key[(set_id, name)]
        return records[-self.capacity:] if self.capacity else []

    @property
    def count(self) -> int:
        """Collectives enqueued on this rank since the engine started."""
        return self._count


def _record_of(event: tuple) -> Dict[str, Any]:
    when, _, set_id, name, kind, dtype, shape, device, seq, thread = event
    shape = [int(d) for d in (shape or ())]
    try:
        itemsize = ops.storage_dtype(dtype).itemsize
    except (TypeError, KeyError, ValueError):
        itemsize = 0
    elems = 1
    for d in shape:
        elems *= d
    return {"seq": seq, "name": name, "kind": KIND_NAMES.get(kind, str(kind)), "process_set": set_id,
            "dtype": dtype, "shape": shape, "bytes": elems * itemsize, "device": device, "enqueued": when,
            "negotiated": None, "started": None, "finished": None, "state": "enqueued", "thread": thread}
