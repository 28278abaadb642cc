"""The driver's end of the tasks' output: chunks from the rendezvous store into an :class:`OutputSink`.

A task forwards its worker's stdout/stderr to the store as numbered chunks (:mod:`horovod.spark.task_protocol`).
The driver feeds every chunk, in order, into a local pipe whose read end an :class:`OutputSink` reads, so the
lines come out exactly as ``horovodrun``'s do: whole, tagged ``[rank]<stdout>:``, optionally timestamped and
copied to per-rank files.
"""
from __future__ import annotations

import os
import threading
from typing import IO, Callable, Dict, Optional, Tuple

from horovod.runner.output import STREAMS, OutputSink
import horovod.spark.task_protocol as proto

#: Seconds between two looks at the store for new chunks.
POLL_INTERVAL = 0.05

Fetch = Callable[[str, str], Optional[bytes]]
Delete = Callable[[str, str], None]


class OutputRelay:
    """Moves the chunks of the tasks that were attached to it into ``sink``.

    Args:
        sink: where the tagged lines go.
        fetch, delete: read / remove ``(scope, key)`` in the store (the driver's in-memory store, or a client).
    """

    def __init__(self, sink: OutputSink, fetch: Fetch, delete: Delete):
        self.sink = sink
        self._fetch, self._delete = fetch, delete
        self._lock = threading.Lock()
        self._pump_lock = threading.Lock()   # one pump at a time: a chunk is fetched, written and deleted once
        self._streams: Dict[Tuple[str, str], list] = {}   # (task key, stream) -> [next seq, write fd]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvd-spark-output", daemon=True)
        self._thread.start()

    def attach(self, task_key: str, label: int) -> None:
        """Start forwarding the chunks of ``task_key`` under the tag of rank ``label``."""
        pipes: Dict[str, Optional[IO[bytes]]] = {}
        with self._lock:
            for stream in STREAMS:
                read_fd, write_fd = os.pipe()
                self._streams[(task_key, stream)] = [0, write_fd]
                pipes[stream] = os.fdopen(read_fd, "rb", buffering=0)
        self.sink.attach(label, pipes)

    def _pump_once(self) -> bool:
        with self._pump_lock:
            return self._pump_locked()

    def _pump_locked(self) -> bool:
        moved = False
        with self._lock:
            items = list(self._streams.items())
        for (task_key, stream), state in items:
            while True:
                key = proto.out_key(task_key, stream, state[0])
                chunk = self._fetch(proto.OUT_SCOPE, key)
                if chunk is None:
                    break
                self._delete(proto.OUT_SCOPE, key)
                state[0] += 1
                moved = True
                try:
                    _write_all(state[1], chunk)
                except OSError:
                    break
        return moved

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._pump_once():
                self._stop.wait(POLL_INTERVAL)

    def detach(self, task_key: str) -> None:
        """Forward what has arrived for ``task_key`` and close its pipes (its sink reader then ends)."""
        self._pump_once()
        with self._lock:
            for stream in STREAMS:
                state = self._streams.pop((task_key, stream), None)
                if state is not None:
                    os.close(state[1])

    def close(self, timeout: float = 5.0) -> None:
        """Forward what has arrived, close every pipe and wait (bounded) for the sink to write it all."""
        self._stop.set()
        self._thread.join(timeout)
        self._pump_once()
        with self._lock:
            keys = {k for k, _ in self._streams}
        for task_key in keys:
            self.detach(task_key)
        self.sink.finish(timeout)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
