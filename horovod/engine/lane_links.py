"""The fast lane's connections over TCP: framed, non-blocking sends and reads to a rank's partners.

Used by :mod:`horovod.engine.tcp_lane`, which owns the protocol; this module only moves frames. A frame is a
fixed binary header (int64 number, int64 last number, int32 tag, uint32 body bytes) and a body, never pickled,
over connections authenticated with the job secret (:func:`horovod.transport.tcp_connect.connect_world`). Sends
never block: what a socket does not take waits, copied, in that partner's queue, which every later send and
:meth:`LaneLinks.flush` push on in order.
"""
from __future__ import annotations

import select
import socket
import struct
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Set

from horovod.transport.sockets import PeerError

HEADER = struct.Struct("<qqiI")
_CHUNK = 256 * 1024

#: ``on_frame(peer, number, last, tag, body)``: a whole frame arrived (``body`` is a copy the callee may keep).
FrameHandler = Callable[[int, int, int, int, memoryview], None]


class LaneLinks:
    """One connected, authenticated socket per partner.

    Args:
        socks: partner rank -> socket.
        frame_limit: the largest body a partner may send (a larger header is a protocol error).
        on_frame: called for every whole frame read.
        on_lost: called once when a partner's connection ends or breaks.

    The caller serialises every call (the lane holds its lock around them).
    """

    def __init__(self, socks: Dict[int, socket.socket], frame_limit: int, on_frame: FrameHandler,
                 on_lost: Callable[[int], None]):
        self._socks = socks
        for sock in socks.values():
            sock.setblocking(False)
        self.by_fd = {sock.fileno(): peer for peer, sock in socks.items()}
        self.poll = select.poll()
        for fd in self.by_fd:
            self.poll.register(fd, select.POLLIN)
        self._bufs = {peer: bytearray() for peer in socks}
        self._out: Dict[int, Deque[memoryview]] = {peer: deque() for peer in socks}
        self.queued = 0   # partners with bytes waiting in their queue
        self.gone: Set[int] = set()
        self._chunk = bytearray(_CHUNK)
        self._view = memoryview(self._chunk)
        self._frame_limit = frame_limit
        self._on_frame = on_frame
        self._on_lost = on_lost

    @property
    def peers(self) -> List[int]:
        return list(self._socks)

    # -- out ---------------------------------------------------------------------------------------------------------

    def send(self, peer: int, frame: List[Any], total: int) -> None:
        """Send ``frame`` (buffers of ``total`` bytes, the header first) to ``peer`` without blocking."""
        if peer in self.gone:
            return
        queue = self._out[peer]
        if queue:   # behind what still waits (copies: the caller's buffers may change)
            queue.extend(memoryview(bytes(p)) for p in frame)
            return
        try:
            sent = self._socks[peer].sendmsg(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._lost(peer)
            return
        if sent == total:
            return
        for p in frame:   # the socket took part of it: the rest waits
            if sent >= len(p):
                sent -= len(p)
                continue
            queue.append(memoryview(bytes(p[sent:])))
            sent = 0
        self.queued += 1

    def signal(self, peer: int, seq: int, last: int, tag: int) -> None:
        """A frame without a body."""
        self.send(peer, [HEADER.pack(seq, last, tag, 0)], HEADER.size)

    def flush(self) -> None:
        """Push on what waits in the queues, as far as the sockets take it."""
        for peer, queue in self._out.items():
            while queue:
                try:
                    sent = self._socks[peer].sendmsg(list(queue)[:64])
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    self._lost(peer)
                    break
                while queue and sent >= len(queue[0]):
                    sent -= len(queue.popleft())
                if sent:
                    queue[0] = queue[0][sent:]
                    break
                if not queue:
                    self.queued -= 1

    # -- in ----------------------------------------------------------------------------------------------------------

    def read_ready(self) -> None:
        """Read every partner that has something to read now."""
        for fd, _ in self.poll.poll(0):
            peer = self.by_fd.get(fd)
            if peer is not None:
                self.read(peer)

    def read(self, peer: int) -> None:
        """Read what ``peer`` sent, handing every whole frame to ``on_frame``.

        Raises:
            PeerError: the partner sent a frame larger than the limit.
        """
        sock, buf, chunk, view = self._socks[peer], self._bufs[peer], self._chunk, self._view
        while True:
            try:
                n = sock.recv_into(view, _CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._lost(peer)
                return
            if not n:
                self._lost(peer)
                return
            if buf:   # the rest of a frame: join it
                buf += view[:n]
                del buf[:self._frames(peer, buf, len(buf))]
            else:     # frames straight from the chunk; a partial one waits in buf
                used = self._frames(peer, chunk, n)
                if used < n:
                    buf += view[used:n]
            if n < _CHUNK:
                return

    def _frames(self, peer: int, data: bytearray, end: int) -> int:
        """Hand on the whole frames at the start of ``data[:end]``; returns the bytes they took."""
        start, header = 0, HEADER.size
        while end - start >= header:
            seq, last, tag, nbytes = HEADER.unpack_from(data, start)
            if nbytes > self._frame_limit:
                raise PeerError(f"rank {peer} sent a malformed fast-lane frame ({nbytes} bytes)", peer=peer)
            stop = start + header + nbytes
            if stop > end:
                break
            # a copy (the chunk is read into again), which the receiver's views keep alive
            self._on_frame(peer, seq, last, tag, memoryview(data[start + header:stop]))
            start = stop
        return start

    # -- endings -----------------------------------------------------------------------------------------------------

    def _lost(self, peer: int) -> None:
        if peer in self.gone:
            return
        self.gone.add(peer)
        fd = self._socks[peer].fileno()
        if self.by_fd.pop(fd, None) is not None:
            self.poll.unregister(fd)
        if self._out[peer]:
            self._out[peer].clear()
            self.queued -= 1
        self._on_lost(peer)

    def close(self) -> None:
        for sock in self._socks.values():
            try:
                sock.close()
            except OSError:
                pass
        self.by_fd = {}
