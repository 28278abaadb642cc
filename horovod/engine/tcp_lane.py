"""The fast lane over TCP: the board of :mod:`horovod.engine.lane_board` for jobs whose ranks do not share one
host's memory (and for the tcp and mpi transports on one host).

The lane's rules do not change (:mod:`horovod.engine.fast_lane`): every collective a rank issues on the world takes
the next lane number, a rank posts a *fast* entry (a digest and its payload) or a *slow* one for each, and number
``s`` is fast when every rank's entry ``s`` is fast with one digest; then every rank computes its result from every
rank's payload. Here the entries travel by recursive doubling among each rank's log2(size) partners (the round
board's: :func:`horovod.engine.tcp_round_board.partners`): at step ``k`` a rank sends the entries it holds to rank
``rank ^ 2**k`` and takes in that rank's, so after the last step it holds all of them, whatever the size, without
rank 0. A rank past the largest power of two hands its entry to a *proxy* first (``PRE``) and gets every entry back
at the end (``RESULT``); the proxy asks for it (``CALL``) when it is fast first.

Slow entries cost nothing: a rank only counts them. Someone needs to hear of one only when a partner proposed the
same number fast and waits for it; that partner's frame reaches this rank, whose own collective of that number is
in flight (every rank issues the same collectives, and it cannot finish without the proposer), so its driver reads
the frame and answers ``SLOW``. A slow outcome is global, so whoever learns that ``s`` is slow passes ``SLOW`` to
every partner it has not sent its step of ``s`` to yet; a fast outcome needs every rank's fast entry, which reaches
every rank only if nobody was slow — so every rank decides ``s`` the same way. A rank that closes its lane (join,
shutdown, the lane off) sends ``CLOSED`` with the number of entries it posted; ranks pass it on once, and every
later number is slow everywhere. A partner's closed connection counts as ``CLOSED`` (the control plane names a rank
that crashed).

Frames (:mod:`horovod.engine.lane_links`: binary, authenticated, never blocking) carry a number, a last number
(a ``SLOW`` range) and a tag (the step, or ``PRE`` / ``RESULT`` / ``CALL`` / ``SLOW`` / ``CLOSED``); a body of
entries is int64 digest, uint32 count, uint32 zero, count × (uint32 rank, uint32 bytes), then the bytes.
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from horovod.engine.lane_links import HEADER, LaneLinks
from horovod.engine.tcp_round_board import partners
from horovod.transport.base import Bootstrap
from horovod.transport.sockets import PeerError
from horovod.transport.tcp_connect import connect_world

PRE, RESULT, CALL, SLOW, CLOSED = -1, -2, -3, -4, -5
_NEVER = (1 << 62)   # the last number of a CLOSED range
_BODY = struct.Struct("<qII")
_BODY_ONE = struct.Struct("<qIIII")   # the body's head with the table of a single entry
_ONE = struct.Struct("<qqiIqIIII")    # header and body head of a frame of a single entry

Entries = Dict[int, memoryview]   # rank -> payload


class _Proposal:
    """This rank's fast entry being decided."""

    __slots__ = ("seq", "digest", "entries", "stage", "sent", "outcome")

    def __init__(self, seq: int, digest: int, payload: memoryview, rank: int):
        self.seq, self.digest = seq, digest
        self.entries: Entries = {rank: payload}
        self.stage = 0          # 0: the proxy / extra exchange; 1..steps: step stage - 1; past that: complete
        self.sent = False       # this stage's frame is out
        self.outcome: Optional[bool] = None   # True fast, False slow


