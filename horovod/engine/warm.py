"""The runtime's part that runs the warm path's rounds (the bookkeeping is :mod:`horovod.engine.rounds`'s).

It owns the round board and this rank's :class:`~horovod.engine.rounds.RoundState`; the runtime calls it from its
drive loop (one driver at a time) and hands it the coordinator's messages, which it keeps until their round is
finished here (see the ordering rule in :mod:`horovod.engine.rounds`).

Fences. The ordering rule needs every message the coordinator sent before it posted a round to be in the
receiver's hands when that round completes there. Over a Unix socket (ranks of rank 0's host) it is: the message
was written before the post that the round's completion depends on. Over TCP (other hosts) it may still be on its
way, since the round completed over other connections. So rank 0, when it has sent anything since its last post,
sends each TCP peer a small *fence* message after it and before posting the next round, and sets a flag in that
round's vector; a rank reached over TCP that finishes a flagged round first waits (without blocking: the drive
loop comes back when its control socket is readable) until the fence is in, and with it every message before it.
Only cold steps send anything down, so a warm step sends no fence.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional

from horovod.engine import ops
from horovod.engine.messages import ControlMessage, Request, Response
from horovod.engine.rounds import HEADER_WORDS, RoundState, fenced
from horovod.engine.boards import RoundBoard
from horovod.transport.sockets import PeerError

logger = logging.getLogger(__name__)

#: Longest sleep of a rank waiting in a round (a wake-up lost between a post and the sleeper's flag costs this).
RECHECK_S = 0.01
#: Longest a rank going down in order waits for the round in progress to finish (see finish_open_round).
LEAVE_WAIT_S = 2.0


class WarmPath:
    """Rounds on the board of the world transport.

    Args:
        board: the world transport's round board.
        capacity: response-cache slots.
    """

    def __init__(self, board: RoundBoard, capacity: int, control=None, coordinator: bool = False):
        self.board = board
        self.state = RoundState(capacity)
        self.lock = threading.Lock()   # RoundState is touched by flushing user threads and by the driver
        self.deferred: Deque[ControlMessage] = deque()
        # Fences (see the module docstring): rank 0 fences the ranks it reaches over TCP; they wait for fences.
        tcp = [peer for peer, sock in (control.peers.items() if control is not None else ())
               if sock.family != socket.AF_UNIX]
        self._control = control
        self.fence_to: List[int] = tcp if coordinator else []
        self.awaits_fences = bool(tcp) and not coordinator
        self.sent_since_post = False   # rank 0: messages went out since its last post
        self.fenced = -1               # a worker: the round tag of the last fence received

    @classmethod
    def open(cls, board: Optional[RoundBoard], config, size: int, control, timeline_enabled: bool,
             coordinator: bool = False) -> Optional["WarmPath"]:
        """This engine's warm path over ``board``, or None (then this rank closes the board, and no rank uses
        rounds)."""
        if size < 2 or board is None:
            return None
        capacity = min(int(config.cache_capacity), 64 * (board.words - HEADER_WORDS))
        if capacity <= 0 or timeline_enabled:
            board.close()
            return None
        return cls(board, capacity, control, coordinator)

    @property
    def usable(self) -> bool:
        """Whether every rank takes part in rounds (checked by the coordinator before it assigns slots)."""
        return not self.board.closed

    def fence(self, msg: ControlMessage) -> bool:
        """Take ``msg`` if it is a fence (a worker); True if it was."""
        if not msg.fence:
            return False
        self.fenced = max(self.fenced, msg.round)
        return True

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
                read_control: Callable[[], bool], answer: Callable[[], bool]) -> None:
        """Make every step of the rounds that can be made now: run the coordinator's messages whose round is
        finished, finish the open round when everyone posted, send stale hits in full, post the next round."""
        state, board = self.state, self.board
        while True:
            self.run_deferred(run_message)
            if state.in_round:
                out = state.result_buffer()
                if not board.result(state.posted, state.length, out):
                    return
                # Everything the coordinator sent before it posted this round must run first. Over Unix sockets it
                # has arrived; over TCP it has once the fence that followed it is here.
                if not read_control():
                    return
                if self.awaits_fences and fenced(out) and self.fenced < state.posted - 1:
                    return
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
                fence = bool(self.fence_to) and self.sent_since_post
                vector = state.vector(fenced=fence)
            if fence:
                self._send_fence(state.posted - 1)
            board.post(state.posted, vector[:state.length])

    def _send_fence(self, tag: int) -> None:
        """Rank 0, before it posts round ``tag + 1``: after everything it sent, a fence to each TCP peer."""
        self.sent_since_post = False
        failed = self._control.send_many(self.fence_to, ControlMessage(round=tag, fence=True))
        if failed:
            raise PeerError(f"ranks {failed} are unreachable (they exited or crashed)", peer=failed[0])

    def finish_open_round(self, advance: Callable[[], bool], seconds: float = LEAVE_WAIT_S) -> None:
        """Before going down in order: finish the round in progress. On a board that relays (TCP) the frames this
        rank needs may still be on their way through ranks that keep driving; a rank that left in order finished
        the round, so everyone posted it. Bounded by ``seconds`` (a round some rank never posted cannot finish)."""
        deadline = time.monotonic() + seconds
        while advance() and self.state.in_round and self.board.relayed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            select.select(self.board.fds, [], [], min(remaining, RECHECK_S))

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
            return self.board.complete(state.posted)
        return self.board.highest() > state.posted

    def sleep_cap(self) -> Optional[float]:
        """The longest this rank may sleep in ``select`` (None: no limit from the rounds)."""
        state = self.state
        if state.in_round or state.hits:
            return RECHECK_S
        return None

    def next_deadline(self) -> Optional[float]:
        # Under the lock: user threads add hits (take) while the driver computes its select timeout; iterating the
        # hits unlocked failed a TF graph's kernels with "dictionary changed size during iteration".
        with self.lock:
            return self.state.next_deadline()

    def close(self) -> None:
        self.board.close()

