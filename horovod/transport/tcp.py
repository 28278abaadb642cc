"""The built-in data plane: collectives over a full mesh of authenticated TCP connections.

Bootstrap: every rank listens on ``boot.bind_addr``, publishes ``host:port`` in the rendezvous store, connects to
every lower rank and accepts every higher one.  Each connection starts with the mutual HMAC handshake of
:mod:`horovod.transport.sockets`; the hello names the scope and the rank, so the acceptor knows who called, and a
connection that fails the handshake is logged and dropped while the real peer is still awaited.

Data movement: a collective is compiled into a *plan* (per peer, an ordered list of sends and of receives, each a
memoryview, a send optionally waiting until some receive has completed, a receive optionally followed by an
in-place reduction) and executed by one single-threaded loop over non-blocking sockets.  Sends and receives of all
peers progress together, so two neighbours sending large buffers at once never deadlock; the loop blocks in
``poll`` (never spins) and gives up after ``timeout`` seconds without progress.  Pipelining falls out of the plan:
a ring step's segment ``j`` is forwarded as soon as segment ``j`` of the previous step has arrived and been
reduced, while the kernel keeps receiving the next one.

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

import logging
import select
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from horovod.transport import algorithms as alg
from horovod.transport import sockets
from horovod.transport.base import SUM, Bootstrap, Transport, TransportError, reduce_into, register

logger = logging.getLogger(__name__)

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
# POLLRDHUP (Linux) reports a peer that closed even while we only have data to *send* to it.
_POLLCLOSED = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)

_HELLO = "hvd-tcp"
# How long a failing rank may spend recording its reason, and a peer looking it up (failure path only).
_ABORT_RECORD_S = 0.5
_ABORT_LOOKUP_S = 0.5


def _bytes(arr: np.ndarray) -> memoryview:
    """A flat byte view of a 1-D contiguous array (no copy)."""
    return memoryview(arr.view(np.uint8))


# --------------------------------------------------------------------------------------------------- plans


class _Chan:
    """The traffic with one peer inside one collective: ordered sends and ordered receives."""

    __slots__ = ("world", "sock", "sends", "si", "soff", "recvs", "ri", "roff")

    def __init__(self, world: int, sock: socket.socket):
        self.world, self.sock = world, sock
        self.sends: List[tuple] = []  # (view, dep_chan or None, dep_count)
        self.si = self.soff = 0
        self.recvs: List[tuple] = []  # (view, (reduce_dst, reduce_src) or None)
        self.ri = self.roff = 0

    def send(self, view: memoryview, after: Optional[Tuple["_Chan", int]] = None) -> None:
        """Queue ``view``; with ``after=(chan, n)`` it waits until ``chan`` has completed ``n`` receives."""
        if len(view):
            if after is None:
                self.sends.append((view, None, 0))
            else:
                self.sends.append((view, after[0], after[1]))

    def recv(self, view: memoryview, reduce: Optional[Tuple[np.ndarray, np.ndarray]] = None
             ) -> Tuple["_Chan", int]:
        """Queue a receive into ``view`` (then ``reduce_into(*reduce)``); returns a handle for :meth:`send`."""
        if len(view):
            self.recvs.append((view, reduce))
        return self, len(self.recvs)

    def pending_recv_bytes(self) -> int:
        if self.ri >= len(self.recvs):
            return 0
        return sum(len(v) for v, _ in self.recvs[self.ri:]) - self.roff

    def pending_send_bytes(self) -> int:
        if self.si >= len(self.sends):
            return 0
        return sum(len(s[0]) for s in self.sends[self.si:]) - self.soff


class _Plan:
    """The channels of one collective, one per peer (a peer may be both left and right neighbour)."""

    __slots__ = ("mesh", "chans")

    def __init__(self, mesh: "_Mesh"):
        self.mesh = mesh
        self.chans: Dict[int, _Chan] = {}

    def chan(self, world: int) -> _Chan:
        c = self.chans.get(world)
        if c is None:
            c = self.chans[world] = _Chan(world, self.mesh.sock(world))
        return c


# ---------------------------------------------------------------------------------------------------- mesh


class _Mesh:
    """The world's connections and what every group view over them shares (scratch, failure state)."""

    def __init__(self, boot: Bootstrap, socks: List[Optional[socket.socket]]):
        self.rank, self.size = boot.rank, boot.size
        self.timeout = float(boot.timeout)
        self.store, self.scope = boot.store, boot.scope
        self.small = int(boot.options.small_message_bytes)
        self.chunk = max(4096, int(boot.options.tcp_chunk_bytes))
        self.socks = socks
        self.failed: Optional[TransportError] = None
        self.closed = False
        self._scratch: Dict[int, np.ndarray] = {}
        for s in socks:
            if s is not None:
                s.setblocking(False)

    # -- resources

    def sock(self, world: int) -> socket.socket:
        s = self.socks[world]
        if s is None:
            raise TransportError(f"no connection to world rank {world} (the transport is closed)", peer=world)
        return s

    def scratch(self, nbytes: int, slot: int = 0) -> np.ndarray:
        """A reusable byte buffer of at least ``nbytes`` (grown geometrically, kept between calls)."""
        buf = self._scratch.get(slot)
        if buf is None or buf.size < nbytes:
            buf = np.empty(max(nbytes, 2 * (0 if buf is None else buf.size), 4096), dtype=np.uint8)
            self._scratch[slot] = buf
        return buf

    def check_usable(self) -> None:
        if self.failed is not None:
            raise TransportError(f"the TCP transport is unusable after an earlier failure: {self.failed}",
                                 peer=self.failed.peer)
        if self.closed:
            raise TransportError("the TCP transport is closed; create a new one (hvd.init) to communicate again")

    def close(self) -> None:
        self.closed = True
        for i, s in enumerate(self.socks):
            if s is not None:
                sockets.maybe_close(s)
                self.socks[i] = None
        self._scratch.clear()

    # -- failures

    def abort(self, err: TransportError, culprit_world: Optional[int]) -> None:
        """Remember ``err``, tell the store why (bounded), and close every connection so peers fail fast."""
        if self.failed is None:
            self.failed = err
        logger.error("tcp transport (world rank %d) aborting: %s", self.rank, err)
        if self.store is not None:
            record = f"{-1 if culprit_world is None else culprit_world}\n{err}".encode()
            _bounded(lambda: self.store.put(self.scope, f"abort.{self.rank}", record), _ABORT_RECORD_S)
        for i, s in enumerate(self.socks):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sockets.maybe_close(s)
                self.socks[i] = None

    def abort_reason(self, world: int) -> Optional[Tuple[int, str]]:
        """What world rank ``world`` recorded when it aborted: ``(culprit world rank or -1, message)``."""
        if self.store is None:
            return None
        raw = _bounded(lambda: self.store.get(self.scope, f"abort.{world}", timeout=_ABORT_LOOKUP_S),
                       _ABORT_LOOKUP_S + 0.5)
        if not raw:
            return None
        culprit, _, text = raw.decode(errors="replace").partition("\n")
        try:
            return int(culprit), text
        except ValueError:
            return None

    # -- the progress loop

    def run(self, plan: _Plan, op: str, what: str, view: "TcpTransport") -> None:
        """Drive every send and receive of ``plan`` to completion (see the module docstring)."""
        try:
            self._drive(plan, op, what, view)
        finally:
            # Channels point at each other (send-after-receive dependencies, a neighbour on both sides), a cycle
            # that would keep the caller's buffers alive until the cyclic GC runs: break it now.
            for c in plan.chans.values():
                c.sends.clear()
                c.recvs.clear()
            plan.chans.clear()

    def _drive(self, plan: _Plan, op: str, what: str, view: "TcpTransport") -> None:
        active = [c for c in plan.chans.values() if c.sends or c.recvs]
        if not active:
            return
        deadline = None
        while True:
            progressed = False
            unfinished = False
            for c in active:
                recvs = c.recvs
                nr = len(recvs)
                while c.ri < nr:
                    buf, red = recvs[c.ri]
                    off = c.roff
                    try:
                        k = c.sock.recv_into(buf[off:] if off else buf)
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        raise self._lost(view, c.world, what, f"receiving failed: {exc}") from None
                    if k == 0:
                        raise self._lost(view, c.world, what, f"it closed the connection with "
                                         f"{c.pending_recv_bytes()} bytes still expected from it")
                    progressed = True
                    off += k
                    if off < len(buf):
                        c.roff = off
                        break
                    c.roff = 0
                    c.ri += 1
                    if red is not None:
                        reduce_into(red[0], red[1], op)
                sends = c.sends
                ns = len(sends)
                while c.si < ns:
                    buf, dep, need = sends[c.si]
                    if dep is not None and dep.ri < need:
                        break
                    off = c.soff
                    try:
                        k = c.sock.send(buf[off:] if off else buf)
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        raise self._lost(view, c.world, what, f"sending failed: {exc}") from None
                    progressed = True
                    off += k
                    if off < len(buf):
                        c.soff = off
                        break
                    c.soff = 0
                    c.si += 1
                if c.ri < nr or c.si < ns:
                    unfinished = True
            if not unfinished:
                return
            if progressed:
                deadline = None
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout
            elif now >= deadline:
                raise self._timed_out(view, active, what)
            self._wait(active, deadline - now, view, what)

    def exchange(self, dst: Optional[int], sview: Optional[memoryview], src: Optional[int],
                 rview: Optional[memoryview], what: str, view: "TcpTransport") -> None:
        """One send and/or one receive (world ranks): the latency-critical path of small collectives.

        Small messages almost always fit the socket buffer, so this tries the send outright and then waits on
        the one socket it reads from; anything unusual (a partial send) falls back to :meth:`run`.
        """
        if sview is not None and len(sview):
            sock = self.sock(dst)
            try:
                k = sock.send(sview)
            except BlockingIOError:
                k = 0
            except OSError as exc:
                raise self._lost(view, dst, what, f"sending failed: {exc}") from None
            if k < len(sview):
                plan = _Plan(self)
                plan.chan(dst).send(sview[k:])
                if rview is not None:
                    plan.chan(src).recv(rview)
                self.run(plan, SUM, what, view)
                return
        if rview is None or not len(rview):
            return
        sock = self.sock(src)
        n = len(rview)
        off = 0
        poller = None
        deadline = None
        while True:
            try:
                k = sock.recv_into(rview[off:] if off else rview)
            except BlockingIOError:
                k = -1
            except OSError as exc:
                raise self._lost(view, src, what, f"receiving failed: {exc}") from None
            if k == 0:
                raise self._lost(view, src, what, f"it closed the connection with {n - off} bytes still expected "
                                 f"from it")
            if k > 0:
                off += k
                if off == n:
                    return
                deadline = None
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout
                if poller is None:
                    poller = select.poll()
                    poller.register(sock.fileno(), _POLLIN | _POLLCLOSED)
            elif now >= deadline:
                chan = _Chan(src, sock)
                chan.recvs.append((rview, None))
                chan.roff = off
                raise self._timed_out(view, [chan], what)
            poller.poll(max(1, int((deadline - now) * 1000) + 1))

    def _wait(self, active: List[_Chan], seconds: float, view: "TcpTransport", what: str) -> None:
        poller = select.poll()
        by_fd = {}
        for c in active:
            mask = 0
            if c.ri < len(c.recvs):
                mask |= _POLLIN
            if c.si < len(c.sends):
                mask |= _POLLCLOSED
                _, dep, need = c.sends[c.si]
                if dep is None or dep.ri >= need:
                    mask |= _POLLOUT
            if mask:
                fd = c.sock.fileno()
                poller.register(fd, mask | _POLLCLOSED)
                by_fd[fd] = c
        for fd, ev in poller.poll(max(1, int(seconds * 1000) + 1)):
            c = by_fd[fd]
            # A peer we still owe data to has gone: it can never read it.  (With receives pending, the next
            # recv_into drains what it sent before closing and reports EOF only if more was due.)
            if ev & _POLLCLOSED and c.si < len(c.sends) and c.ri >= len(c.recvs):
                raise self._lost(view, c.world, what, f"it closed the connection with "
                                 f"{c.pending_send_bytes()} bytes still to be sent to it")

    def _lost(self, view: "TcpTransport", world: int, what: str, detail: str) -> TransportError:
        if self.failed is not None:  # already aborted (e.g. a nested failure): keep the first reason
            return TransportError(str(self.failed), peer=self.failed.peer)
        culprit = world
        reason = self.abort_reason(world)
        if reason is not None and reason[0] not in (-1, world):
            culprit = reason[0]
            msg = (f"{view.describe(world)} closed the connection during {what} after detecting a failure: "
                   f"{reason[1]}")
        elif reason is not None:
            msg = f"{view.describe(world)} aborted during {what}: {reason[1]}"
        else:
            msg = (f"{view.describe(world)} was lost during {what}: {detail}; the process probably exited or "
                   f"crashed (check its log)")
        err = TransportError(msg, peer=view.group_rank(culprit))
        self.abort(err, culprit)
        return err

    def _timed_out(self, view: "TcpTransport", active: List[_Chan], what: str) -> TransportError:
        waiting = [c for c in active if c.ri < len(c.recvs)]
        blocked = [c for c in active if c.si < len(c.sends)]
        if waiting:
            c = waiting[0]
            msg = (f"timed out after {self.timeout:.1f} s waiting for {view.describe(c.world)} during {what}: "
                   f"{c.pending_recv_bytes()} bytes still expected from it and nothing arrived")
        else:
            c = blocked[0]
            msg = (f"timed out after {self.timeout:.1f} s during {what}: {view.describe(c.world)} did not accept "
                   f"{c.pending_send_bytes()} more bytes (it is not reading)")
        msg += ("; the peer may be stuck, much slower, or not calling the same collectives in the same order "
                "(raise the transport timeout if it is just slow)")
        err = TransportError(msg, peer=view.group_rank(c.world))
        self.abort(err, c.world)
        return err


