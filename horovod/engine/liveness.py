"""Liveness of the control plane: heartbeats out, silence in.

A rank that stops responding between collectives (a frozen process, a partitioned host) would otherwise leave the
others waiting forever, because an idle control connection is silent by design.  A small thread sends an empty
control message every ``interval`` seconds — independently of the background thread, which may be busy in a long
collective — and the background thread declares a peer dead once nothing at all arrived from it for ``timeout``
seconds *after* draining its connection.
"""
from __future__ import annotations

import pickle
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from horovod.engine.messages import ControlMessage
from horovod.transport.sockets import PeerError

HEARTBEAT = pickle.dumps(ControlMessage(), protocol=pickle.HIGHEST_PROTOCOL)


class Liveness:
    """Sends heartbeats to ``peers`` and tracks when each was last heard from.

    Args:
        peers: ranks at the other end of this rank's control connections.
        send: ``send(peer, payload_bytes)``; must be safe to call concurrently with other senders.
        timeout: seconds of silence after which a peer counts as dead.
    """

    def __init__(self, peers: Iterable[int], send: Callable[[int, bytes], None], timeout: float):
        now = time.monotonic()
        self.timeout = float(timeout)
        self.interval = max(0.2, self.timeout / 4)
        self._heard: Dict[int, float] = {peer: now for peer in peers}
        self._send = send
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Liveness":
        if self._heard:
            self._thread = threading.Thread(target=self._beat, name="horovod-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            for peer in list(self._heard):
                try:
                    self._send(peer, HEARTBEAT)
                except (PeerError, KeyError, OSError):
                    pass  # the background thread reports broken connections with more context

    def heard(self, peer: int, now: Optional[float] = None) -> None:
        self._heard[peer] = time.monotonic() if now is None else now

    def silent(self, now: Optional[float] = None) -> List[Tuple[int, float]]:
        """``(peer, seconds)`` for every peer silent longer than the timeout."""
        now = time.monotonic() if now is None else now
        return [(peer, now - t) for peer, t in self._heard.items() if now - t > self.timeout]

    def next_check_in(self, now: Optional[float] = None) -> float:
        """Seconds until a check could first find a silent peer."""
        if not self._heard:
            return self.timeout
        now = time.monotonic() if now is None else now
        return max(0.05, min(self._heard.values()) + self.timeout - now)
