"""The fast lane: a board in shared memory on which the ranks of one host agree on small blocking collectives
themselves.

Every collective a rank issues on the world group takes the next number of its *lane sequence* (1, 2, ...). For
each number a rank posts one entry: *slow* (the collective goes to the coordinator as usual) or *fast* with a
digest of the collective's signature and its payload. Entry ``s`` of every rank decides ``s`` the same way on every
rank: fast if all of them are fast with one digest, slow otherwise. A fast entry is decided without any message:
each rank reads everyone's payload and computes the same result. Ranks issue the same collectives on the world
group, so their ``s``-th entries belong together whatever their timing (the engine proposes a fast entry only when
nothing else is in flight on that rank, see :mod:`horovod.engine.fast_lane`).

Layout, in each rank's world segment (written only by its owner, read by everyone):

* int64 counters at :data:`~horovod.transport.shm_node.LANE_FIELDS`: ``posted`` (entries posted so far),
  ``closed`` (no entry will follow: entries after ``posted`` count as slow), ``done`` (this rank will not read
  any entry up to this number again), ``waiting`` (this rank sleeps until an entry arrives: wake it), and for
  each of two fast records its ``seq``, ``digest`` and ``nbytes``;
* the two records' payloads (up to :data:`~horovod.transport.shm_node.LANE_PAYLOAD_BYTES` each).

Consecutive fast entries alternate between the records, and a rank rewrites a record only when every rank's
``done`` has passed the entry it held, so back-to-back calls never wait for a slow reader. A record is written
before ``posted`` covers it and read after, which x86's store and load ordering makes safe (the shm transport is
x86-only for the same reason). Posting wakes only ranks that said they sleep; a wake-up lost to a store-load race
costs one :data:`RECHECK_S` re-check, never a hang.
"""
from __future__ import annotations

import functools
import time
from typing import List, Optional, Tuple

import numpy as np

from horovod.transport.shm_group import ShmGroup
from horovod.transport.shm_node import LANE_FIELD_COUNT, LANE_FIELDS, LANE_PAYLOAD_BYTES, lane_payload_offset
from horovod.transport.spin import Spinner

POSTED, CLOSED, DONE, WAITING = range(4)
SEQ, DIGEST, NBYTES = (4, 5), (6, 7), (8, 9)   # per fast record
RECHECK_S = 0.01   # the longest a sleeping rank goes without re-reading the board


