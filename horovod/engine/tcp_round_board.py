"""The round board across hosts: every rank ANDs a short vector of 64-bit words once per engine round over TCP.

The same board as :mod:`horovod.engine.shm_round_board` (post a vector for round ``r``, read the AND once everyone
posted it) for jobs whose ranks do not share one machine's memory. The AND runs by recursive doubling: with ``p``
the largest power of two not above the size, rank ``w < p`` exchanges its running AND with rank ``w ^ 2**k`` at
step ``k = 0 .. log2(p) - 1``; each rank ``x >= p`` first hands its vector to rank ``x - p`` and gets the result
back from it at the end. Every rank sends and receives ``log2(p)`` (+1) frames of a few hundred bytes per round,
whatever the number of ranks, over connections to its partners only, and nobody waits for rank 0.

Nothing blocks: :meth:`TcpRoundBoard.post` sends what it can and returns; frames that arrive are taken in when the
engine's selector reports a partner's socket readable (:meth:`drain`) and whenever the engine asks for a result,
and each arrival moves the protocol on (the next step's frame goes out as soon as this step's partner frame is in).
A partner may be one round ahead of this rank (it finished the round this rank is finishing), never more: a rank
posts round ``r + 1`` only once every rank posted ``r``. Frames of a round nobody here has posted yet tell this rank
that the others are in that round (:meth:`highest`); an extra rank hears of a round it has not posted from its
proxy (a ``CALL`` frame), since nobody else talks to it.

Frames are a fixed binary layout (no pickle): int64 round, int32 tag (the step, or ``PRE`` / ``RESULT`` /
``CALL``), uint32 byte count, then the words. Every connection is authenticated with the job secret before use
(:func:`horovod.transport.tcp_connect.connect_world`).

A partner that closes its connection is remembered, not raised at once: ranks close their boards as they leave, in
any order, and a rank that crashed is named by the control plane (the coordinator hears its connection close and
fails every rank with the usual message). A round that still needs the partner's frame :data:`GONE_GRACE_S` later
fails with an error naming it.
"""
from __future__ import annotations

import select
import socket
import struct
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from horovod.transport.base import Bootstrap
from horovod.transport.shm_node import ROUND_WORDS
from horovod.transport.sockets import PeerError
from horovod.transport.tcp_connect import connect_world

PRE, RESULT, CALL = -1, -2, -3
#: Seconds a round may wait for a partner that closed its connection before that is an error of its own.
GONE_GRACE_S = 5.0
_HEADER = struct.Struct("<qiI")
_CHUNK = 64 * 1024


def partners(rank: int, size: int) -> List[int]:
    """The ranks ``rank`` exchanges frames with in every round (its connections)."""
    p = 1 << (size.bit_length() - 1)
    if rank >= p:
        return [rank - p]
    out = [rank ^ (1 << k) for k in range(p.bit_length() - 1)]
    if rank + p < size:
        out.append(rank + p)
    return out


