"""Chrome-trace timeline written by rank 0 (open in Perfetto or chrome://tracing).

Layout follows the original: one trace "process" per tensor name, a NEGOTIATE_<KIND> span with one tick per
rank as it reports ready, then the execution span with nested activities.  A writer thread owns the file; the
background thread only appends events to a queue.  After every batch the file ends in ``]``, so it is valid
JSON at every moment.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from typing import IO, Dict, List, Optional

from horovod.engine import ops

logger = logging.getLogger(__name__)


class Timeline:
    """No-op timeline; :meth:`create` returns a :class:`FileTimeline` when one is configured."""

    enabled = False

    @staticmethod
    def create(config, rank: int, transport: str = "tcp") -> "Timeline":
        if not Timeline.records(config, rank):
            return Timeline()
        return FileTimeline(config.timeline, config.timeline_mark_cycles, transport)

    @staticmethod
    def records(config, rank: int) -> bool:
        """Whether ``rank`` records a timeline from the start (rank 0 with ``HOROVOD_TIMELINE`` naming a file)."""
        path = config.timeline
        return rank == 0 and bool(path) and path.upper() != "DYNAMIC"

    def negotiate(self, request, now: float) -> None: ...

    def negotiated(self, responses, now: float) -> None: ...

    def start(self, response, entries, prefix: Optional[str] = None) -> None: ...

    def activity(self, name: str, begin: bool) -> None: ...

    def end(self, response) -> None: ...

    def close(self) -> None: ...


class FileTimeline(Timeline):
    """Writes events for rank 0 to ``path``."""

    enabled = True

    def __init__(self, path: str, mark_cycles: bool = False, transport: str = "tcp"):
        self.path = path
        self.activity_prefix = transport.upper()   # TCP_ALLREDUCE, SHM_ALLREDUCE, MPI_ALLREDUCE, ...
        self.mark_cycles = mark_cycles
        self._t0 = time.monotonic()
        self._pids: Dict[str, int] = {}
        self._negotiating: Dict[str, bool] = {}
        self._queue: "queue.Queue[Optional[List[dict]]]" = queue.Queue()
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file: Optional[IO[str]] = open(path, "w", encoding="utf-8")
        self._first = True
        self._write_events([
            {"name": "process_name", "ph": "M", "pid": 0,
             "args": {"start_time_since_epoch_in_micros": int(time.time() * 1e6)}},
            {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},
        ])
        self._writer = threading.Thread(target=self._drain, name="horovod-timeline", daemon=True)
        self._writer.start()

    def _ts(self, now: Optional[float] = None) -> int:
        return int(((time.monotonic() if now is None else now) - self._t0) * 1e6)

    def _pid(self, name: str, events: List[dict]) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        return pid

    # -- events from the background thread ------------------------------------------------------------
    def negotiate(self, request, now: float) -> None:
        if request.kind == ops.JOIN:
            return
        events: List[dict] = []
        pid = self._pid(request.name, events)
        ts = self._ts(now)
        if not self._negotiating.get(request.name):
            self._negotiating[request.name] = True
            events.append({"ph": "B", "name": f"NEGOTIATE_{ops.KIND_NAMES.get(request.kind, request.kind)}",
                           "ts": ts, "pid": pid})
        events.append({"ph": "X", "name": str(request.rank), "ts": ts, "pid": pid, "dur": 0})
        self._queue.put(events)

    def negotiated(self, responses, now: float) -> None:
        events: List[dict] = []
        ts = self._ts(now)
        if self.mark_cycles:
            events.append({"ph": "i", "name": "CYCLE_START", "ts": ts, "s": "g"})
        for resp in responses:
            for name in resp.names:
                if self._negotiating.pop(name, None):
                    events.append({"ph": "E", "ts": ts, "pid": self._pid(name, events)})
        if events:
            self._queue.put(events)

    def start(self, response, entries, prefix: Optional[str] = None) -> None:
        """``prefix`` names the data plane when it is not the host transport (``NCCL`` for GPU collectives)."""
        events: List[dict] = []
        prefix = prefix or self.activity_prefix
        ts = self._ts()
        kind = ops.KIND_NAMES.get(response.kind, str(response.kind))
        activity = "MEMCPY_IN_FUSION_BUFFER" if len(response.names) > 1 else None
        for name in response.names:
            pid = self._pid(name, events)
            events.append({"ph": "B", "name": kind, "ts": ts, "pid": pid})
            if activity:
                events.append({"ph": "B", "name": activity, "ts": ts, "pid": pid})
                events.append({"ph": "E", "ts": ts, "pid": pid})
            events.append({"ph": "B", "name": f"{prefix}_{kind}" if kind != "BARRIER" else kind, "ts": ts, "pid": pid})
        self._queue.put(events)

    def activity(self, name: str, begin: bool) -> None:
        """A span of the engine's own work outside any tensor (``INIT_NCCL``), on a row of its own."""
        events: List[dict] = []
        pid = self._pid("horovod", events)
        events.append({"ph": "B", "name": name, "ts": self._ts(), "pid": pid} if begin
                      else {"ph": "E", "ts": self._ts(), "pid": pid})
        self._queue.put(events)

    def end(self, response) -> None:
        events: List[dict] = []
        ts = self._ts()
        for name, shape in zip(response.names, response.shapes or [()] * len(response.names)):
            pid = self._pid(name, events)
            events.append({"ph": "E", "ts": ts, "pid": pid})
            events.append({"ph": "E", "ts": ts, "pid": pid,
                           "args": {"dtype": response.dtype, "shape": "[" + ", ".join(map(str, shape)) + "]"}})
        self._queue.put(events)

    def close(self) -> None:
        if self._file is None:
            return
        self._queue.put(None)
        self._writer.join(timeout=5)

    # -- writer thread --------------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                break
            pending = list(batch)
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._write_events(pending)
                    pending = []
                    self._finish()
                    return
                pending.extend(more)
            self._write_events(pending)
        self._finish()

    def _write_events(self, events: List[dict]) -> None:
        if not events or self._file is None:
            return
        text = ",\n".join(json.dumps(e, separators=(", ", ": ")) for e in events)
        if self._first:
            self._file.write("[\n" + text + "\n]")
            self._first = False
        else:
            self._file.seek(self._file.tell() - 1)
            self._file.write(",\n" + text + "\n]")
        self._file.flush()

    def _finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def start_dynamic(runtime, path: str, mark_cycles: bool) -> None:
    """Switch a running engine's timeline to ``path`` (``start_timeline``)."""
    runtime.timeline.close()
    runtime.timeline = FileTimeline(path, mark_cycles, runtime.transport_name) if runtime.rank == 0 else Timeline()


def stop_dynamic(runtime) -> None:
    runtime.timeline.close()
    runtime.timeline = Timeline()
