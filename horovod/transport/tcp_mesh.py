"""The TCP mesh under :mod:`horovod.transport.tcp`: one connection per pair of ranks, and the event loop that
runs plans.

A collective is compiled into a :class:`Plan`: per peer :class:`Channel`, an ordered list of sends and receives
(a receive may reduce into a buffer as it arrives, a send may wait for a receive to finish). :meth:`Mesh.run`
executes a plan with one single-threaded ``poll`` loop over non-blocking sockets, so every peer's traffic progresses
together and two neighbours sending large buffers at once never deadlock. It never spins, and gives up after the
transport's timeout without progress. A rank that fails records its reason in the rendezvous store and closes
every connection, so the others fail at once and name the rank that really failed.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import Dict, List, Optional, Protocol, Tuple

import numpy as np

from horovod.transport import sockets
from horovod.transport.base import SUM, Bootstrap, Finish, TransportError, reduce_into


class PeerNames(Protocol):
    """How the caller (a transport over a group of ranks) names peers in errors: the mesh knows world ranks only."""

    def describe(self, world: int) -> str: ...

    def group_rank(self, world: int) -> object: ...


logger = logging.getLogger(__name__)

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
# POLLRDHUP (Linux) reports a peer that closed even while we only have data to *send* to it.
_POLLCLOSED = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)

# How long a failing rank may spend recording its reason, and a peer looking it up (failure path only).
_ABORT_RECORD_S = 0.5
_ABORT_LOOKUP_S = 0.5
# How long a rank that timed out waiting for a peer first looks for that peer's own timeout report.  An algorithm
# may wait on a peer that itself waits on the frozen rank (the extra rank of recursive doubling waits for its
# proxy, a ring or tree waits on its neighbour): that peer started waiting a moment later, so its report comes
# a moment later, and it names the rank really at fault.
_CHAIN_LOOKUP_S = 2.0


#: Largest scratch buffer a mesh keeps between collectives (per slot).
SCRATCH_KEEP_BYTES = 64 << 20


def as_bytes(arr: np.ndarray) -> memoryview:
    """A flat byte view of a 1-D contiguous array (no copy)."""
    return arr.view(np.uint8).data   # ndarray.data: the same memoryview, typed as one


# --------------------------------------------------------------------------------------------------- plans


class Channel:
    """The traffic with one peer inside one collective: ordered sends and ordered receives."""

    __slots__ = ("world", "sock", "sends", "si", "soff", "recvs", "ri", "roff", "moved")

    def __init__(self, world: int, sock: socket.socket):
        self.world, self.sock = world, sock
        self.moved = 0.0   # when bytes last moved with this peer, either way (time.monotonic())
        self.sends: List[tuple] = []  # (view, dep_chan or None, dep_count)
        self.si = self.soff = 0
        self.recvs: List[tuple] = []  # (view, (reduce_dst, reduce_src) or None, finish or None)
        self.ri = self.roff = 0

    def send(self, view: memoryview, after: Optional[Tuple["Channel", int]] = None) -> None:
        """Queue ``view``; with ``after=(chan, n)`` it waits until ``chan`` has completed ``n`` receives."""
        if len(view):
            if after is None:
                self.sends.append((view, None, 0))
            else:
                self.sends.append((view, after[0], after[1]))

    def recv(self, view: memoryview, reduce: Optional[Tuple[np.ndarray, np.ndarray]] = None,
             finish: Optional[Finish] = None) -> Tuple["Channel", int]:
        """Queue a receive into ``view`` (then ``reduce_into(*reduce)``, then ``finish`` on the reduced
        destination: the last reduction of a piece); returns a handle for :meth:`send`."""
        if len(view):
            self.recvs.append((view, reduce, finish))
        return self, len(self.recvs)

    def pending_recv_bytes(self) -> int:
        if self.ri >= len(self.recvs):
            return 0
        return sum(len(r[0]) for r in self.recvs[self.ri:]) - self.roff

    def pending_send_bytes(self) -> int:
        if self.si >= len(self.sends):
            return 0
        return sum(len(s[0]) for s in self.sends[self.si:]) - self.soff


class Plan:
    """The channels of one collective, one per peer (a peer may be both left and right neighbour)."""

    __slots__ = ("mesh", "chans")

    def __init__(self, mesh: "Mesh"):
        self.mesh = mesh
        self.chans: Dict[int, Channel] = {}

    def chan(self, world: int) -> Channel:
        c = self.chans.get(world)
        if c is None:
            c = self.chans[world] = Channel(world, self.mesh.sock(world))
        return c


# ---------------------------------------------------------------------------------------------------- mesh


class Mesh:
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
        # When a byte last arrived from each world rank (time.monotonic()): life for the engine's liveness, and which
        # peer to name when a collective stops making progress.
        self.heard_at: List[float] = [0.0] * self.size
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
        """A byte buffer of at least ``nbytes``: reused between calls (grown geometrically) up to
        :data:`SCRATCH_KEEP_BYTES`; a larger one is the caller's alone and freed with it, so one huge collective
        (a reducescatter's work buffer is the whole tensor) does not hold its size for the rest of the job."""
        if nbytes > SCRATCH_KEEP_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        buf = self._scratch.get(slot)
        if buf is None or buf.size < nbytes:
            grown = min(max(nbytes, 2 * (0 if buf is None else buf.size), 4096), SCRATCH_KEEP_BYTES)
            buf = np.empty(grown, dtype=np.uint8)
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

    def abort_reason(self, world: int, wait: float = _ABORT_LOOKUP_S) -> Optional[Tuple[int, str]]:
        """What world rank ``world`` recorded when it aborted: ``(culprit world rank or -1, message)``; waits up to
        ``wait`` seconds for the record to appear."""
        if self.store is None:
            return None
        raw = _bounded(lambda: self.store.get(self.scope, f"abort.{world}", timeout=wait), wait + 0.5)
        if not raw:
            return None
        culprit, _, text = raw.decode(errors="replace").partition("\n")
        try:
            return int(culprit), text
        except ValueError:
            return None

    def _follow_waits(self, peer: int) -> Tuple[int, List[int]]:
        """The rank at the end of the chain of waits that starts at ``peer``: ``(culprit, [peer, ..., culprit])``.

        This rank timed out waiting for ``peer``.  It says so in the store at once (``stuck.<rank>``), then reads
        whether ``peer`` timed out too, waiting for somebody else, and follows that chain.  Ranks closer to the
        frozen one started waiting earlier, so their notes are already there (the first hop may lag by the
        moment ``peer`` started waiting after us: :data:`_CHAIN_LOOKUP_S`).  The rank without a note is the one
        that stopped; a cycle (a deadlock, mismatched collectives) blames ``peer``.
        """
        chain = [peer]
        if self.store is None or self.failed is not None:
            return peer, chain
        _bounded(lambda: self.store.put(self.scope, f"stuck.{self.rank}", str(peer).encode()), _ABORT_RECORD_S)
        wait = _CHAIN_LOOKUP_S
        while len(chain) <= self.size:
            at = chain[-1]
            raw = _bounded(lambda: self.store.get(self.scope, f"stuck.{at}", timeout=wait), wait + 0.5)
            wait = _ABORT_LOOKUP_S
            try:
                nxt = int(raw.decode()) if raw else None
            except ValueError:
                nxt = None
            if nxt is None:
                return at, chain
            if nxt == self.rank or nxt in chain:
                return peer, [peer]   # a cycle: everybody waits for everybody, nobody froze
            chain.append(nxt)
        return peer, [peer]

    # -- the progress loop

    def run(self, plan: Plan, op: str, what: str, view: PeerNames) -> None:
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

    def _drive(self, plan: Plan, op: str, what: str, view: PeerNames) -> None:
        active = [c for c in plan.chans.values() if c.sends or c.recvs]
        if not active:
            return
        deadline = None
        started = time.monotonic()
        look_at = started + self.timeout   # when to look for a silent peer while others keep the plan moving
        while True:
            progressed = False
            unfinished = False
            for c in active:
                heard = False
                recvs = c.recvs
                nr = len(recvs)
                while c.ri < nr:
                    buf, red, finish = recvs[c.ri]
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
                    progressed = heard = True
                    off += k
                    if off < len(buf):
                        c.roff = off
                        break
                    c.roff = 0
                    c.ri += 1
                    if red is not None:
                        reduce_into(red[0], red[1], op)
                        if finish is not None:
                            finish(red[0])
                if heard:
                    self.heard_at[c.world] = c.moved = time.monotonic()
                sends = c.sends
                ns = len(sends)
                sent = False
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
                    progressed = sent = True
                    off += k
                    if off < len(buf):
                        c.soff = off
                        break
                    c.soff = 0
                    c.si += 1
                if sent:   # the peer takes in what this rank sends: alive, though it may not have sent yet
                    c.moved = time.monotonic()
                if c.ri < nr or c.si < ns:
                    unfinished = True
            if not unfinished:
                return
            if progressed:
                deadline = None
                now = time.monotonic()
                if now >= look_at:
                    self._check_silence(active, started, now, view, what)
                    look_at = now + min(1.0, self.timeout / 4)
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout
            elif now >= deadline:
                raise self._timed_out(view, active, what)
            self._wait(active, deadline - now, view, what)

    def _check_silence(self, active: List[Channel], started: float, now: float, view: PeerNames, what: str) -> None:
        """Fail naming a peer this rank still expects bytes from when no bytes moved with it, either way, for the
        timeout, even while other peers keep the plan moving (a frozen peer must not be waited past because a healthy
        one still reads what this rank sends). A peer still taking in this rank's bytes is alive: it may only be
        late to start sending (the kernel's buffers hold a few MiB, so a frozen one stops taking them at once)."""
        for c in active:
            if c.ri < len(c.recvs) and now - max(self.heard_at[c.world], c.moved, started) > self.timeout:
                raise self._timed_out(view, [c], what)

    def exchange(self, dst: Optional[int], sview: Optional[memoryview], src: Optional[int],
                 rview: Optional[memoryview], what: str, view: PeerNames) -> None:
        """One send and/or one receive (world ranks): the latency-critical path of small collectives.

        Small messages almost always fit the socket buffer, so this tries the send outright and then waits on
        the one socket it reads from; anything unusual (a partial send) falls back to :meth:`run`.
        """
        if sview is not None and len(sview):
            assert dst is not None, "exchange: a send without a destination"
            sock = self.sock(dst)
            try:
                k = sock.send(sview)
            except BlockingIOError:
                k = 0
            except OSError as exc:
                raise self._lost(view, dst, what, f"sending failed: {exc}") from None
            if k < len(sview):
                plan = Plan(self)
                plan.chan(dst).send(sview[k:])
                if rview is not None:
                    assert src is not None, "exchange: a receive without a source"
                    plan.chan(src).recv(rview)
                self.run(plan, SUM, what, view)
                return
        if rview is None or not len(rview):
            return
        assert src is not None, "exchange: a receive without a source"
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
                self.heard_at[src] = time.monotonic()
                off += k
                if off == n:
                    return
                deadline = None
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout
            elif now >= deadline:
                chan = Channel(src, sock)
                chan.recvs.append((rview, None))
                chan.roff = off
                raise self._timed_out(view, [chan], what)
            if poller is None:
                poller = select.poll()
                poller.register(sock.fileno(), _POLLIN | _POLLCLOSED)
            poller.poll(max(1, int((deadline - now) * 1000) + 1))

    def _wait(self, active: List[Channel], seconds: float, view: PeerNames, what: str) -> None:
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

    def _lost(self, view: PeerNames, world: int, what: str, detail: str) -> TransportError:
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

    def _timed_out(self, view: PeerNames, active: List[Channel], what: str) -> TransportError:
        waiting = [c for c in active if c.ri < len(c.recvs)]
        blocked = [c for c in active if c.si < len(c.sends)]
        if waiting:
            # The peer silent longest: a peer that sent until a moment ago is alive, and may wait for that one.
            c = min(waiting, key=lambda ch: self.heard_at[ch.world])
            msg = (f"timed out after {self.timeout:.1f} s waiting for {view.describe(c.world)} during {what}: "
                   f"{c.pending_recv_bytes()} bytes still expected from it and nothing arrived")
        else:
            c = blocked[0]
            msg = (f"timed out after {self.timeout:.1f} s during {what}: {view.describe(c.world)} did not accept "
                   f"{c.pending_send_bytes()} more bytes (it is not reading)")
        culprit, chain = self._follow_waits(c.world)
        if culprit != c.world:
            msg += (f"; {view.describe(c.world)} was itself stuck waiting for "
                    f"{' which waited for '.join(view.describe(w) for w in chain[1:])}, so that rank is the cause")
        else:
            msg += ("; the peer may be stuck, much slower, or not calling the same collectives in the same order "
                    "(raise the transport timeout if it is just slow)")
        err = TransportError(msg, peer=view.group_rank(culprit))
        self.abort(err, culprit)
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
