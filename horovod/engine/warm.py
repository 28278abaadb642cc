"""The runtime's part that runs the warm path's rounds (the bookkeeping is :mod:`horovod.engine.rounds`'s).

It owns the round board and this rank's :class:`~horovod.engine.rounds.RoundState`; the runtime calls it from its
drive loop (one driver at a time) and hands it the coordinator's messages, which it keeps until their round is
finished here (see the ordering rule in :mod:`horovod.engine.rounds`).
"""
from __future__ import annotations

import logging
import socket
import threading
from collections import deque
from typing import Callable, Deque, Dict, List, Optional

from horovod.engine import ops
from horovod.engine.messages import ControlMessage, Request, Response
from horovod.engine.rounds import HEADER_WORDS, RoundState

logger = logging.getLogger(__name__)

#: Longest sleep of a rank waiting in a round (a wake-up lost between a post and the sleeper's flag costs this).
RECHECK_S = 0.01


def _local_control(control) -> bool:
    """Whether every control connection of this rank is a Unix socket (the ordering rule relies on it)."""
    return bool(control.peers) and all(s.family == socket.AF_UNIX for s in control.peers.values())


class WarmPath:
    """Rounds on the board of the world transport.

    Args:
        board: the world transport's round board.
        capacity: response-cache slots.
    """

    def __init__(self, board, capacity: int):
        self.board = board
        self.state = RoundState(capacity)
        self.lock = threading.Lock()   # RoundState is touched by flushing user threads and by the driver
        self.deferred: Deque[ControlMessage] = deque()

    @classmethod
    def open(cls, world, config, size: int, control, timeline_enabled: bool) -> Optional["WarmPath"]:
        """This engine's warm path, or None (then this rank closes its board, and no rank uses rounds)."""
        if size < 2:
            return None
        board = world.round_board()
        if board is None:
            return None
        capacity = min(int(config.cache_capacity), 64 * (board.words - HEADER_WORDS))
        if capacity <= 0 or timeline_enabled or not _local_control(control):
            board.close()
            return None
        return cls(board, capacity)

    @property
    def usable(self) -> bool:
        """Whether every rank takes part in rounds (checked by the coordinator before it assigns slots)."""
        return not self.board.closed

    # -- issuing -------------------------------------------------------------------------------------------------

    def take(self, requests: List[Request], now: float) -> List[Request]:
        """Keep the hits among ``requests``; returns the rest (for the coordinator)."""
        state = self.state
        with self.lock:
            cold = []
            for req in requests:
                if req.kind == ops.JOIN:
                    state.joined = True
                if not state.take(req, now):
                    cold.append(req)
            return cold

    # -- rounds --------------------------------------------------------------------------------------------------

    def advance(self, now: float, run_message: Callable[[ControlMessage], None],
                run_responses: Callable[[List[Response]], None], send_cold: Callable[[List[Request]], None],
                read_control: Callable[[], None], answer: Callable[[], bool]) -> None:
        """Make every step of the rounds that can be made now: run the coordinator's messages whose round is
        finished, finish the open round when everyone posted, send stale hits in full, post the next round."""
        state, board = self.state, self.board
        while True:
            self.run_deferred(run_message)
            if state.in_round:
                out = state.result_buffer()
                if not board.result(state.posted, state.length, out):
                    return
                # Everything the coordinator sent before it posted this round has arrived: run it first.
                read_control()
                self.run_deferred(run_message, state.posted - 1)
                with self.lock:
                    responses = state.finish(out)
                if responses:
                    run_responses(responses)
                continue
            with self.lock:
                cold = state.stale(now)
            if cold:
                send_cold(cold)
            with self.lock:
                if not state.wants_post(board.highest(), answer() or bool(self.deferred)):
                    return
                vector = state.vector()
            board.post(state.posted, vector[:state.length])

    def run_deferred(self, run_message: Callable[[ControlMessage], None], upto: Optional[int] = None) -> None:
        """Run the kept messages whose round is finished here (all up to ``upto``)."""
        done = self.state.done if upto is None else upto
        deferred = self.deferred
        while deferred and deferred[0].round <= done:
            run_message(deferred.popleft())

    def apply(self, message: ControlMessage, own: Dict[str, Request]) -> None:
        with self.lock:
            self.state.apply(message.invalidate, message.responses, own)

    def joined_done(self) -> None:
        with self.lock:
            self.state.joined = False
            self.state.others_joined = False

    # -- waiting -------------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether a round can be finished or should be posted (for a spinning waiter)."""
        state = self.state
        if state.in_round:
            return not self.board.missing(state.posted)
        return self.board.highest() > state.posted

    def sleep_cap(self) -> Optional[float]:
        """The longest this rank may sleep in ``select`` (None: no limit from the rounds)."""
        state = self.state
        if state.in_round or state.hits:
            return RECHECK_S
        return None

    def next_deadline(self) -> Optional[float]:
        return self.state.next_deadline()

    def close(self) -> None:
        self.board.close()

