"""The built-in data plane: collectives over a full mesh of authenticated TCP connections.

Three modules: :mod:`horovod.transport.tcp_connect` connects and authenticates the mesh (every rank listens,
publishes ``host:port`` in the rendezvous store, dials every lower rank and accepts every higher one);
:mod:`horovod.transport.tcp_mesh` runs *plans* (per peer, an ordered list of sends and receives over memoryviews,
a send optionally waiting for a receive, a receive optionally reducing in place) with one single-threaded ``poll``
loop over non-blocking sockets, so all peers progress together and neighbours sending large buffers at once never
deadlock; this module compiles each collective into such a plan. Pipelining falls out of the plan: a ring step's
segment ``j`` is forwarded as soon as segment ``j`` of the previous step has arrived and been reduced, while the
kernel keeps receiving the next one.

Algorithms (``small`` = below ``TransportOptions.small_message_bytes``, default 256 KiB):

==============  =====================================  ==============================================
collective      small                                  large
==============  =====================================  ==============================================
allreduce       recursive doubling (extra ranks        ring reduce-scatter + ring allgather, segmented
                folded into partners first)            and pipelined across steps
allgatherv      direct exchange with every peer        ring, segmented and pipelined
broadcast       binomial tree                          pipelined chain
alltoallv       direct exchange with every peer        pairwise exchange, one peer pair per step
reducescatter   ring                                   ring, segmented and pipelined
barrier         dissemination (1-byte tokens)
==============  =====================================  ==============================================

Failures: a peer that closes is reported at once (EOF, or ``POLLRDHUP`` on a peer we still owe data); a silent
one after ``timeout``.  The failing rank records its reason in the store (``abort.<rank>``) and closes every
connection, so the others fail quickly too and name the rank that really failed rather than the messenger.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from horovod.transport import algorithms as alg
from horovod.transport.base import (SUM, Bootstrap, Finish, Transport, TransportError, check_gather, check_op,
                                    reduce_into, register)
from horovod.transport.tcp_connect import connect_world
from horovod.transport.tcp_mesh import Mesh, Plan, as_bytes

class TcpTransport(Transport):
    """Collectives over TCP among a group of the world's ranks (the world itself, or a subgroup view).

    A subgroup shares its parent's connections, scratch buffers and failure state; only the transport returned by
    :func:`create_tcp` owns them, so closing a subgroup only detaches it.  Not thread-safe: one thread at a time
    may run collectives on the world transport and all its subgroups.

    Attributes:
        rank: this process's index in the group.
        size: the number of processes in the group.
        members: the world ranks of the group, indexed by group rank.
    """

    name = "tcp"

    def __init__(self, mesh: Mesh, members: Sequence[int], owner: bool = False):
        self._mesh = mesh
        self.members: List[int] = list(members)
        self._group = {w: g for g, w in enumerate(self.members)}
        self.rank = self._group[mesh.rank]
        self.size = len(self.members)
        self._owner = owner
        self._detached = False

    # -- naming

    def group_rank(self, world: int) -> object:
        """The group rank of world rank ``world`` (or a description when it is outside this group)."""
        g = self._group.get(world)
        return g if g is not None else f"world rank {world}"

    def describe(self, world: int) -> str:
        g = self._group.get(world)
        if g is None:
            return f"world rank {world}"
        return f"rank {g}" if g == world else f"rank {g} (world rank {world})"

    def _world(self, g: int) -> int:
        return self.members[g]

    def _start(self) -> Plan:
        if self._detached:
            raise TransportError("this TCP subgroup was closed")
        self._mesh.check_usable()
        return Plan(self._mesh)

    def _run(self, plan: Plan, what: str, op: str = SUM) -> None:
        self._mesh.run(plan, op, what, self)

    # -- allreduce

    def allreduce(self, buf: np.ndarray, op: str = SUM) -> None:
        """Reduce ``buf`` in place over the group; small buffers by recursive doubling, large by a ring."""
        self._allreduce(buf, op, None)

    def allreduce_into(self, src: np.ndarray, dst: np.ndarray, op: str = SUM,
                       finish: Optional[Finish] = None) -> None:
        if src is not dst:
            np.copyto(dst, src)
        self._allreduce(dst, op, finish)

    def _allreduce(self, buf: np.ndarray, op: str, finish: Optional[Finish]) -> None:
        check_op(op, "tcp transport")
        self._start()
        with np.errstate(all="ignore"):   # inf / nan / wrap-around are defined results (loss scaling), not errors
            if self.size == 1 or buf.size == 0 or buf.nbytes < self._mesh.small or buf.size < self.size:
                if self.size > 1 and buf.size:
                    self._allreduce_doubling(buf, op)
                if finish is not None:
                    finish(buf)   # small: still in cache
            else:
                self._allreduce_ring(buf, op, finish)

    def _allreduce_doubling(self, buf: np.ndarray, op: str) -> None:
        fold = alg.Fold(self.rank, self.size)
        mine = as_bytes(buf)
        tmp = self._mesh.scratch(buf.nbytes)[: buf.nbytes].view(buf.dtype)
        tmpb = as_bytes(tmp)
        what = f"allreduce of {buf.nbytes} bytes (recursive doubling)"
        if fold.role == "extra":
            self._exchange(fold.partner, mine, None, None, what)
            self._exchange(None, None, fold.partner, mine, what)
            return
        if fold.role == "proxy":
            self._exchange(None, None, fold.partner, tmpb, what)
            reduce_into(buf, tmp, op)
        for partner in fold.partners():
            # Both ranks compute a (op) b with the same operands: commutative ops give identical bits.
            self._exchange(partner, mine, partner, tmpb, what)
            reduce_into(buf, tmp, op)
        if fold.role == "proxy":
            self._exchange(fold.partner, mine, None, None, what)

    def _allreduce_ring(self, buf: np.ndarray, op: str, finish: Optional[Finish]) -> None:
        n, r, mesh = self.size, self.rank, self._mesh
        it = buf.itemsize
        counts = alg.partition(buf.size, n)
        offs = alg.offsets(counts)
        seg = alg.segment_elements(counts[0] * it, it, mesh.chunk)
        scratch = mesh.scratch(seg * it)[: seg * it].view(buf.dtype)
        sview = as_bytes(scratch)
        data = as_bytes(buf)
        left, right = alg.ring_neighbours(r, n)
        plan = self._start()
        lc, rc = plan.chan(self._world(left)), plan.chan(self._world(right))
        prev: Optional[list] = None
        # Reduce-scatter: in step s send block r-s (reduced so far), receive block r-s-1 and reduce it into buf.
        # The last step completes the block this rank owns: it is finished there, so the allgather passes on
        # finished values and nobody makes another pass over the whole result.
        for s in range(n - 1):
            sb, rb = (r - s) % n, (r - s - 1) % n
            for j, (o, ln) in enumerate(alg.segments(offs[sb], counts[sb], seg)):
                rc.send(data[o * it:(o + ln) * it], prev[j] if prev else None)
            last = finish if s == n - 2 else None
            prev = [lc.recv(sview[: ln * it], (buf[o:o + ln], scratch[:ln]), last)
                    for o, ln in alg.segments(offs[rb], counts[rb], seg)]
        # Allgather: rank r now owns block r+1 fully reduced; pass blocks on, receiving straight into buf.
        assert prev is not None   # n >= 2: the reduce-scatter ran at least one step
        for s in range(n - 1):
            sb, rb = (r + 1 - s) % n, (r - s) % n
            for j, (o, ln) in enumerate(alg.segments(offs[sb], counts[sb], seg)):
                rc.send(data[o * it:(o + ln) * it], prev[j])
            prev = [lc.recv(data[o * it:(o + ln) * it]) for o, ln in alg.segments(offs[rb], counts[rb], seg)]
        self._run(plan, f"allreduce of {buf.nbytes} bytes (ring)", op)

    # -- allgatherv

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        """Concatenate every rank's ``send`` into ``recv``: a direct exchange when small, a ring when large."""
        counts = [int(c) for c in counts]
        self._check_counts(counts, "counts")
        offs = alg.offsets(counts)
        total = offs[-1] + counts[-1]
        r = self.rank
        check_gather(send, recv, total, counts[r], r)
        plan = self._start()
        recv[offs[r]:offs[r] + counts[r]] = send[:counts[r]]
        if self.size == 1:
            return
        it = recv.itemsize
        data = as_bytes(recv)
        n = self.size
        if total * it < self._mesh.small:
            mine = data[offs[r] * it:(offs[r] + counts[r]) * it]
            for p in range(n):
                if p != r:
                    c = plan.chan(self._world(p))
                    c.send(mine)
                    c.recv(data[offs[p] * it:(offs[p] + counts[p]) * it])
            self._run(plan, f"allgatherv of {total * it} bytes (direct)")
            return
        seg = alg.segment_elements(max(counts) * it, it, self._mesh.chunk)
        left, right = alg.ring_neighbours(r, n)
        lc, rc = plan.chan(self._world(left)), plan.chan(self._world(right))
        prev = None
        for s in range(n - 1):
            sb, rb = (r - s) % n, (r - s - 1) % n
            for j, (o, ln) in enumerate(alg.segments(offs[sb], counts[sb], seg)):
                rc.send(data[o * it:(o + ln) * it], prev[j] if prev else None)
            prev = [lc.recv(data[o * it:(o + ln) * it]) for o, ln in alg.segments(offs[rb], counts[rb], seg)]
        self._run(plan, f"allgatherv of {total * it} bytes (ring)")

    # -- broadcast

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy ``buf`` of ``root`` everywhere: binomial tree when small, pipelined chain when large."""
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root {root} is not a rank of this group of size {self.size}")
        plan = self._start()
        if self.size == 1 or buf.size == 0:
            return
        data = as_bytes(buf)
        if buf.nbytes < self._mesh.small:
            parent, children = alg.binomial_tree(self.rank, self.size, root)
            got = plan.chan(self._world(parent)).recv(data) if parent is not None else None
            for child in children:
                plan.chan(self._world(child)).send(data, got)
            self._run(plan, f"broadcast of {buf.nbytes} bytes from rank {root} (tree)")
            return
        it = buf.itemsize
        prev, nxt = alg.chain(self.rank, self.size, root)
        seg = alg.segment_elements(buf.nbytes, it, self._mesh.chunk, depth=8)
        pieces = alg.segments(0, buf.size, seg)
        handles: List[Optional[tuple]] = [None] * len(pieces)
        if prev is not None:
            pc = plan.chan(self._world(prev))
            handles = [pc.recv(data[o * it:(o + ln) * it]) for o, ln in pieces]
        if nxt is not None:
            nc = plan.chan(self._world(nxt))
            for (o, ln), h in zip(pieces, handles):
                nc.send(data[o * it:(o + ln) * it], h)
        self._run(plan, f"broadcast of {buf.nbytes} bytes from rank {root} (chain)")

    # -- alltoallv

    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                  recv_counts: Sequence[int]) -> None:
        """Personalised exchange: every peer at once when small, one pair of peers per step when large."""
        sc, rcn = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        self._check_counts(sc, "send_counts")
        self._check_counts(rcn, "recv_counts")
        so, ro = alg.offsets(sc), alg.offsets(rcn)
        if send.size < so[-1] + sc[-1] or recv.size < ro[-1] + rcn[-1] or send.dtype != recv.dtype:
            raise ValueError(f"alltoallv: send needs sum(send_counts) = {so[-1] + sc[-1]} and recv "
                             f"sum(recv_counts) = {ro[-1] + rcn[-1]} elements of one dtype; got send "
                             f"{send.size} x {send.dtype}, recv {recv.size} x {recv.dtype}")
        r = self.rank
        if sc[r] != rcn[r]:
            raise ValueError(f"alltoallv: rank {r} sends itself {sc[r]} elements but expects {rcn[r]}")
        plan = self._start()
        recv[ro[r]:ro[r] + rcn[r]] = send[so[r]:so[r] + sc[r]]
        if self.size == 1:
            return
        it = send.itemsize
        sdata, rdata = as_bytes(send), as_bytes(recv)
        total = (sum(sc) + sum(rcn)) * it
        what = f"alltoallv of {total} bytes"
        if total < self._mesh.small:
            for p in range(self.size):
                if p != r:
                    c = plan.chan(self._world(p))
                    c.send(sdata[so[p] * it:(so[p] + sc[p]) * it])
                    c.recv(rdata[ro[p] * it:(ro[p] + rcn[p]) * it])
            self._run(plan, what + " (direct)")
            return
        for step, (dst, src) in enumerate(alg.pairwise(r, self.size)):
            if step:
                plan = self._start()
            plan.chan(self._world(dst)).send(sdata[so[dst] * it:(so[dst] + sc[dst]) * it])
            plan.chan(self._world(src)).recv(rdata[ro[src] * it:(ro[src] + rcn[src]) * it])
            self._run(plan, f"{what} (pairwise step {step + 1} of {self.size - 1})")

    # -- reducescatter

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: str = SUM) -> None:
        """Ring reduce-scatter: rank r ends with block r of the reduction in ``recv[:counts[r]]``."""
        check_op(op, "tcp transport")
        counts = [int(c) for c in counts]
        self._check_counts(counts, "counts")
        offs = alg.offsets(counts)
        total = offs[-1] + counts[-1]
        n, r = self.size, self.rank
        if send.size < total or recv.size < counts[r] or recv.dtype != send.dtype:
            raise ValueError(f"reducescatter: send must hold sum(counts) = {total} and recv counts[{r}] = "
                             f"{counts[r]} elements of one dtype; got send {send.size} x {send.dtype}, "
                             f"recv {recv.size} x {recv.dtype}")
        plan = self._start()
        if n == 1:
            recv[:counts[0]] = send[:counts[0]]
            return
        if total == 0:
            return
        it = send.itemsize
        # Partial sums of the blocks passing through this rank live in a reusable work buffer; each incoming
        # segment is received in place there (or into recv for the last step) and this rank's contribution
        # is reduced into it, so no separate scratch copy is needed.
        work = self._mesh.scratch(total * it, slot=1)[: total * it].view(send.dtype)
        sdata, wdata, rdata = as_bytes(send), as_bytes(work), as_bytes(recv)
        seg = alg.segment_elements(max(counts) * it, it, self._mesh.chunk)
        left, right = alg.ring_neighbours(r, n)
        lc, rc = plan.chan(self._world(left)), plan.chan(self._world(right))
        prev = None
        for s in range(n - 1):
            sb, rb = (r - s - 1) % n, (r - s - 2) % n
            src = sdata if s == 0 else wdata
            for j, (o, ln) in enumerate(alg.segments(offs[sb], counts[sb], seg)):
                rc.send(src[o * it:(o + ln) * it], prev[j] if prev else None)
            last = s == n - 2
            cur = []
            for o, ln in alg.segments(offs[rb], counts[rb], seg):
                if last:
                    lo = o - offs[rb]
                    dst, dview = recv[lo:lo + ln], rdata[lo * it:(lo + ln) * it]
                else:
                    dst, dview = work[o:o + ln], wdata[o * it:(o + ln) * it]
                cur.append(lc.recv(dview, (dst, send[o:o + ln])))
            prev = cur
        with np.errstate(all="ignore"):   # as allreduce: inf and wrap-around are defined results
            self._run(plan, f"reducescatter of {total * it} bytes (ring)", op)

    # -- point to point and barrier

    def sendrecv(self, send: Optional[np.ndarray], dest: Optional[int], recv: Optional[np.ndarray],
                 source: Optional[int]) -> None:
        """Send ``send`` to ``dest`` while receiving ``recv`` from ``source``; either side may be ``None``."""
        # A side takes part only with both its buffer and its peer.
        if send is None or dest is None:
            send, dest = None, None
        if recv is None or source is None:
            recv, source = None, None
        for what, peer in (("dest", dest), ("source", source)):
            if peer is not None and not 0 <= peer < self.size:
                raise ValueError(f"sendrecv: {what} {peer} is not a rank of this group of size {self.size}")
        if dest == self.rank or source == self.rank:
            if not dest == source == self.rank:
                raise ValueError("sendrecv: a rank can only send to itself while also receiving from itself")
            assert send is not None and recv is not None   # (dest and source are set, so are their buffers)
            self._start()
            as_bytes(recv)[: send.nbytes] = as_bytes(send)
            return
        self._exchange(dest, None if send is None else as_bytes(send), source,
                       None if recv is None else as_bytes(recv), "sendrecv")

    def barrier(self) -> None:
        """Dissemination barrier: ``ceil(log2 size)`` rounds of 1-byte tokens, as one plan."""
        plan = self._start()
        if self.size == 1:
            return
        token = memoryview(bytearray(1))
        sink = memoryview(bytearray(1))
        prev = None
        for to, frm in alg.dissemination(self.rank, self.size):
            plan.chan(self._world(to)).send(token, prev)
            prev = plan.chan(self._world(frm)).recv(sink)
        self._run(plan, "barrier")

    def _exchange(self, dest: Optional[int], sview: Optional[memoryview], source: Optional[int],
                  rview: Optional[memoryview], what: str) -> None:
        """One send and/or one receive (group ranks), overlapped."""
        if self._detached:
            raise TransportError("this TCP subgroup was closed")
        mesh = self._mesh
        if mesh.failed is not None or mesh.closed:
            mesh.check_usable()
        mesh.exchange(None if dest is None else self.members[dest], sview,
                      None if source is None else self.members[source], rview, what, self)

    def last_heard(self, rank: int) -> float:
        return self._mesh.heard_at[self.members[rank]] if 0 <= rank < self.size else 0.0

    # -- groups and lifetime

    def subgroup(self, ranks: Sequence[int]) -> "TcpTransport":
        """A view over ``ranks`` (group ranks of this group) sharing these connections."""
        ranks = sorted(int(g) for g in ranks)
        if len(set(ranks)) != len(ranks) or not ranks or ranks[0] < 0 or ranks[-1] >= self.size:
            raise ValueError(f"subgroup: ranks must be distinct ranks of this group of size {self.size}, "
                             f"got {list(ranks)}")
        if self.rank not in ranks:
            raise ValueError(f"subgroup: this process (rank {self.rank}) must be a member of {ranks}")
        return TcpTransport(self._mesh, [self.members[g] for g in ranks])

    def close(self) -> None:
        """Close the connections (world transport) or detach this view (subgroup).  Idempotent."""
        self._detached = True
        if self._owner:
            self._mesh.close()

    def _check_counts(self, counts: List[int], what: str) -> None:
        if len(counts) != self.size or min(counts, default=0) < 0:
            raise ValueError(f"{what} must have one non-negative count per rank ({self.size}), got {counts}")


@register("tcp")
def create_tcp(boot: Bootstrap) -> TcpTransport:
    """Connect the world group over TCP and return its transport.

    Args:
        boot: rank, size, rendezvous store, job secret, bind address, timeout, scope and options
            (:class:`TransportOptions`: ``small_message_bytes`` switches algorithms, ``tcp_chunk_bytes`` is the
            largest pipeline segment).

    Raises:
        TransportError: a rank did not publish its address, could not be reached, failed the handshake, or did
            not connect within ``boot.timeout``; the message names it.
    """
    if not 0 <= boot.rank < boot.size:
        raise ValueError(f"tcp bootstrap: rank {boot.rank} is outside a world of size {boot.size}")
    socks = connect_world(boot)
    mesh = Mesh(boot, socks)
    return TcpTransport(mesh, range(boot.size), owner=True)
