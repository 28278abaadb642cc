"""The round board: the ranks of one host AND a short vector of 64-bit words once per engine round.

The engine's warm path (:mod:`horovod.engine.rounds`) runs in numbered *rounds* that every rank takes part in: a
rank posts its vector for round ``r`` (cache-hit bits and a few status words) and, once every rank has posted
``r``, reads all the vectors and ANDs them. Nothing is sent anywhere: each rank writes only its own segment and
reads the others'.

Layout, in each rank's world segment at :func:`~horovod.transport.shm_node.round_board_offset`: int64
``waiting`` (the owner sleeps until a post: wake it) and ``closed`` (the owner takes no part in rounds), then two
records of ``round`` + :data:`~horovod.transport.shm_node.ROUND_WORDS` words, used by round parity. A record is
written before its ``round`` field and read after it (x86 store and load ordering, as the fast lane). Round
``r + 2`` overwrites round ``r``'s record, which is safe without any extra counter: a rank posts ``r + 2`` only
after every rank posted ``r + 1``, which each does only after it finished reading round ``r``.
"""
from __future__ import annotations

import os
from typing import List, Optional

import numpy as np

from horovod.transport.shm_group import ShmGroup
from horovod.transport.shm_node import ROUND_WORDS, round_board_offset

WAITING, CLOSED, RECORDS = 0, 1, 2
_RECORD = 1 + ROUND_WORDS


class ShmRoundBoard:
    """This rank's view of the round board of a shm world group.

    Args:
        group: the world group (its segments are mapped already).

    Used by one thread at a time (the engine's driver).
    """

    words = ROUND_WORDS
    relayed = False

    def __init__(self, group: ShmGroup):
        self._group = group
        self.rank, self.size = group.rank, group.size
        off = round_board_offset(self.size)
        n = 2 + 2 * _RECORD
        self._views = [np.frombuffer(m, dtype=np.uint64, count=n, offset=off) for m in group.segment_maps()]
        # Each record as a view: [round, words...] for parity 0 and 1.
        self._records = [[v[RECORDS + k * _RECORD:RECORDS + (k + 1) * _RECORD] for k in (0, 1)] for v in self._views]
        self._own: Optional[np.ndarray] = self._views[self.rank]
        self._peers = [q for q in range(self.size) if q != self.rank]
        self.wake_fd = group.wake_fd

    # -- posting -----------------------------------------------------------------------------------------------

    def post(self, round_no: int, vector: np.ndarray) -> None:
        """Post ``vector`` (uint64, at most :attr:`words` long) as this rank's entry of ``round_no``."""
        rec = self._records[self.rank][round_no & 1]
        rec[1:1 + vector.size] = vector
        rec[0] = round_no   # after the words: readers check the round first
        views = self._views
        sleepers = [q for q in self._peers if views[q][WAITING]]
        if sleepers:
            self._group.wake(sleepers)

    def posted(self, q: int) -> int:
        """The latest round rank ``q`` posted."""
        recs = self._records[q]
        return int(max(recs[0][0], recs[1][0]))

    def highest(self) -> int:
        """The latest round any rank posted (a rank that has not posted it yet is being called to it)."""
        return max(self.posted(q) for q in range(self.size))

    def missing(self, round_no: int) -> List[int]:
        """Ranks that have not posted ``round_no`` yet."""
        k = round_no & 1
        return [q for q in range(self.size) if int(self._records[q][k][0]) < round_no]

    def complete(self, round_no: int) -> bool:
        """Whether every rank posted ``round_no``."""
        return not self.missing(round_no)

    def result(self, round_no: int, length: int, out: np.ndarray) -> bool:
        """AND every rank's vector of ``round_no`` (first ``length`` words) into ``out``; False while some rank has
        not posted it."""
        k = round_no & 1
        records = self._records
        for q in range(self.size):
            if int(records[q][k][0]) < round_no:
                return False
        out[:length] = records[0][k][1:1 + length]
        for q in range(1, self.size):
            np.bitwise_and(out[:length], records[q][k][1:1 + length], out=out[:length])
        return True

    # -- waking ----------------------------------------------------------------------------------------------

    @property
    def fds(self) -> List[int]:
        """File descriptors the engine's selector watches (a post writes this rank's wake-up pipe when it sleeps)."""
        return [self.wake_fd]

    def drain(self, fd: int) -> None:
        try:
            while os.read(fd, 8):
                pass
        except (BlockingIOError, OSError):
            pass

    # -- state -------------------------------------------------------------------------------------------------

    def set_waiting(self, waiting: bool) -> None:
        if self._own is not None:
            self._own[WAITING] = 1 if waiting else 0

    @property
    def closed(self) -> bool:
        """Whether any rank takes no part in rounds (then the engine never uses them)."""
        return any(int(v[CLOSED]) for v in self._views)

    def close(self) -> None:
        if self._own is not None and not int(self._own[CLOSED]):
            self._own[CLOSED] = 1
            self._group.wake(self._peers)

    def release(self) -> None:
        """Drop the views of the segments (before the group unmaps them)."""
        self._views, self._records, self._own = [], [], None

