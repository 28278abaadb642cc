"""Small blocking collectives agreed on and carried out by the ranks themselves, in one synchronisation.

The coordinator path costs a small collective two control-plane hops with Python at both ends of each (or, warm,
a round and then the data-plane collective: two synchronisations); a rank that has just computed for a while also
has to be woken for each hop. A lone blocking allreduce, broadcast, allgather, reducescatter or alltoall of at most
``HOROVOD_FAST_LANE_BYTES`` per rank (1 MiB on shared memory, 256 KiB over TCP; an allreduce's 512 KiB over all
ranks' payloads) does better. Each rank posts its
request's digest and its bytes on a board — in shared memory on one host (:mod:`horovod.engine.lane_board`), else
passed among log2(size) partners over TCP (:mod:`horovod.engine.tcp_lane`); a broadcast's non-root ranks post no
bytes — and when every rank posted the same digest for the same lane number,
each computes its result from the payloads itself: an allreduce in rank order with the coordinator's own
arithmetic (:func:`horovod.engine.negotiation.reduce_payloads`), so every rank gets the bytes the coordinator
would have sent; a broadcast from the root's payload; an allgather by concatenating the payloads in rank order; a
reducescatter by reducing its own block of every payload; an alltoall by taking its rows out of every payload
(each starts with the rows its rank sends each rank). Anything else (a different tensor, a mismatch, a rank
busy with other work) makes the number *slow*, and every rank sends its request to the coordinator as before:
errors, joins and stall reports are unchanged. A grouped allreduce is one collective too: a group of one tensor
is a lone call, and a group of several that share a dtype, op and scaling posts their concatenation as one payload
(:meth:`FastLane.propose_group`; each rank cuts the reduced bytes back into the group's tensors).

A lone blocking collective too large for the board is still agreed there: its entry carries only what the
others need of its shape (an allgather's rows, an alltoall's splits), and once every rank posted the same digest
each builds the response the coordinator would have sent and runs it on the data plane
(:func:`horovod.engine.lane_use.plane_response`). Where the data travels is part of the digest, so ranks that
would carry it differently (an allgather whose rows fit the board on one rank only) take the coordinator's way.

Why the lane numbers pair up: every collective a rank issues on the global process set — or on another set of
every rank, which a rank may pass where another passes the global set — takes the next number (a grouped call
takes one, however many tensors it has; the engine posts a
slow entry for everything it does not propose), all ranks issue the same collectives on those sets,
and a rank proposes a fast entry only for a blocking call while nothing else is in flight on it, with no
process set on the coordinator that it serves without being a member. A rank that joins, shuts down or runs with
the lane off closes its lane; its missing entries count as slow.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from horovod.engine import ops
from horovod.engine.errors import STALL_WARNING
from horovod.engine.messages import Request

logger = logging.getLogger(__name__)

#: Longest stretch a rank waits on the lane before it makes one round of its engine's housekeeping (heartbeats,
#: notices from the coordinator, liveness, stall warnings, and other threads' collectives: the waiting thread
#: holds the drive lock).
HOUSEKEEPING_S = 0.05

_DIGESTS_KEPT = 4096

#: What the lane decides: every rank's result is a function of every rank's input, read from the board.
LANE_KINDS = (ops.ALLREDUCE, ops.BROADCAST, ops.ALLGATHER, ops.REDUCESCATTER, ops.ALLTOALL)

#: The most payload bytes a rank reads for one allreduce on the lane (np = 2 and 4 measured on 2 cores).
READ_BUDGET = 512 * 1024

_R = TypeVar("_R")


class FastLane:
    """This rank's use of the fast-lane board.

    Args:
        board: the board (:class:`horovod.engine.lane_board.ShmLane` in the shm world group's segments, or
            :class:`horovod.engine.tcp_lane.TcpLane` over TCP; :class:`horovod.engine.boards.LaneBoard`).
        size: ranks in the job (the global process set).
        stall_warning_s: seconds of waiting before a warning names the ranks that have not arrived (0: never).
        stall_shutdown_s: seconds of waiting after which the engine fails with a StallError (0: never).
    """

    def __init__(self, board, size: int, stall_warning_s: float = 0.0, stall_shutdown_s: float = 0.0,
                 limit: Optional[int] = None):
        self.board = board
        self.size = size
        cap = board.capacity if limit is None else min(board.capacity, limit)
        #: The largest payload a rank posts on the board for an allreduce: every rank reads and reduces every
        #: payload, so past READ_BUDGET bytes in all the data plane's reduce-scatter costs less.
        self.limit = min(cap, READ_BUDGET // size)
        #: ... for each kind (``benchmarks/lane_limits.py``, 2 cores, np = 2 and 4): the other kinds' readers take
        #: only their share of the payloads, in one synchronisation instead of the data plane's steps, so up to the
        #: whole area. Each limit is on the tensor's bytes (an alltoall's splits travel in front of them).
        self.limits = {ops.ALLREDUCE: self.limit, ops.ALLGATHER: cap, ops.BROADCAST: cap,
                       ops.ALLTOALL: min(cap, board.capacity - 8 * size), ops.REDUCESCATTER: cap}
        self._stall_warning_s = stall_warning_s
        self._stall_shutdown_s = stall_shutdown_s
        self._digests: Dict[Tuple, int] = {}
        self.fast = self.slow = 0   # how proposals were decided (diagnostics and tests)
        self.on_stall: Optional[Callable[[], None]] = None   # [hang doctor] called with the stall warning

    @classmethod
    def open(cls, board: Optional[Any], config, size: int) -> Optional["FastLane"]:
        """The lane of this engine over ``board``, or None when there is no board or the lane is turned off here
        (then this rank closes its board, so that the others never wait for its entries)."""
        if size < 2 or board is None:
            return None
        if not config.fast_lane:
            board.close()
            return None
        if config.stall_check_disable:
            return cls(board, size, limit=config.fast_lane_bytes)
        warn = float(config.stall_check_time_seconds)
        # as the coordinator's inspector: a shutdown time below the warning time is raised to it
        shutdown = max(warn, float(config.stall_shutdown_time_seconds)) if config.stall_shutdown_time_seconds else 0.0
        return cls(board, size, warn, shutdown, config.fast_lane_bytes)

    # -- posting (under the engine's lock) ---------------------------------------------------------------------

    def placement(self, req: Request, tensor: object) -> Optional[bool]:
        """Whether ``req`` over ``tensor`` may be proposed, and how (the engine also checks that nothing else is in
        flight): ``None`` when it may not (a barrier, a join, Adasum, another process set, a device array; a group
        of several: :meth:`group_placement`); otherwise whether its data travels on the board (its kind's limit, at
        most HOROVOD_FAST_LANE_BYTES) or the lane only agrees and the data plane carries the data."""
        if not (req.kind in LANE_KINDS and req.op != ops.Adasum and req.process_set == 0
                and (req.group is None or req.group[1] == 1)   # (a group of one: a lone call, grouped by name only)
                and type(tensor) is np.ndarray and not self.board.closed
                and (req.kind == ops.ALLREDUCE or self._well_formed(req, tensor))):
            return None
        return tensor.nbytes <= self.limits[req.kind]

    def group_placement(self, requests: Sequence[Request], tensors: Sequence[Any]) -> Optional[bool]:
        """Whether a grouped allreduce of several tensors may be proposed: True when they share one dtype, op and
        scaling and fit the board together (they travel as one payload, their concatenation: the arithmetic is
        elementwise), else None (the coordinator's way)."""
        first, nbytes = requests[0], 0
        for req, tensor in zip(requests, tensors):
            if not (req.kind == ops.ALLREDUCE and req.dtype == first.dtype and req.op == first.op
                    and req.prescale == first.prescale and req.postscale == first.postscale
                    and type(tensor) is np.ndarray):
                return None
            nbytes += tensor.nbytes
        if first.op == ops.Adasum or first.process_set != 0 or self.board.closed or nbytes > self.limit:
            return None
        return True

    def _well_formed(self, req: Request, tensor: np.ndarray) -> bool:
        """What only the coordinator reports on (a root out of range, an allgather of a scalar or of rows of no
        bytes) never goes on the lane, so that it fails there as it always did."""
        if req.kind == ops.BROADCAST:
            return 0 <= req.root < self.size
        if req.kind == ops.ALLGATHER:
            return tensor.ndim > 0 and ops.row_elems(tensor.shape) > 0
        if req.kind == ops.REDUCESCATTER:
            return tensor.ndim > 0
        if req.kind == ops.ALLTOALL:   # (checked when it was issued; the lane relies on it)
            return req.splits is not None and len(req.splits) == self.size
        return True

    def propose(self, req: Request, tensor: Any, on_board: bool) -> int:
        """Post ``req`` as a fast entry and return its lane number; 0 when the board cannot take one right now
        (then it is posted as slow).  ``on_board``: with ``tensor``'s bytes (a broadcast's non-root ranks post
        none), else with only what the others need to run it on the data plane."""
        # What each rank needs of the others' shapes travels first (or alone): an alltoall's splits, and an
        # allgather's rows when the data plane carries them.
        header, skip = b"", None
        if not on_board:
            tensor = np.array(req.splits if req.kind == ops.ALLTOALL else
                              req.shape[:1] if req.kind == ops.ALLGATHER else (), np.int64)
        elif req.kind == ops.BROADCAST and req.root != req.rank:
            tensor = tensor.reshape(-1)[:0]
        elif req.kind in (ops.ALLTOALL, ops.REDUCESCATTER):
            # Nobody reads this rank's own block back (it takes it from its input): it stays off the board.
            counts = (req.splits or ()) if req.kind == ops.ALLTOALL else ops.split_rows(req.shape[0], self.size)
            skip = ops.block_bounds(counts, req.rank, tensor.nbytes // req.shape[0] if req.shape[0] else 0)
            if req.kind == ops.ALLTOALL:   # the rows this rank sends each rank, then the rows (not copied here)
                header = np.array(counts, np.int64).tobytes()
        seq = self.board.post_fast(self._digest(req, on_board), tensor, header, skip)
        if not seq:
            self.board.post_slow(1)
        return seq

    def propose_group(self, requests: Sequence[Request], tensors: Sequence[Any]) -> int:
        """Post a grouped allreduce (:meth:`group_placement`) as one fast entry of its tensors' concatenation; its
        lane number, or 0 as :meth:`propose`."""
        first = requests[0]
        key = (tuple(r.name for r in requests), first.kind, first.dtype, tuple(r.shape for r in requests), first.op,
               first.prescale, first.postscale)
        seq = self.board.post_fast(self._digest_of(key), np.concatenate([t.reshape(-1) for t in tensors]))
        if not seq:
            self.board.post_slow(1)
        return seq

    def note(self, requests: Sequence[Request], spanning: Sequence[int] = (0,)) -> None:
        """Post a slow entry for each collective (a group is one) on the global process set, or on any set of every
        rank (``spanning``: a rank that passes such a set where another passes the global one must make that rank's
        proposal slow, so that the coordinator reports the mismatch); a join closes the lane."""
        count = 0
        join = False
        group = None
        for req in requests:
            if req.process_set == 0 or req.process_set in spanning:
                if req.group is None or req.group != group:   # a grouped call is one collective: one number
                    count += 1
                group = req.group
                join = join or req.kind == ops.JOIN
        if count:
            self.board.post_slow(count)
        if join:
            # A joined rank issues nothing until the others join too, so it cannot keep numbering entries.
            self.board.close()

    def close(self) -> None:
        """The engine is ending: no more entries, and a proposal of this rank still undecided counts as slow."""
        self.board.close(abandon=True)

    def release(self) -> None:
        """Let go of the board (its connections, or its views of the segments) when the engine closes."""
        self.board.release()

    # -- deciding (holding the engine's drive lock) ------------------------------------------------------------

    def settle(self, seq: int, req: Request, housekeeping: Callable[[], bool],
               combine: Callable[[List[memoryview]], _R]) -> Tuple[str, Optional[_R]]:
        """Wait for entry ``seq`` of every rank. Returns ``("fast", combine(payloads))`` with every rank's payload
        in rank order (views of the board, valid only during the call), ``("slow", None)`` (the request goes
        to the coordinator), ``("finished", None)`` when ``housekeeping()`` found the engine finished meanwhile, or
        ``("stalled", None)`` past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS.

        Raises:
            TransportError: a peer exited while this rank waited for it.
        """
        started: Optional[float] = None   # read only once waiting (not on the hot path)
        warned = False
        while True:
            decided, payloads = self.board.decide(seq, HOUSEKEEPING_S)
            if decided:
                if payloads is None:
                    self.slow += 1
                    return "slow", None
                self.fast += 1
                try:
                    return "fast", combine(payloads)
                finally:
                    self.board.done_reading()
            if not housekeeping():
                return "finished", None
            now = time.monotonic()
            if started is None:
                started = now - HOUSEKEEPING_S   # the first decide() waited that long
            waited = now - started
            if self._stall_warning_s and not warned and waited >= self._stall_warning_s:
                warned = True
                logger.warning(STALL_WARNING, self._stall_warning_s,
                               f"  set 0 '{req.name}' ({ops.KIND_NAMES[req.kind].lower()}, on the fast lane): waiting "
                               f"{waited:.0f} s for ranks {self.board.missing(seq)}")
                if self.on_stall is not None:
                    self.on_stall()
            if self._stall_shutdown_s and waited >= self._stall_shutdown_s:
                return "stalled", None

    def _digest(self, req: Request, on_board: bool) -> int:
        """A stable 64-bit digest of everything that must agree across ranks (Python's hash() is per process)."""
        # An allgather's or alltoall's ranks may differ in rows; a broadcast's in nothing, but they must agree on
        # the root.
        shape = req.shape[1:] if req.kind in (ops.ALLGATHER, ops.ALLTOALL) else req.shape
        # Where the data travels is part of it: ranks that would carry it differently never decide fast together.
        key = (req.name, req.kind, req.dtype, shape, req.op, req.prescale, req.postscale, req.root, on_board,
               req.group is None)
        digest = self._digests.get(key)
        return self._digest_of(key) if digest is None else digest

    def _digest_of(self, key: Tuple) -> int:
        digest = self._digests.get(key)
        if digest is None:
            if len(self._digests) >= _DIGESTS_KEPT:
                self._digests.clear()
            raw = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
            digest = self._digests[key] = int.from_bytes(raw, "little", signed=True)
        return digest
