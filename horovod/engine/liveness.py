"""Liveness: heartbeats out; every byte in counts as life; a verdict re-reads the connections before it judges.

A rank that stops responding between collectives (a frozen process, a partitioned host) would otherwise leave the
others waiting forever, because an idle control connection is silent by design.  A small thread sends an empty
control message every ``interval`` seconds — and so does the driving thread, at its silence check, whenever the last
one is that old — and a peer counts as dead once *nothing at all* arrived from it for ``timeout`` seconds.  What
counts as having arrived (issue 38, E2):

* every byte read from the peer's control connection, by whichever path reads it (the drive loop's ``select``, the
  warm path's reads, a shutdown drain): the control plane stamps the time in its frame reader;
* every byte received from it on the data plane (the transport stamps the time, :meth:`Transport.last_heard`);
* bytes waiting unread in the kernel: a long collective keeps the drive loop away from the control connections,
  so the heartbeat thread looks at how much is queued on each (``FIONREAD``, nothing is consumed) and counts a
  change as life, and the verdict itself looks again before it declares anybody dead.  A rank that was itself
  starved (its own threads descheduled, a long step holding the GIL) therefore never mistakes the peer's queued
  heartbeats for silence; and the time of a byte is taken when this rank first sees it, not when it is processed.

A peer whose heartbeat thread is starved keeps counting as alive while its engine drives or its data-plane bytes
flow; a peer that
sends nothing at all for ``timeout`` seconds — its process stopped, its host unreachable — is dead, and the error
names it.  Inside a collective, the transports' own waits bound the silence of the peers they wait for and name
them (:mod:`horovod.transport.tcp_mesh`, :mod:`horovod.transport.shm_group`).
"""
from __future__ import annotations

import fcntl
import pickle
import select
import socket
import struct
import termios
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from horovod.engine.messages import ControlMessage
from horovod.transport.sockets import PeerError

HEARTBEAT = pickle.dumps(ControlMessage(), protocol=pickle.HIGHEST_PROTOCOL)

_INT = struct.Struct("i")


def unread_bytes(sock: Optional[socket.socket]) -> int:
    """Bytes queued unread on ``sock`` (nothing is consumed); -1 when that cannot be told (closed, unsupported)."""
    if sock is None:
        return -1
    try:
        fd = sock.fileno()
        if fd < 0:
            return -1
        raw = fcntl.ioctl(fd, termios.FIONREAD, b"\0" * _INT.size)
        return int(_INT.unpack(raw)[0])
    except (OSError, ValueError):
        try:   # where FIONREAD is not supported: readable means something is queued (or the peer closed)
            return 1 if select.select([sock], [], [], 0)[0] else 0
        except (OSError, ValueError):
            return -1


class Liveness:
    """Sends heartbeats to ``peers`` and tracks when each was last heard from.

    Args:
        peers: ranks at the other end of this rank's control connections; a mapping rank -> socket (the control
            plane's own ``peers``, read again at each check) also lets the verdict look at what is queued unread.
        send: ``send(peer, payload_bytes)``; must be safe to call concurrently with other senders.
        timeout: seconds of silence after which a peer counts as dead.
        control: the control plane (default: the object ``send`` is a method of, when it stamps its reads): the
            time of the last byte it read from each peer, and a send that never waits behind another.
        world: the data-plane transport (``last_heard(rank)``: the time of its last byte from that rank).
    """

    def __init__(self, peers: Iterable[int], send: Callable[[int, bytes], None], timeout: float, *,
                 control: Any = None, world: Any = None):
        now = time.monotonic()
        self.timeout = float(timeout)
        self.interval = max(0.2, self.timeout / 4)
        self._socks: Optional[Mapping[int, socket.socket]] = peers if isinstance(peers, Mapping) else None
        self._heard: Dict[int, float] = {peer: now for peer in peers}
        self._unread: Dict[int, int] = {}
        owner = getattr(send, "__self__", None)
        if control is None and callable(getattr(owner, "last_heard", None)):
            control = owner
        self._control = control
        self._world = world if callable(getattr(world, "last_heard", None)) else None
        try_send = getattr(control, "try_send_bytes", None)
        self._send: Callable[[int, bytes], Any] = try_send if callable(try_send) else send
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last_beat = now

    def start(self) -> "Liveness":
        if self._heard:
            self._thread = threading.Thread(target=self._beat, name="horovod-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self.observe()
            self.beat()

    def beat(self, now: Optional[float] = None) -> None:
        """Send a heartbeat to every peer. The heartbeat thread does every ``interval``; the driving thread also does
        from :meth:`silent` whenever the last one is that old, so a starved heartbeat thread does not silence a
        rank whose engine makes progress."""
        self._last_beat = time.monotonic() if now is None else now
        for peer in list(self._heard):
            try:
                # A control plane's try-send skips a peer whose connection another thread is writing to at this
                # moment: those bytes are life too, and a heartbeat must never wait behind them.
                self._send(peer, HEARTBEAT)
            except (PeerError, KeyError, OSError):
                pass  # the background thread reports broken connections with more context

    def heard(self, peer: int, now: Optional[float] = None) -> None:
        self._heard[peer] = time.monotonic() if now is None else now

    def observe(self, now: Optional[float] = None) -> None:
        """Take in every sign of life since the last look: bytes the control plane or the data plane read from each
        peer, and bytes newly queued unread on its control connection."""
        now = time.monotonic() if now is None else now
        heard = self._heard
        control, world, socks = self._control, self._world, self._socks
        for peer in list(heard):
            last = heard[peer]
            if control is not None:
                last = max(last, control.last_heard(peer))
            if world is not None:
                last = max(last, world.last_heard(peer))
            if socks is not None:
                queued = unread_bytes(socks.get(peer))
                # A new count means new bytes (or some read, which the control plane stamped): heard now. The same
                # count as at the last look means nothing came since.
                if queued > 0 and queued != self._unread.get(peer):
                    last = now
                self._unread[peer] = queued
            if last > heard[peer]:
                heard[peer] = last

    def silent(self, now: Optional[float] = None) -> List[Tuple[int, float]]:
        """``(peer, seconds)`` for every peer silent longer than the timeout, after looking at every connection
        again (:meth:`observe`): a long collective or a starved thread of this rank is not the peer's silence."""
        now = time.monotonic() if now is None else now
        if self._thread is not None and now - self._last_beat >= self.interval and not self._stop.is_set():
            self.beat(now)
        if any(now - t > self.timeout for t in self._heard.values()):
            self.observe(now)
        return [(peer, now - t) for peer, t in self._heard.items() if now - t > self.timeout]

    def next_check_in(self, now: Optional[float] = None) -> float:
        """Seconds until a check could first find a silent peer."""
        if not self._heard:
            return self.timeout
        now = time.monotonic() if now is None else now
        return max(0.05, min(self._heard.values()) + self.timeout - now)