class ShmLane:
    """This rank's view of the fast-lane board of a shm world group.

    Args:
        group: the world group (its segments are mapped already).
        spin_us: how long to re-read the board before sleeping (0 on an oversubscribed host).

    :meth:`post_fast` and :meth:`decide` come from one thread at a time (the engine's driver); every post is made
    under the engine's lock.
    """

    def __init__(self, group: ShmGroup, spin_us: float):
        self._group = group
        self.rank, self.size = group.rank, group.size
        maps = group.segment_maps()
        self._fields = [memoryview(m)[LANE_FIELDS:LANE_FIELDS + 8 * LANE_FIELD_COUNT].cast("q") for m in maps]
        off = lane_payload_offset(self.size)
        self._payloads = [[memoryview(m)[off + k * LANE_PAYLOAD_BYTES:off + (k + 1) * LANE_PAYLOAD_BYTES]
                           for k in (0, 1)] for m in maps]
        self._own: Optional[memoryview] = self._fields[self.rank]   # None once released
        self._peers = [q for q in range(self.size) if q != self.rank]
        self._spinner = Spinner(spin_us)
        self._proposals = 0   # fast entries posted so far (their record alternates)
        self._reading = 0     # the fast entry this rank has out and still has to read the others' for
        self.capacity = LANE_PAYLOAD_BYTES
        # Peers wake this rank through the group's descriptor, which the engine's selector does not watch.
        self.fds: List[int] = []

    def drain(self, fd: int) -> None:
        """Nothing to take in: the board is shared memory."""

    @property
    def closed(self) -> bool:
        """Whether any rank closed its lane (then no entry can be fast any more)."""
        for f in self._fields:   # plain loops on the board: asked on every collective
            if f[CLOSED]:
                return True
        return False

    def post_slow(self, count: int = 1) -> None:
        """Post ``count`` slow entries."""
        own = self._own
        assert own is not None, "fast lane used after release()"
        own[POSTED] += count
        own[DONE] = own[POSTED] if not self._reading else self._reading - 1
        self._wake_sleepers()

    def post_fast(self, digest: int, payload: np.ndarray, header: bytes = b"",
                  skip: Optional[Tuple[int, int]] = None) -> int:
        """Post a fast entry with ``header`` then ``payload`` (a contiguous array; both together at most
        :attr:`capacity` bytes) and return its number; 0 (nothing posted) while a rank may still read the record it
        would overwrite, which the caller then posts as slow instead (it never waits here). ``skip``: a range of
        ``payload``'s bytes nobody reads, left out of the record."""
        own, fields = self._own, self._fields
        assert own is not None, "fast lane used after release()"
        k = self._proposals & 1
        previous = own[SEQ[k]]
        if previous:
            for q in self._peers:   # a rank that closed its lane reads no more entries
                if fields[q][DONE] < previous and not fields[q][CLOSED]:
                    return 0
        record = self._payloads[self.rank][k]
        h = len(header) if header else 0
        record[:h] = header
        n = payload.nbytes
        if n:   # slice assignments of bytes: cheaper than any numpy call (a view of no bytes cannot be cast)
            data, (a, b) = payload.data.cast("B"), skip or (n, n)
            record[h:h + a] = data[:a]
            record[h + b:h + n] = data[b:]
        own[NBYTES[k]] = h + n
        own[DIGEST[k]] = digest
        seq = own[POSTED] + 1
        own[SEQ[k]] = seq
        self._reading = seq
        own[DONE] = seq - 1
        own[POSTED] = seq
        self._proposals += 1
        self._wake_sleepers()
        return seq

    def decide(self, seq: int, timeout: float) -> Tuple[bool, Optional[List[memoryview]]]:
        """Wait up to ``timeout`` seconds for every rank's entry ``seq`` (this rank's own fast one).

        Returns ``(False, None)`` when not every entry arrived in time, else ``(True, payloads)`` with every rank's
        payload in rank order when all entries are fast with this rank's digest, or ``(True, None)`` (slow).  The
        payloads are views of the records, valid until :meth:`done_reading` (the caller reduces them first: no
        copy); after a slow decision the entry is already done.

        Raises:
            TransportError: a peer exited while this rank waited for it.
        """
        fields, own = self._fields, self._own
        if not self._arrived(seq) and self._await(seq, timeout):
            return False, None
        assert own is not None, "fast lane used after release()"
        digest = own[DIGEST[0]] if own[SEQ[0]] == seq else own[DIGEST[1]]
        payloads: List[memoryview] = []
        for f, records in zip(fields, self._payloads):
            k = 0 if f[SEQ[0]] == seq else 1 if f[SEQ[1]] == seq else -1
            # a closed rank that never posted ``seq`` has no record for it: slow
            if k < 0 or f[POSTED] < seq or f[DIGEST[k]] != digest:
                self.done_reading()
                return True, None
            payloads.append(records[k][:f[NBYTES[k]]])
        return True, payloads

    def done_reading(self) -> None:
        """This rank read the payloads of its fast entry: the others may overwrite their records."""
        own = self._own
        assert own is not None, "fast lane used after release()"
        self._reading = 0
        own[DONE] = own[POSTED]

    def missing(self, seq: int) -> List[int]:
        """Ranks whose entry ``seq`` has not arrived (a closed lane counts as a slow entry: its owner never posts
        again, so reading ``posted`` and ``closed`` in either order is safe)."""
        fields = self._fields
        return [q for q in self._peers if fields[q][POSTED] < seq and not fields[q][CLOSED]]

    def close(self, abandon: bool = False) -> None:
        """Post no more entries: every later entry of this rank counts as slow (at shutdown, at join, and when the
        lane is off on this rank). ``abandon`` changes nothing here: the others see the board closed before they
        propose again."""
        if self._own is None:
            return
        self._own[CLOSED] = 1
        self._group.wake(self._peers)

    def release(self) -> None:
        """Drop the views of the segments (before the group unmaps them)."""
        for view in self._fields + [v for pair in self._payloads for v in pair]:
            view.release()
        self._fields, self._payloads, self._own = [], [], None

    # -- waiting ---------------------------------------------------------------------------------------------

    def _arrived(self, seq: int, spin_until: float = 0.0) -> bool:
        """Whether every rank's entry ``seq`` is in (:meth:`missing` without building a list); with ``spin_until``
        (a ``perf_counter`` time) re-reads the board until then, in this one call (a spin costs no calls per
        look)."""
        fields, peers, looks = self._fields, self._peers, 0
        while True:
            for q in peers:
                if fields[q][POSTED] < seq and not fields[q][CLOSED]:
                    break
            else:
                return True
            looks += 1
            if not spin_until or (not looks & 31 and time.perf_counter() > spin_until):
                return False

    def _await(self, seq: int, timeout: float) -> List[int]:
        """Spin, then sleep until every rank's entry ``seq`` is in; the ranks still missing after ``timeout``
        seconds."""
        end = self._spinner.start()
        if end is not None:
            arrived = self._arrived(seq, end)
            self._spinner.finish(arrived)
            if arrived:
                return []
        pending = functools.partial(self.missing, seq)
        own = self._own
        assert own is not None, "fast lane used after release()"
        own[WAITING] = 1
        try:
            return self._group.block_until(pending, timeout, "the fast lane", recheck_s=RECHECK_S)
        finally:
            own[WAITING] = 0

    def _wake_sleepers(self) -> None:
        fields = self._fields
        for q in self._peers:
            if fields[q][WAITING]:
                self._group.wake([p for p in self._peers if fields[p][WAITING]])
                return