def _bounded(fn, seconds: float):
    """Run ``fn`` in a daemon thread for at most ``seconds``; its result, or ``None`` on error or timeout."""
    out: list = []

    def work():
        try:
            out.append(fn())
        except Exception:  # the store is best effort on the failure path
            pass

    t = threading.Thread(target=work, name="hvd-tcp-abort", daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else None


# ----------------------------------------------------------------------------------------------- transport


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

    def __init__(self, mesh: _Mesh, members: Sequence[int], owner: bool = False):
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

    def _start(self) -> _Plan:
        if self._detached:
            raise TransportError("this TCP subgroup was closed")
        self._mesh.check_usable()
        return _Plan(self._mesh)

    def _run(self, plan: _Plan, what: str, op: str = SUM) -> None:
        self._mesh.run(plan, op, what, self)

    # -- allreduce

    def allreduce(self, buf: np.ndarray, op: str = SUM) -> None:
        """Reduce ``buf`` in place over the group; small buffers by recursive doubling, large by a ring."""
        self._start()
        if self.size == 1 or buf.size == 0:
            return
        if buf.nbytes < self._mesh.small or buf.size < self.size:
            self._allreduce_doubling(buf, op)
        else:
            self._allreduce_ring(buf, op)

    def _allreduce_doubling(self, buf: np.ndarray, op: str) -> None:
        fold = alg.Fold(self.rank, self.size)
        mine = _bytes(buf)
        tmp = self._mesh.scratch(buf.nbytes)[: buf.nbytes].view(buf.dtype)
        tmpb = _bytes(tmp)
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

    def _allreduce_ring(self, buf: np.ndarray, op: str) -> None:
        n, r, mesh = self.size, self.rank, self._mesh
        it = buf.itemsize
        counts = alg.partition(buf.size, n)
        offs = alg.offsets(counts)
        seg = alg.segment_elements(counts[0] * it, it, mesh.chunk)
        scratch = mesh.scratch(seg * it)[: seg * it].view(buf.dtype)
        sview = _bytes(scratch)
        data = _bytes(buf)
        left, right = alg.ring_neighbours(r, n)
        plan = self._start()
        lc, rc = plan.chan(self._world(left)), plan.chan(self._world(right))
        prev: Optional[list] = None
        # Reduce-scatter: in step s send block r-s (reduced so far), receive block r-s-1 and reduce it into buf.
        for s in range(n - 1):
            sb, rb = (r - s) % n, (r - s - 1) % n
            for j, (o, ln) in enumerate(alg.segments(offs[sb], counts[sb], seg)):
                rc.send(data[o * it:(o + ln) * it], prev[j] if prev else None)
            prev = [lc.recv(sview[: ln * it], (buf[o:o + ln], scratch[:ln]))
                    for o, ln in alg.segments(offs[rb], counts[rb], seg)]
        # Allgather: rank r now owns block r+1 fully reduced; pass blocks on, receiving straight into buf.
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
        if recv.size < total or send.size < counts[r] or recv.dtype != send.dtype:
            raise ValueError(f"allgatherv: recv must hold sum(counts) = {total} elements of {send.dtype} and send "
                             f"at least counts[{r}] = {counts[r]}; got recv {recv.size} x {recv.dtype}, "
                             f"send {send.size} x {send.dtype}")
        plan = self._start()
        recv[offs[r]:offs[r] + counts[r]] = send[:counts[r]]
        if self.size == 1:
            return
        it = recv.itemsize
        data = _bytes(recv)
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
        data = _bytes(buf)
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
        sdata, rdata = _bytes(send), _bytes(recv)
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
        sdata, wdata, rdata = _bytes(send), _bytes(work), _bytes(recv)
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
        self._run(plan, f"reducescatter of {total * it} bytes (ring)", op)

    # -- point to point and barrier

    def sendrecv(self, send: Optional[np.ndarray], dest: Optional[int], recv: Optional[np.ndarray],
                 source: Optional[int]) -> None:
        """Send ``send`` to ``dest`` while receiving ``recv`` from ``source``; either side may be ``None``."""
        has_send = send is not None and dest is not None
        has_recv = recv is not None and source is not None
        for what, peer in (("dest", dest if has_send else None), ("source", source if has_recv else None)):
            if peer is not None and not 0 <= peer < self.size:
                raise ValueError(f"sendrecv: {what} {peer} is not a rank of this group of size {self.size}")
        if (has_send and dest == self.rank) or (has_recv and source == self.rank):
            if not (has_send and has_recv and dest == source == self.rank):
                raise ValueError("sendrecv: a rank can only send to itself while also receiving from itself")
            self._start()
            _bytes(recv)[: send.nbytes] = _bytes(send)
            return
        self._exchange(dest if has_send else None, _bytes(send) if has_send else None,
                       source if has_recv else None, _bytes(recv) if has_recv else None,
                       "sendrecv")

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


# ----------------------------------------------------------------------------------------------- bootstrap


def _hello(scope: str, rank: int) -> bytes:
    return f"{_HELLO}|{scope}|{rank}".encode()


def _advertised_host(boot: Bootstrap) -> str:
    if boot.bind_addr in ("", "0.0.0.0", "::"):
        return boot.hostname
    return boot.bind_addr


class _Acceptor:
    """Accepts and authenticates the connections of the higher ranks in a background thread.

    Each connection is authenticated in its own short-lived thread, so a stranger that connects and stays silent
    cannot hold up the real peers; a connection that fails the handshake, names another job's scope, a rank that
    should not call us, or a rank that already connected is logged and dropped.
    """

    def __init__(self, srv: socket.socket, boot: Bootstrap, deadline: float):
        self._srv, self._boot, self._deadline = srv, boot, deadline
        self._expected = set(range(boot.rank + 1, boot.size))
        self.socks: Dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._stop = False
        if not self._expected:
            self._done.set()
        self._thread = threading.Thread(target=self._loop, name="hvd-tcp-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        self._srv.settimeout(0.2)  # wake up now and then to notice the end of the bootstrap
        while not self._stop and not self._done.is_set() and time.monotonic() < self._deadline:
            try:
                conn, addr = self._srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._admit, args=(conn, addr), name="hvd-tcp-auth", daemon=True).start()

    def _admit(self, conn: socket.socket, addr) -> None:
        boot = self._boot
        who = f"connection from {addr[0]}:{addr[1]}"
        try:
            sockets.configure(conn)
            hello = sockets.authenticate(conn, boot.secret, initiator=False, hello=_hello(boot.scope, boot.rank),
                                         timeout=max(0.1, self._deadline - time.monotonic()), peer=who)
            tag, scope, rank_s = hello.decode(errors="replace").split("|", 2)
            peer = int(rank_s)
            if tag != _HELLO or scope != boot.scope:
                raise sockets.PeerError(f"{who} belongs to another job or initialisation ({hello!r})")
        except (sockets.PeerError, OSError, ValueError) as exc:
            logger.warning("tcp bootstrap (rank %d): dropped %s: %s", boot.rank, who, exc)
            sockets.maybe_close(conn)
            return
        with self._lock:
            if peer not in self._expected or peer in self.socks or self._stop:
                logger.warning("tcp bootstrap (rank %d): dropped %s claiming rank %d (expected one of %s, "
                               "not yet connected)", boot.rank, who, peer, sorted(self._expected - set(self.socks)))
                sockets.maybe_close(conn)
                return
            self.socks[peer] = conn
            if len(self.socks) == len(self._expected):
                self._done.set()

    def wait(self) -> Dict[int, socket.socket]:
        self._done.wait(max(0.0, self._deadline - time.monotonic()))
        with self._lock:
            self._stop = True
            missing = sorted(self._expected - set(self.socks))
        if missing:
            raise TransportError(
                f"tcp bootstrap (rank {self._boot.rank}): rank(s) {missing} did not connect within "
                f"{self._boot.timeout:g} s; they may have failed to start, be unable to reach "
                f"{self._srv.getsockname()}, or hold a different job secret",
                peer=missing[0] if len(missing) == 1 else missing)
        return dict(self.socks)

    def discard(self) -> None:
        with self._lock:
            self._stop = True
            for s in self.socks.values():
                sockets.maybe_close(s)


def _connect_to(boot: Bootstrap, peer: int, deadline: float) -> socket.socket:
    remaining = max(0.1, deadline - time.monotonic())
    try:
        raw = boot.store.get(boot.scope, str(peer), timeout=remaining)
    except TimeoutError as exc:
        raise TransportError(f"tcp bootstrap (rank {boot.rank}): rank {peer} did not publish its address within "
                             f"{boot.timeout:g} s ({exc})", peer=peer) from None
    except (ConnectionError, PermissionError) as exc:
        raise TransportError(f"tcp bootstrap (rank {boot.rank}): cannot read rank {peer}'s address from the "
                             f"rendezvous store: {exc}", peer=peer) from None
    host, port = sockets.parse_hostport(raw.decode())
    try:
        sock = sockets.connect(host, port, max(0.1, deadline - time.monotonic()), what=f"rank {peer}")
    except sockets.PeerError as exc:
        raise TransportError(f"tcp bootstrap (rank {boot.rank}): {exc}", peer=peer) from None
    try:
        hello = sockets.authenticate(sock, boot.secret, initiator=True, hello=_hello(boot.scope, boot.rank),
                                     timeout=max(0.1, deadline - time.monotonic()), peer=f"rank {peer}")
        if hello != _hello(boot.scope, peer):
            raise sockets.AuthenticationError(f"the process at {host}:{port} introduced itself as {hello!r}, "
                                              f"not as rank {peer} of this job", peer=peer)
    except (sockets.PeerError, OSError) as exc:
        sockets.maybe_close(sock)
        raise TransportError(f"tcp bootstrap (rank {boot.rank}): handshake with rank {peer} at {host}:{port} "
                             f"failed: {exc}", peer=peer) from None
    return sock


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
    socks: List[Optional[socket.socket]] = [None] * boot.size
    if boot.size > 1:
        if boot.store is None:
            raise TransportError("tcp bootstrap needs a rendezvous store to exchange addresses (none was given)")
        deadline = time.monotonic() + boot.timeout
        srv = sockets.listen(boot.bind_addr)
        acceptor = _Acceptor(srv, boot, deadline)
        try:
            boot.store.put(boot.scope, str(boot.rank), f"{_advertised_host(boot)}:{srv.getsockname()[1]}".encode())
            acceptor.start()
            for peer in range(boot.rank):
                socks[peer] = _connect_to(boot, peer, deadline)
            for peer, sock in acceptor.wait().items():
                socks[peer] = sock
        except BaseException:
            acceptor.discard()
            for s in socks:
                sockets.maybe_close(s)
            raise
        finally:
            sockets.maybe_close(srv)  # nobody may join after the mesh is complete
        logger.debug("tcp transport: rank %d connected to %d peers", boot.rank, boot.size - 1)
    mesh = _Mesh(boot, socks)
    return TcpTransport(mesh, range(boot.size), owner=True)
