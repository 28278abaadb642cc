"""One shared-memory group's state: its segments, its step counters and how a rank waits for its peers.

:class:`ShmGroup` is the base of :class:`horovod.transport.shm.ShmTransport`, which adds the collectives; the
design (segments, halves, step counters, wake-ups) is described in that module's docstring.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import select
import time
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from horovod.transport import cma
from horovod.transport.base import Transport, TransportError
from horovod.transport.cma import CmaError, Reader
from horovod.transport.spin import Spinner, default_budget_us
from horovod.transport.shm_node import (DEFAULT_SPIN_US, HELLO, LINE_BYTES, MAGIC, ONE, POLL_DEAD, Node, map_segment,
                                        new_segment_fd, recv_msg, segment_layout, send_msg)

logger = logging.getLogger(__name__)

#: A broadcast's pipeline piece while the ranks spin (np = 2, 1 MiB: 230 -> 105 us against a 2 MiB half per step),
#: or 1 / BROADCAST_PIECES of a larger one, up to a half (a step per 256 KiB cost 64 MiB at np = 2 half its time).
BROADCAST_PIECE_BYTES, BROADCAST_PIECES = 256 * 1024, 8


class Releasable(Protocol):
    """Something holding views into a group's segments (:meth:`ShmGroup.attach`)."""

    def release(self) -> None:
        """Drop every view into the segments."""


def _write_wakes(fds: Sequence[int]) -> None:
    """One wake-up to each of ``fds`` (peers' eventfds or pipes)."""
    for fd in fds:
        try:
            os.write(fd, ONE)
        except BlockingIOError:  # a full pipe already holds a wake-up
            pass


