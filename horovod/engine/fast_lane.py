"""Tiny blocking allreduces agreed on and reduced by the ranks themselves, without a round trip to the coordinator.

The coordinator path costs a tiny allreduce two control-plane hops with Python at both ends of each; a rank that
has just computed for a while also has to be woken for each hop. On one host the ranks can do better: each posts
its request's digest and its bytes on a board in shared memory (:mod:`horovod.engine.lane_board`), and when every
rank posted the same digest for the same lane number, each reduces all the payloads itself, in rank order, with
the coordinator's own arithmetic (:func:`horovod.engine.negotiation.reduce_inline`), so every rank gets the bytes
the coordinator would have sent. Anything else (a different tensor, a mismatch, a rank busy with other work) makes
the number *slow*, and every rank sends its request to the coordinator as before: errors, joins and stall
reports are unchanged.

Why the lane numbers pair up: every collective a rank issues on the global process set — or on another set of
every rank, which a rank may pass where another passes the global set — takes the next number (the engine posts a
slow entry for everything it does not propose), all ranks issue the same collectives on those sets,
and a rank proposes a fast entry only for a blocking call while nothing else is in flight on it, with no
process set on the coordinator that it serves without being a member. A rank that joins, shuts down or runs with
the lane off closes its lane; its missing entries count as slow.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from horovod.engine import ops
from horovod.engine.lane_board import ShmLane
from horovod.engine.messages import Request
from horovod.engine.negotiation import reduce_inline

logger = logging.getLogger(__name__)

#: Longest stretch a rank waits on the lane before it makes one round of its engine's housekeeping (heartbeats,
#: notices from the coordinator, liveness, stall warnings, and other threads' collectives: the waiting thread
#: holds the drive lock).
HOUSEKEEPING_S = 0.05

_DIGESTS_KEPT = 4096


class FastLane:
    """This rank's use of the fast-lane board.

    Args:
        board: the board in the shm world group's segments (:class:`horovod.engine.lane_board.ShmLane`).
        size: ranks in the job (the global process set).
        stall_warning_s: seconds of waiting before a warning names the ranks that have not arrived (0: never).
        stall_shutdown_s: seconds of waiting after which the engine fails with a StallError (0: never).
    """

    def __init__(self, board, size: int, stall_warning_s: float = 0.0, stall_shutdown_s: float = 0.0):
        self.board = board
        self.size = size
        self._stall_warning_s = stall_warning_s
        self._stall_shutdown_s = stall_shutdown_s
        self._digests: Dict[Tuple, int] = {}
        self.fast = self.slow = 0   # how proposals were decided (diagnostics and tests)
        self.on_stall: Optional[Callable[[], None]] = None   # [hang doctor] called with the stall warning

    @classmethod
    def open(cls, board: Optional[ShmLane], config, size: int) -> Optional["FastLane"]:
        """The lane of this engine over ``board``, or None when there is no board or the lane is turned off here
        (then this rank closes its board, so that the others never wait for its entries)."""
        if size < 2 or board is None:
            return None
        if not config.fast_lane:
            board.close()
            return None
        if config.stall_check_disable:
            return cls(board, size)
        warn = float(config.stall_check_time_seconds)
        # as the coordinator's inspector: a shutdown time below the warning time is raised to it
        shutdown = max(warn, float(config.stall_shutdown_time_seconds)) if config.stall_shutdown_time_seconds else 0.0
        return cls(board, size, warn, shutdown)

    # -- posting (under the engine's lock) ---------------------------------------------------------------------

    def eligible(self, req: Request) -> bool:
        """Whether ``req`` may be proposed (the engine also checks that nothing else is in flight)."""
        return (req.kind == ops.ALLREDUCE and isinstance(req.payload, bytes) and req.process_set == 0
                and req.group is None and len(req.payload) <= self.board.capacity and not self.board.closed)

    def propose(self, req: Request) -> int:
        """Post ``req`` as a fast entry and return its lane number; 0 when the board cannot take one right now
        (then it is posted as slow)."""
        seq = self.board.post_fast(self._digest(req), req.payload)
        if not seq:
            self.board.post_slow(1)
        return seq

    def note(self, requests: Sequence[Request], spanning: Sequence[int] = (0,)) -> None:
        """Post a slow entry for each request on the global process set, or on any set of every rank
        (``spanning``: a rank that passes such a set where another passes the global one must make that rank's
        proposal slow, so that the coordinator reports the mismatch); a join closes the lane."""
        count = 0
        join = False
        for req in requests:
            if req.process_set == 0 or req.process_set in spanning:
                count += 1
                join = join or req.kind == ops.JOIN
        if count:
            self.board.post_slow(count)
        if join:
            # A joined rank issues nothing until the others join too, so it cannot keep numbering entries.
            self.board.close()

    def close(self) -> None:
        self.board.close()

    # -- deciding (holding the engine's drive lock) ------------------------------------------------------------

    def settle(self, seq: int, req: Request, housekeeping: Callable[[], bool]) -> Tuple[str, Optional[bytes]]:
        """Wait for entry ``seq`` of every rank. Returns ``("fast", result)``, ``("slow", None)`` (the request goes
        to the coordinator), ``("finished", None)`` when ``housekeeping()`` found the engine finished meanwhile, or
        ``("stalled", None)`` past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS.

        Raises:
            TransportError: a peer exited while this rank waited for it.
        """
        started = time.monotonic()
        warned = False
        while True:
            decided, payloads = self.board.decide(seq, HOUSEKEEPING_S)
            if decided:
                if payloads is None:
                    self.slow += 1
                    return "slow", None
                self.fast += 1
                return "fast", reduce_inline([req], payloads, self.size)
            if not housekeeping():
                return "finished", None
            waited = time.monotonic() - started
            if self._stall_warning_s and not warned and waited >= self._stall_warning_s:
                warned = True
                logger.warning(
                    "The allreduce '%s' has waited %.0f s for ranks %s to issue it (they are computing, or issue "
                    "different collectives, which would deadlock).", req.name, waited, self.board.missing(seq))
                if self.on_stall is not None:
                    self.on_stall()
            if self._stall_shutdown_s and waited >= self._stall_shutdown_s:
                return "stalled", None

    def _digest(self, req: Request) -> int:
        """A stable 64-bit digest of everything that must agree across ranks (Python's hash() is per process)."""
        key = (req.name, req.kind, req.dtype, req.shape, req.op, req.prescale, req.postscale)
        digest = self._digests.get(key)
        if digest is None:
            if len(self._digests) >= _DIGESTS_KEPT:
                self._digests.clear()
            raw = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
            digest = self._digests[key] = int.from_bytes(raw, "little", signed=True)
        return digest
