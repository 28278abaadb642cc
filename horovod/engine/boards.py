"""The engine's agreement boards and where each comes from.

Boards are how ranks agree without the coordinator: the fast lane's (lone blocking collectives:
:mod:`horovod.engine.lane_board` on one host, :mod:`horovod.engine.tcp_lane` across hosts and on the tcp and mpi
transports) and the warm path's round board (:mod:`horovod.engine.shm_round_board` on one host,
:mod:`horovod.engine.tcp_round_board` across hosts). They belong to the engine; the transports only lend
them primitives: the shm world group's spare segment space and wake-ups, and authenticated TCP connections.
"""
from __future__ import annotations

from typing import List, Optional, Protocol, Tuple

import numpy as np

from horovod.engine.config import Config
from horovod.engine.lane_board import ShmLane
from horovod.engine.shm_round_board import ShmRoundBoard
from horovod.engine.tcp_lane import connect_tcp_lane
from horovod.engine.tcp_round_board import connect_round_board
from horovod.engine.timeline import Timeline
from horovod.transport.base import MIN, Bootstrap, Transport
from horovod.transport.shm_group import ShmGroup


class RoundBoard(Protocol):
    """Where the ranks AND a short vector of uint64 words once per engine round, without blocking (the engine's
    warm path): :class:`~horovod.engine.shm_round_board.ShmRoundBoard` on one host,
    :class:`~horovod.engine.tcp_round_board.TcpRoundBoard` across hosts."""

    words: int
    #: Whether rounds complete only as other ranks pass frames on (they must keep driving until it is done).
    relayed: bool

    @property
    def fds(self) -> List[int]:
        """File descriptors that become readable when the board may have moved (call :meth:`drain` then)."""

    def drain(self, fd: int) -> None:
        """Take in what woke ``fd``."""

    def post(self, round_no: int, vector: np.ndarray) -> None:
        """Post this rank's vector of ``round_no`` (rounds are numbered 1, 2, ... and posted in order)."""

    def highest(self) -> int:
        """The latest round any rank is known to have posted."""

    def complete(self, round_no: int) -> bool:
        """Whether every rank's vector of ``round_no`` is in."""

    def result(self, round_no: int, length: int, out: np.ndarray) -> bool:
        """The AND of ``round_no``'s first ``length`` words into ``out``; False while it is not complete."""

    def set_waiting(self, waiting: bool) -> None:
        """This rank is about to sleep in its selector (a board that wakes sleepers needs to know)."""

    @property
    def closed(self) -> bool:
        """Whether some rank takes no part in rounds."""

    def close(self) -> None:
        """Stop taking part."""


class LaneBoard(Protocol):
    """Where every rank posts one entry per collective on the world, fast (a digest and a payload) or slow, and
    reads entry ``s`` of every rank (the fast lane, :mod:`horovod.engine.fast_lane`):
    :class:`~horovod.engine.lane_board.ShmLane` on one host, :class:`~horovod.engine.tcp_lane.TcpLane` over TCP."""

    #: The most payload bytes one entry may carry.
    capacity: int

    @property
    def closed(self) -> bool:
        """Whether some rank closed its lane (no entry can be fast any more)."""

    @property
    def fds(self) -> List[int]:
        """Descriptors the engine's selector watches (call :meth:`drain` when one is readable)."""

    def drain(self, fd: int) -> None:
        """Take in what woke ``fd``."""

    def post_slow(self, count: int = 1) -> None:
        """Post ``count`` slow entries."""

    def post_fast(self, digest: int, payload: np.ndarray, header: bytes = b"",
                  skip: Optional[Tuple[int, int]] = None) -> int:
        """Post a fast entry (``header``, then ``payload``); its number, or 0 when the board cannot take one now."""

    def decide(self, seq: int, timeout: float) -> Tuple[bool, Optional[List[memoryview]]]:
        """Wait up to ``timeout`` for entry ``seq``: (decided, every rank's payload when fast, else None)."""

    def done_reading(self) -> None:
        """The caller has read the payloads :meth:`decide` returned."""

    def missing(self, seq: int) -> List[int]:
        """Ranks this rank still waits for, for entry ``seq``."""

    def close(self, abandon: bool = False) -> None:
        """Post no more entries (every later one counts as slow; with ``abandon``, this rank's undecided proposal
        too: the engine is ending)."""

    def release(self) -> None:
        """Let go of what the board holds (connections, views of shared memory)."""


def open_boards(config: Config, world: Transport, boot: Bootstrap,
                spin_us: float) -> Tuple[Optional[RoundBoard], Optional[LaneBoard]]:
    """The warm path's round board and the fast lane's board of this engine (collective: every rank builds each, or
    none).

    In the shm world group's segments on one host, both. Elsewhere both go over TCP among every rank's log2(size)
    partners, when every rank wants them (one small allreduce decides both): the lane when every rank has it on, the
    round board only for a job that spans hosts whose ranks all agree to use rounds (a response cache, and no
    timeline recorded from the start: the timeline shows every negotiation). A job of one host on the tcp or mpi
    transport keeps the coordinator for asynchronous work (its lone blocking collectives take the fast lane): one
    host never has the ranks that make the coordinator the bottleneck.
    """
    if isinstance(world, ShmGroup) and world.world_ready:
        rounds, lane = ShmRoundBoard(world), ShmLane(world, spin_us)
        world.attach(rounds)
        world.attach(lane)
        return rounds, lane
    if boot.size < 2:
        return None, None
    wants_rounds = (boot.local_size != boot.size and config.cache_capacity > 0
                    and not Timeline.records(config, boot.rank))
    wants = np.array([int(wants_rounds), int(config.fast_lane)], dtype=np.int32)
    world.allreduce(wants, MIN)
    round_board = connect_round_board(boot) if wants[0] else None
    try:
        return round_board, connect_tcp_lane(boot) if wants[1] else None
    except Exception:
        if round_board is not None:
            round_board.close()
        raise