class ShmGroup(Transport):
    """Memory, progress and teardown of one group of local ranks (the collectives are the subclass's).

    Attributes:
        rank: this process's index in the group.
        size: the number of processes in the group.
    """

    def __init__(self, node: Node, members: Tuple[int, ...], seg_fds: Optional[Dict[int, int]] = None):
        self._node = node
        self._members = members
        self.rank, self.size = members.index(node.rank), len(members)
        self._closed = False
        self._ready = False
        self._op = "setup"
        self._seq = 0
        self._rounds = 0
        self._free_at = [0, 0]
        # Objects holding views into this group's segments (the engine's boards): released before unmapping.
        self._attached: List[Releasable] = []
        self._maps: List[mmap.mmap] = []
        self._typed_cache: Dict[Tuple[np.dtype, int], List[np.ndarray]] = {}
        self._sub_cache: Dict[Tuple[np.dtype, int], List[List[np.ndarray]]] = {}
        self._bounds_cache: Dict[Tuple[int, int], List[int]] = {}
        self._meta_bytes, self._data_off, self._half_bytes, self._seg_total = segment_layout(node.segment_bytes,
                                                                                             self.size)
        self._sub_bytes = self._half_bytes // self.size // LINE_BYTES * LINE_BYTES
        self._chunk_bytes = min(node.chunk_bytes, self._half_bytes)
        self._small_bytes = node.small_bytes
        self._single_copy_bytes = node.single_copy_bytes
        # spinning pays only when no rank on this host (in any group) has to wait for a core
        self._spinner = Spinner(node.spin_us if node.spin_us is not None
                                else default_budget_us(node.size, DEFAULT_SPIN_US))
        # Readers copy a piece while the root writes the next (a wake-up per piece where ranks sleep); every member
        # must cut the same pieces, so this reads the host's CPU count, not this process's spin budget.
        crowded = node.size > (os.cpu_count() or 1)
        self._broadcast_piece = self._half_bytes if crowded else min(self._half_bytes, BROADCAST_PIECE_BYTES)
        self._peers = [q for q in range(self.size) if q != self.rank]
        self._wake_fds = [node.peers[members[q]].wake_fd for q in self._peers]
        self._poller = select.poll()
        self._poller.register(node.wake_r, select.POLLIN)
        self._fd_rank: Dict[int, int] = {}
        for q in self._peers:
            sock = node.peers[members[q]].sock
            self._poller.register(sock, getattr(select, "POLLRDHUP", 0))
            self._fd_rank[sock.fileno()] = q
        if seg_fds is not None:
            self._attach(seg_fds)

    # -- memory ------------------------------------------------------------------------------------------------

    def _attach(self, seg_fds: Dict[int, int]) -> None:
        """Map every member's segment (``seg_fds`` keyed by group rank, own included); closes the descriptors."""
        try:
            maps = [map_segment(seg_fds[q], self._seg_total, q == self.rank) for q in range(self.size)]
        finally:
            for fd in seg_fds.values():
                os.close(fd)
        self._maps = maps
        self._seqs = [memoryview(m)[:8].cast("q") for m in maps]
        self._my_seq = self._seqs[self.rank]
        raw = [np.frombuffer(m, dtype=np.uint8) for m in maps]
        self._meta = [[raw[q][128 + h * self._meta_bytes:128 + (h + 1) * self._meta_bytes].view(np.int64)
                       for h in (0, 1)] for q in range(self.size)]
        d, hb = self._data_off, self._half_bytes
        self._half = [[raw[q][d + h * hb:d + (h + 1) * hb] for h in (0, 1)] for q in range(self.size)]
        self._ready = True

    def _setup_subgroup(self) -> None:
        """First collective of a subgroup: members trade fresh segments over the pair sockets."""
        node = self._node
        deadline = time.monotonic() + node.timeout
        digest = node.group_digest(self._members)
        own = new_segment_fd(node.segment_name("g" + digest[:4].hex()), self._seg_total, node.backing)
        fds: Dict[int, int] = {self.rank: own}
        try:
            for q in self._peers:
                peer = node.peers[self._members[q]]
                send_msg(peer.sock, HELLO.pack(MAGIC, node.rank, self._seg_total, os.getpid(), digest), [own],
                          deadline, node.describe(peer.rank))
            for q in self._peers:
                peer = node.peers[self._members[q]]
                data, got = recv_msg(peer.sock, HELLO.size, 1, deadline, node.describe(peer.rank))
                magic, rank, nbytes, _pid, their_digest = HELLO.unpack(data)
                if magic != MAGIC or rank != peer.rank or their_digest != digest or len(got) != 1 \
                        or nbytes != self._seg_total:
                    for fd in got:
                        os.close(fd)
                    raise TransportError(
                        f"shm transport: {node.describe(peer.rank)} is not setting up subgroup {list(self._members)} "
                        f"now (it sent a message for another group or of another size): members must run their "
                        f"collectives in the same order", peer=q)
                fds[q] = got[0]
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        self._attach(fds)

    def probe_single_copy(self) -> bool:
        """World group, at setup: whether every rank can read every peer's memory (:mod:`horovod.transport.cma`);
        the answer (the same on every rank) is kept as the node's reader.  Two steps on every rank."""
        node = self._node
        try:
            reader: Optional[Reader] = Reader() if node.single_copy_bytes else None
        except CmaError:
            reader = None
        token = np.array([secrets.randbits(62) + 1], np.int64)
        mine = self._meta[self.rank]
        mine[0][0], mine[0][1] = int(token[0]), cma.address(token)
        self._wait(self._step())
        ok = all(cma.probe(reader, self._pid(q), int(self._meta[q][0][1]), int(self._meta[q][0][0]))
                 for q in self._peers)
        mine[1][0] = int(ok)
        s = self._step()
        self._wait(s)
        agreed = all(self._meta[q][1][0] == 1 for q in range(self.size))
        # Half 0's block was read before step s, half 1's before each peer's next step.
        self._free_at = [s, s + 1]
        del token   # (kept alive until every peer has read it: they all passed step s)
        node.cma = reader if agreed else None
        return agreed

    def _pid(self, q: int) -> int:
        """Group rank ``q``'s process id (as this process's namespace sees it: the probe checks it is that peer)."""
        return self._node.peers[self._members[q]].pid

    def segment_maps(self) -> List[mmap.mmap]:
        """Every member's segment, by group rank (own writable, the others read-only)."""
        return list(self._maps)

    # -- primitives for boards kept in the segments' spare space (the engine's fast lane and round board) ------

    @property
    def world_ready(self) -> bool:
        """Whether this is the world group of more than one rank, set up: the only group with board space."""
        return self is self._node.world and self.size > 1 and self._ready

    @property
    def wake_fd(self) -> int:
        """The descriptor that becomes readable when a peer wakes this rank (:meth:`wake`)."""
        return self._node.wake_r

    def attach(self, holder: Releasable) -> None:
        """Release ``holder``'s views before this group's segments are unmapped."""
        self._attached.append(holder)

    def _typed(self, dtype: np.dtype, h: int) -> List[np.ndarray]:
        views = self._typed_cache.get((dtype, h))
        if views is None:
            views = self._typed_cache[(dtype, h)] = [self._half[q][h].view(dtype) for q in range(self.size)]
        return views

    def _subslots(self, dtype: np.dtype, h: int) -> List[List[np.ndarray]]:
        """``[q][p]``: the part of rank q's half ``h`` that holds q's data for rank p."""
        key = (dtype, h)
        views = self._sub_cache.get(key)
        if views is None:
            b = self._sub_bytes
            views = self._sub_cache[key] = [[self._half[q][h][p * b:(p + 1) * b].view(dtype)
                                             for p in range(self.size)] for q in range(self.size)]
        return views

    # -- progress ----------------------------------------------------------------------------------------------

    def _enter(self, op: str) -> None:
        if self._closed or self._node.closed:
            raise TransportError(f"shm transport: {op} called after close()")
        self._op = op
        if not self._ready:
            self._setup_subgroup()

    def _step(self) -> int:
        """Publish that this rank passed the next protocol point, and wake the peers."""
        s = self._seq = self._seq + 1
        self._my_seq[0] = s
        _write_wakes(self._wake_fds)
        return s

    def _next_half(self, write: bool) -> int:
        """The half of the next round (the same on every rank); when writing, wait until its readers are done."""
        h = self._rounds & 1
        self._rounds += 1
        if write and self._free_at[h]:
            self._wait(self._free_at[h])
        return h

    def _wait(self, target: int, who: Optional[Sequence[int]] = None) -> None:
        """Block until every peer in ``who`` (default: all) has made step ``target``."""
        seqs = self._seqs
        pending = [q for q in (self._peers if who is None else who) if seqs[q][0] < target]
        if not pending:
            return

        def arrived() -> bool:
            nonlocal pending
            pending = [q for q in pending if seqs[q][0] < target]
            return not pending

        if self._spinner.spin(arrived):
            return
        self._block(target, pending)

    def _block(self, target: int, pending: List[int]) -> None:
        seqs = self._seqs
        pending = self.block_until(lambda: [q for q in pending if seqs[q][0] < target], self._node.timeout,
                                   f"step {target}")
        if pending:
            names = ", ".join(self._node.describe(self._members[q]) for q in pending)
            raise TransportError(
                f"shm transport: rank {self.rank} waited {self._node.timeout:.0f} s in {self._op} for {names} "
                f"(group rank(s) {pending}) to reach step {target}; the peer is stuck, or ranks called different "
                f"collectives (raise the timeout if it is merely slow)", peer=pending[0])

    def block_until(self, pending: Callable[[], List[int]], timeout: float, what: str,
                    recheck_s: Optional[float] = None) -> List[int]:
        """Sleep on this rank's wake-ups until ``pending()`` (the group ranks still awaited) is empty.

        Returns ``[]`` once nothing is pending, else what is still pending when ``timeout`` seconds passed.
        ``recheck_s`` bounds each sleep, for waits whose peers wake this rank only when they see it waiting.

        Raises:
            TransportError: an awaited peer exited (its socket hung up) while waiting for ``what``.
        """
        node = self._node
        deadline = time.monotonic() + timeout
        left = pending()
        waited = list(left)
        while left:
            dead = [q for q in left if self._members[q] in node.gone]
            if dead:
                self._raise_dead(dead, what)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return left
            if recheck_s is not None:
                remaining = min(remaining, recheck_s)
            for fd, ev in self._poller.poll(remaining * 1000 + 1):
                if fd == node.wake_r:
                    try:
                        while os.read(fd, 8) and fd != node.wake_w:  # a pipe may hold several wake-ups
                            pass
                    except BlockingIOError:
                        pass
                elif ev & POLL_DEAD:
                    q = self._fd_rank[fd]
                    node.gone.add(self._members[q])
                    self._poller.unregister(fd)  # a hung-up socket stays readable: never poll it again
            left = pending()
            if len(left) < len(waited):
                # A peer that arrived is alive (the engine's liveness counts it: only slow waits pay for the clock).
                now = time.monotonic()
                for q in waited:
                    if q not in left:
                        node.heard_at[self._members[q]] = now
                waited = list(left)
        return left

    def last_heard(self, rank: int) -> float:
        return self._node.heard_at.get(self._members[rank], 0.0) if 0 <= rank < self.size else 0.0

    def wake(self, peers: Sequence[int]) -> None:
        """Wake the group ranks ``peers`` (each sleeping in :meth:`block_until` or a collective re-checks)."""
        _write_wakes([self._wake_fds[q if q < self.rank else q - 1] for q in peers])

    def _raise_dead(self, dead: List[int], what: str) -> None:
        names = ", ".join(f"{self._node.describe(self._members[q])} (group rank {q})" for q in dead)
        raise TransportError(
            f"shm transport: {names} exited or was killed while rank {self.rank} waited for it in {self._op} "
            f"({what}); the group cannot continue", peer=dead[0])

    def subgroup(self, ranks: Sequence[int]) -> Transport:
        ranks = sorted(int(q) for q in ranks)
        if len(set(ranks)) != len(ranks) or not ranks or ranks[0] < 0 or ranks[-1] >= self.size:
            raise ValueError(f"subgroup: ranks {ranks} must be distinct ranks of this group of {self.size}")
        if self.rank not in ranks:
            raise ValueError(f"subgroup: rank {self.rank} is not in {ranks}; only members may create a subgroup")
        if self._closed or self._node.closed:
            raise TransportError("shm transport: subgroup() after close()")
        return self._node.subgroup(tuple(self._members[q] for q in ranks))

    def _check_counts(self, counts: Sequence[int], what: str) -> List[int]:
        counts = [int(c) for c in counts]
        if len(counts) != self.size or min(counts, default=0) < 0:
            raise ValueError(f"{what} must hold {self.size} non-negative counts, got {counts}")
        return counts

    # -- teardown ----------------------------------------------------------------------------------------------

    def _release(self) -> None:
        """Unmap this group's segments (the memory goes when every member has unmapped or exited)."""
        if self._closed:
            return
        self._closed = True
        for holder in self._attached:
            holder.release()
        self._attached = []
        self._typed_cache.clear()
        self._sub_cache.clear()
        self._half, self._meta = [], []   # drop the views so the mappings below can close
        for mv in getattr(self, "_seqs", ()):
            mv.release()
        self._seqs = []   # (_my_seq is one of them, released: any later use raises ValueError)
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still referenced somewhere; the GC unmaps it later
                logger.debug("shm transport: segment still referenced at close; left to the garbage collector")
        self._maps = []

    def close(self) -> None:
        """Release this group's memory; on the world group, also every subgroup, socket and descriptor."""
        if self is self._node.world:
            self._node.close()
        else:
            self._release()
            if self._node.groups.get(self._members) is self:
                del self._node.groups[self._members]