class TcpRoundBoard:
    """This rank's side of the rounds over TCP.

    Args:
        rank, size: this rank's place in the world.
        socks: one connected, authenticated socket per partner (:func:`partners`).

    Used by one thread at a time (the engine's driver).
    """

    words = ROUND_WORDS
    relayed = True

    def __init__(self, rank: int, size: int, socks: Dict[int, socket.socket]):
        self.rank, self.size = rank, size
        p = 1 << (size.bit_length() - 1)
        self._steps = p.bit_length() - 1
        self._proxy = rank - p if rank >= p else None            # an extra rank's partner
        self._extra = rank + p if rank < p and rank + p < size else None   # the extra rank this one serves
        self._socks = socks
        for sock in socks.values():
            sock.setblocking(True)   # sends are a few hundred bytes; reads use MSG_DONTWAIT
        self._by_fd = {sock.fileno(): peer for peer, sock in socks.items()}
        self._poll = select.poll()   # one system call finds the partners with something to read
        for fd in self._by_fd:
            self._poll.register(fd, select.POLLIN)
        self._bufs = {peer: bytearray() for peer in socks}
        self._chunk = bytearray(_CHUNK)
        self._view = memoryview(self._chunk)
        self._inbox: Dict[Tuple[int, int], np.ndarray] = {}
        self._gone: Dict[int, Tuple[str, float]] = {}   # partner -> why its connection ended, and when
        self._highest = 0
        self._round = 0          # the round this rank posted last
        self._done = 0           # the last round whose AND is in _acc
        self._stage = 0          # next protocol step of _round (see _progress)
        self._sent = False       # the current stage's frame is out
        self._acc = np.zeros(self.words, dtype=np.uint64)
        self._length = 0
        self._closed = False
        self.frames_out = self.bytes_out = 0   # what this rank sent (benchmarks/round_boards.py)

    # -- the board interface (as ShmRoundBoard) ------------------------------------------------------------------

    @property
    def fds(self) -> List[int]:
        """File descriptors the engine's selector watches; :meth:`drain` when one is readable."""
        return list(self._by_fd)

    def drain(self, fd: int) -> None:
        peer = self._by_fd.get(fd)
        if peer is not None and peer not in self._gone:
            self._read(peer)
        self._progress()

    def post(self, round_no: int, vector: np.ndarray) -> None:
        """Post ``vector`` (uint64, at most :attr:`words` long) as this rank's entry of ``round_no``."""
        self._round = round_no
        self._highest = max(self._highest, round_no)
        self._length = vector.size
        self._acc[:vector.size] = vector
        self._stage, self._sent = 0, False
        self._progress()

    def highest(self) -> int:
        """The latest round any rank is known here to have posted."""
        return self._highest

    def complete(self, round_no: int) -> bool:
        """Whether the AND of ``round_no`` is known here (takes in what has arrived first)."""
        if self._done < round_no:
            self._read_all()
            self._progress()
        return self._done >= round_no

    def result(self, round_no: int, length: int, out: np.ndarray) -> bool:
        """The AND of every rank's vector of ``round_no`` (first ``length`` words) into ``out``; False while some
        rank has not posted it."""
        if not self.complete(round_no):
            return False
        out[:length] = self._acc[:length]
        return True

    def set_waiting(self, waiting: bool) -> None:
        """Nothing to do: a partner's frame makes its socket readable, which wakes the engine's selector."""

    @property
    def closed(self) -> bool:
        """Whether this rank stopped taking part (every rank agreed to use rounds when the board was built)."""
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for sock in self._socks.values():
                try:
                    sock.close()
                except OSError:
                    pass

    # -- the protocol --------------------------------------------------------------------------------------------

    def _progress(self) -> None:
        """Send and combine as far as the frames that arrived allow (see the module docstring)."""
        r = self._round
        if self._done >= r or self._closed:
            return
        length = self._length
        acc = self._acc[:length]
        if self._proxy is not None:
            if self._stage == 0:
                self._send(self._proxy, r, PRE, acc)
                self._stage = 1
            got = self._take(self._proxy, r, RESULT)
            if got is not None:
                acc[:] = got[:length]
                self._done = r
            return
        if self._stage == 0:
            if self._extra is not None:
                got = self._take(self._extra, r, PRE)
                if got is None:
                    if not self._sent:   # the extra rank may not know the round has begun
                        self._send(self._extra, r, CALL, None)
                        self._sent = True
                    return
                np.bitwise_and(acc, got[:length], out=acc)
            self._stage, self._sent = 1, False
        while self._stage <= self._steps:
            k = self._stage - 1
            partner = self.rank ^ (1 << k)
            if not self._sent:
                self._send(partner, r, k, acc)
                self._sent = True
            got = self._take(partner, r, k)
            if got is None:
                return
            np.bitwise_and(acc, got[:length], out=acc)
            self._stage, self._sent = self._stage + 1, False
        if self._extra is not None:
            self._send(self._extra, r, RESULT, acc)
        self._done = r

    def _take(self, peer: int, round_no: int, tag: int) -> Optional[np.ndarray]:
        got = self._inbox.pop((round_no, tag), None)
        if got is None and peer in self._gone:
            why, since = self._gone[peer]
            if time.monotonic() - since > GONE_GRACE_S:
                raise PeerError(f"rank {peer} {why} {time.monotonic() - since:.0f} s ago, and round {round_no} of the "
                                f"warm path still waits for it (the process exited or crashed)", peer=peer)
        return got

    def _send(self, peer: int, round_no: int, tag: int, words: Optional[np.ndarray]) -> None:
        if peer in self._gone:
            return   # it left: the round fails in _take unless the control plane ends this engine first
        payload = b"" if words is None else words.tobytes()
        frame = _HEADER.pack(round_no, tag, len(payload)) + payload
        try:
            self._socks[peer].sendall(frame)
        except OSError as exc:
            raise PeerError(f"round connection to rank {peer} failed: {exc}", peer=peer) from exc
        self.frames_out += 1
        self.bytes_out += len(frame)

    # -- reading -------------------------------------------------------------------------------------------------

    def _read_all(self) -> None:
        for fd, _ in self._poll.poll(0):
            peer = self._by_fd.get(fd)
            if peer is not None:
                self._read(peer)

    def _lost(self, peer: int, why: str) -> None:
        """``peer``'s connection ended: remember it, and close the socket (a closed socket leaves the selector)."""
        self._gone[peer] = (why, time.monotonic())
        sock = self._socks[peer]
        fd = sock.fileno()
        if self._by_fd.pop(fd, None) is not None:
            self._poll.unregister(fd)
        try:
            sock.close()
        except OSError:
            pass

    def _read(self, peer: int) -> None:
        sock, buf, view = self._socks[peer], self._bufs[peer], self._view
        while True:
            try:
                n = sock.recv_into(view, _CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._lost(peer, f"broke its round connection ({exc})")
                break
            if not n:
                self._lost(peer, "closed its round connection")
                break
            buf += view[:n]
            if n < _CHUNK:
                break
        start, header = 0, _HEADER.size
        while len(buf) - start >= header:
            round_no, tag, nbytes = _HEADER.unpack_from(buf, start)
            if nbytes > 8 * self.words or nbytes % 8:
                raise PeerError(f"rank {peer} sent a malformed round frame ({nbytes} bytes of words)", peer=peer)
            if len(buf) - start < header + nbytes:
                break
            body = start + header
            self._highest = max(self._highest, round_no)
            if tag != CALL:   # one copy out of the buffer (whose front is dropped below)
                self._inbox[(round_no, tag)] = np.frombuffer(buf, dtype=np.uint64, count=nbytes // 8,
                                                             offset=body).copy()
            start = body + nbytes
        if start:
            del buf[:start]


def connect_round_board(boot: Bootstrap) -> TcpRoundBoard:
    """Connect this rank to its partners (authenticated, as the TCP mesh) and return its board.

    Raises:
        TransportError: a partner did not publish its address, could not be reached or failed the handshake.
    """
    mine = partners(boot.rank, boot.size)
    socks = connect_world(boot.scoped("-rounds"), peers=mine)
    connected = {peer: sock for peer, sock in enumerate(socks) if sock is not None}
    return TcpRoundBoard(boot.rank, boot.size, connected)