class TcpLane:
    """This rank's side of the fast lane over TCP (see the module docstring); the interface of
    :class:`horovod.engine.lane_board.ShmLane`.

    Args:
        rank, size: this rank's place in the world.
        socks: one connected, authenticated socket per partner (:func:`partners`).

    Posts come from any thread under the engine's lock, :meth:`decide` and :meth:`drain` from its driver; an
    internal lock keeps the protocol's state consistent between them (it is never held while waiting).
    """

    capacity = 256 * 1024   # (the shm lane's payload area is larger: every partner link buffers size x this)

    def __init__(self, rank: int, size: int, socks: Dict[int, socket.socket]):
        self.rank, self.size = rank, size
        p = 1 << (size.bit_length() - 1)
        self._steps = p.bit_length() - 1
        self._proxy = rank - p if rank >= p else None
        self._extra = rank + p if rank < p and rank + p < size else None
        self._links = LaneLinks(socks, size * (self.capacity + 8) + _BODY.size, self._on_frame, self._lost)
        self._mutex = threading.Lock()
        self._posted = 0
        self._cur: Optional[_Proposal] = None
        self._own_fast: Set[int] = set()   # this rank's fast entries not yet decided everywhere it matters
        self._prune_at = 64   # when to drop the old ones from _own_fast (a number, not a len() per post)
        # Frames that arrived for numbers this rank has not posted yet: (number, tag) -> (peer, digest, entries).
        self._inbox: Dict[Tuple[int, int], Tuple[int, int, Entries]] = {}
        self._slow: List[Tuple[int, int]] = []   # numbers known to be slow (first, last)
        self._closed_own = False
        self._closed_at = _NEVER   # the fewest entries any closed rank posted (later numbers are slow)
        #: Whether some rank is known to have closed its lane (no entry can be fast any more).
        self.closed = False

    # -- the board interface ---------------------------------------------------------------------------------------

    @property
    def fds(self) -> List[int]:
        """Descriptors the engine's selector watches; :meth:`drain` when one is readable."""
        return list(self._links.by_fd)

    def drain(self, fd: int) -> None:
        """Take in what a partner sent (the engine's driver calls this when ``fd`` is readable)."""
        with self._mutex:
            links = self._links
            peer = links.by_fd.get(fd)
            if peer is not None:
                links.read(peer)
            if links.queued:
                links.flush()
            self._progress()

    def post_slow(self, count: int = 1) -> None:
        """Post ``count`` slow entries (nothing is sent unless a partner already waits for one of them)."""
        with self._mutex:
            first = self._posted + 1
            self._posted += count
            if self._inbox:
                self._answer_waiting(first, self._posted)

    def post_fast(self, digest: int, payload: np.ndarray, header: bytes = b"",
                  skip: Optional[Tuple[int, int]] = None) -> int:
        """Post a fast entry with ``header`` then ``payload`` (an array; ``skip`` is sent too) and return its number."""
        with self._mutex:
            seq = self._posted = self._posted + 1
            # a copy, as on the shared-memory board: an in-place result is written over the caller's input while
            # the payloads are read
            data = memoryview(b"".join((header, payload.data)) if header else payload.tobytes())
            self._cur = _Proposal(seq, digest, data, self.rank)
            self._own_fast.add(seq)
            if seq >= self._prune_at:   # late frames only ever concern the last few
                self._own_fast = {q for q in self._own_fast if q > seq - 32}
                self._prune_at = seq + 32
            links = self._links
            if self._inbox:
                # Partners got here first, maybe long ago: take in what they sent since (a CLOSED from a rank that
                # gave this collective up must win over its old frame).
                links.read_ready()
            if links.queued:
                links.flush()
            self._progress()
            return seq

    def decide(self, seq: int, timeout: float) -> Tuple[bool, Optional[List[memoryview]]]:
        """Wait up to ``timeout`` seconds for entry ``seq`` (this rank's fast one) to be decided: ``(False, None)``
        while undecided, ``(True, payloads)`` (every rank's, in rank order) when fast, ``(True, None)`` when slow.

        Raises:
            PeerError: a partner sent a malformed frame.
        """
        deadline: Optional[float] = None
        events: List[Tuple[int, int]] = []
        links = self._links
        while True:
            with self._mutex:
                if events:   # (post_fast made all the progress there was before)
                    for fd, _ in events:
                        peer = links.by_fd.get(fd)
                        if peer is not None:
                            links.read(peer)
                    self._progress()
                if links.queued:
                    links.flush()
                    self._progress()
                cur = self._cur
                assert cur is not None and cur.seq == seq, "decide() is for this rank's own proposal"
                if cur.outcome is not None:
                    if not cur.outcome:
                        self._cur = None
                        return True, None
                    entries = cur.entries
                    return True, list(map(entries.__getitem__, range(self.size)))   # rank order, no frame
                waiting_out = links.queued
            if not waiting_out:   # (an empty poll is the timeout)
                events = links.poll.poll(timeout * 1000 + 1)
                if not events:
                    return False, None
                continue
            # a partner's socket is full: poll briefly, so that the queue is flushed as room appears
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout
            if now >= deadline:
                return False, None
            events = links.poll.poll(min(deadline - now, 0.001) * 1000 + 1)

    def done_reading(self) -> None:
        """This rank computed its result from the payloads of its fast entry."""
        self._cur = None   # decided: nothing about it changes any more

    def missing(self, seq: int) -> List[int]:
        """The partner whose frame for ``seq`` this rank waits for (it may wait on others in turn)."""
        cur = self._cur
        if cur is None or cur.seq != seq or cur.outcome is not None:
            return []
        peer = self._stage_peer(cur.stage)
        return [] if peer is None else [peer]

    def close(self, abandon: bool = False) -> None:
        """Post no more entries: every later number is slow on every rank. ``abandon`` (the engine is ending): this
        rank's own undecided proposal counts as slow too, so that no rank completes a collective it gave up."""
        with self._mutex:
            if self._closed_own:
                return
            self._closed_own = True
            cur = self._cur
            abandoned = abandon and cur is not None and cur.outcome is None
            self._note_closed(cur.seq - 1 if abandoned and cur is not None else self._posted, source=None)

    def release(self) -> None:
        """Close the connections."""
        with self._mutex:
            self._links.close()

    # -- the protocol ------------------------------------------------------------------------------------------------

    def _stage_peer(self, stage: int) -> Optional[int]:
        if self._proxy is not None:
            return self._proxy
        if stage == 0:
            return self._extra
        if stage <= self._steps:
            return self.rank ^ (1 << (stage - 1))
        return None

    def _progress(self) -> None:
        """Move this rank's proposal on as far as the frames in hand allow (holding the mutex)."""
        cur = self._cur
        if cur is None or cur.outcome is not None:
            return
        if (self._slow or self.closed) and self._known_slow(cur.seq):
            self._decide_slow(cur)
            return
        if self._proxy is not None:   # an extra rank: its entry to the proxy, everything back
            if not cur.sent:
                self._send_entries(self._proxy, cur, PRE, cur.entries)
                cur.sent = True
            got = self._inbox.pop((cur.seq, RESULT), None)
            if got is not None:
                cur.entries.update(got[2])
                cur.stage = 1
                self._decided(cur, True)
            elif self._proxy in self._links.gone:
                self._decide_slow(cur)
            return
        if cur.stage == 0:
            if self._extra is not None:
                got = self._inbox.pop((cur.seq, PRE), None)
                if got is None:
                    if self._extra in self._links.gone:
                        self._decide_slow(cur)
                    elif not cur.sent:   # the extra rank may be computing: ask for its entry
                        self._links.signal(self._extra, cur.seq, cur.seq, CALL)
                        cur.sent = True
                    return
                if got[1] != cur.digest:
                    self._decide_slow(cur)
                    return
                cur.entries.update(got[2])
            cur.stage, cur.sent = 1, False
        while cur.stage <= self._steps:
            k = cur.stage - 1
            partner = self.rank ^ (1 << k)
            if not cur.sent:
                self._send_entries(partner, cur, k, cur.entries)
                cur.sent = True
            got = self._inbox.pop((cur.seq, k), None)
            if got is None:
                if partner in self._links.gone:
                    self._decide_slow(cur)
                return
            if got[1] != cur.digest:
                self._decide_slow(cur)
                return
            cur.entries.update(got[2])
            cur.stage, cur.sent = cur.stage + 1, False
        if self._extra is not None:
            self._send_entries(self._extra, cur, RESULT, cur.entries)
        self._decided(cur, True)

    def _decided(self, cur: _Proposal, fast: bool) -> None:
        if fast and len(cur.entries) != self.size:
            raise PeerError(f"the fast lane's entry {cur.seq} holds the payloads of ranks {sorted(cur.entries)} only",
                            peer=self._stage_peer(0))
        cur.outcome = fast
        if self._inbox:
            for key in [k for k in self._inbox if k[0] == cur.seq]:   # e.g. a CALL answered by this rank's PRE
                del self._inbox[key]

    def _decide_slow(self, cur: _Proposal) -> None:
        self._decided(cur, False)
        self._tell_slow(cur)

    def _tell_slow(self, cur: _Proposal) -> None:
        """``cur`` is slow: tell every partner this rank has not sent its step of it yet."""
        s = cur.seq
        if self._proxy is not None:
            if not cur.sent:
                self._links.signal(self._proxy, s, s, SLOW)
            return
        stage, sent = cur.stage, cur.sent
        if stage == 0 and self._extra is not None and not sent:
            self._links.signal(self._extra, s, s, SLOW)
        for st in range(max(1, stage), self._steps + 1):
            if st == stage and sent:
                continue
            self._links.signal(self.rank ^ (1 << (st - 1)), s, s, SLOW)
        if self._extra is not None and (stage > 0 or sent):   # it sent us its entry, or we called it: it waits
            self._links.signal(self._extra, s, s, SLOW)

    def _known_slow(self, seq: int) -> bool:
        if seq > self._closed_at:
            return True
        for first, last in self._slow:
            if first <= seq <= last:
                return True
        return False

    def _answer_waiting(self, first: int, last: int) -> None:
        """Slow entries ``first..last`` were posted: answer partners whose fast frames for them arrived earlier."""
        for key in [k for k in self._inbox if first <= k[0] <= last]:
            peer, _digest, _entries = self._inbox.pop(key)
            if key[1] != RESULT:
                self._links.signal(peer, key[0], key[0], SLOW)

    def _note_closed(self, posted: int, source: Optional[int]) -> None:
        """A rank (this one when ``source`` is None) closed after ``posted`` entries: pass it on once."""
        if posted >= self._closed_at:
            return
        self._closed_at = posted
        self.closed = True
        for peer in self._links.peers:
            if peer != source:
                self._links.signal(peer, posted, _NEVER, CLOSED)
        cur = self._cur
        if cur is not None and cur.outcome is None and cur.seq > posted:
            self._decide_slow(cur)

    # -- frames in -------------------------------------------------------------------------------------------------

    def _on_frame(self, peer: int, seq: int, last: int, tag: int, body: memoryview) -> None:
        if tag == SLOW:
            if not self._known_slow(seq):
                # only numbers this rank has yet to decide matter: its own later ones, or the one it proposed
                floor = self._cur.seq if self._cur is not None else self._posted + 1
                self._slow = [r for r in self._slow if r[1] >= floor] + [(seq, last)]
            cur = self._cur
            if cur is not None and cur.outcome is None and seq <= cur.seq <= last:
                self._decide_slow(cur)
            return
        if tag == CLOSED:
            self._note_closed(seq, source=peer)
            return
        digest, entries = self._parse_entries(peer, body) if tag != CALL else (0, {})
        cur = self._cur
        if cur is not None and cur.seq == seq:
            if cur.outcome is None:
                self._inbox[(seq, tag)] = (peer, digest, entries)
            return   # decided: this rank already sent this partner what it needs
        if seq in self._own_fast:
            return   # an earlier proposal of this rank, decided
        if seq > self._posted:
            self._inbox[(seq, tag)] = (peer, digest, entries)   # answered when this rank posts it
        elif tag != RESULT:
            self._links.signal(peer, seq, seq, SLOW)   # this rank's entry is slow: the partner waits for nothing

    def _parse_entries(self, peer: int, body: memoryview) -> Tuple[int, Entries]:
        end = len(body)
        if end < _BODY.size:
            raise PeerError(f"rank {peer} sent a malformed fast-lane frame ({end} bytes)", peer=peer)
        if end >= _BODY_ONE.size:
            digest, count, _, q, n = _BODY_ONE.unpack_from(body)
            if count == 1:
                if q >= self.size or end != _BODY_ONE.size + n:
                    raise PeerError(f"rank {peer} sent a malformed fast-lane frame", peer=peer)
                return digest, {q: body[_BODY_ONE.size:]}
        digest, count, _ = _BODY.unpack_from(body)
        at = _BODY.size + 8 * count
        if at > end or count > self.size:
            raise PeerError(f"rank {peer} sent a malformed fast-lane frame", peer=peer)
        table = struct.unpack_from(f"<{2 * count}I", body, _BODY.size)
        entries: Entries = {}
        for i in range(0, 2 * count, 2):
            q, n = table[i], table[i + 1]
            if q >= self.size:
                raise PeerError(f"rank {peer} sent a fast-lane entry of rank {q}", peer=peer)
            entries[q] = body[at:at + n]
            at += n
        if at != end:
            raise PeerError(f"rank {peer} sent a malformed fast-lane frame", peer=peer)
        return digest, entries

    def _lost(self, peer: int) -> None:
        """A partner's connection ended: it shut down (after its CLOSED) or died. Nobody proposes again (this rank
        passes on a CLOSED of the entries it posted, which no rank can have decided fast without it), and a
        proposal that still waits for that partner's frame is slow (:meth:`_progress`); numbers decided before stay
        decided, so an orderly shutdown never turns a collective others finished into a slow one here."""
        self._note_closed(self._posted, source=peer)

    # -- frames out ------------------------------------------------------------------------------------------------

    def _send_entries(self, peer: int, cur: _Proposal, tag: int, entries: Entries) -> None:
        if len(entries) == 1:   # the first step's frame: one struct for everything before the bytes
            for q, data in entries.items():
                n = len(data)
                self._links.send(peer, [_ONE.pack(cur.seq, cur.seq, tag, _ONE.size - HEADER.size + n, cur.digest, 1, 0,
                                            q, n), data], _ONE.size + n)
            return
        table: List[int] = []
        parts: List[Any] = [b""]
        nbytes = 0
        for q, data in entries.items():
            n = len(data)
            table += (q, n)
            parts.append(data)
            nbytes += n
        body = _BODY.pack(cur.digest, len(entries), 0) + struct.pack(f"<{len(table)}I", *table)
        nbytes += len(body)
        parts[0] = HEADER.pack(cur.seq, cur.seq, tag, nbytes) + body
        self._links.send(peer, parts, nbytes + HEADER.size)


def connect_tcp_lane(boot: Bootstrap) -> TcpLane:
    """Connect this rank to its partners (authenticated, as the TCP mesh) and return its lane board.

    Raises:
        TransportError: a partner did not publish its address, could not be reached or failed the handshake.
    """
    socks = connect_world(boot.scoped("-lane"), peers=partners(boot.rank, boot.size))
    return TcpLane(boot.rank, boot.size, {peer: sock for peer, sock in enumerate(socks) if sock is not None})
