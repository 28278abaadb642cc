"""Setting up the shared-memory data plane: this process's node, the segments, and the messages that exchange them.

A *node* is what one process shares between the world group and its subgroups: an authenticated UNIX socket to
every other local rank, each peer's wake-up descriptor, and the groups built so far.  Segments are anonymous
memory whose descriptors travel over those sockets (``SCM_RIGHTS``).  The collectives themselves live in
:mod:`horovod.transport.shm`, whose docstring explains the design.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import mmap
import os
import queue
import secrets
import select
import socket
import struct
import sys
import tempfile
import threading
import time
import weakref
from typing import Dict, List, Optional, Protocol, Sequence, Tuple, cast

from horovod.transport import sockets as _sk
from horovod.transport.base import Bootstrap, LocalTransport, Transport, TransportError
from horovod.transport.cma import Reader

logger = logging.getLogger(__name__)


class Group(Protocol):
    """What a node needs of the groups it makes (:class:`horovod.transport.shm_group.ShmGroup`, which imports this
    module: a protocol keeps the two apart)."""

    _closed: bool

    def _release(self) -> None:
        """Unmap the group's segments."""

MIB = 1 << 20
# Segment, chunk and one-step sizes are TransportOptions (horovod/transport/base.py), with how they were chosen.
DEFAULT_SPIN_US = 20.0  # only when every rank on the host has a core of its own

_PAGE = 4096
# The node's public API, used by the collectives in horovod/transport/shm.py:
LINE_BYTES = 64  # cache line: shares and flags are aligned to it
MAGIC = 0x31534D4853445648  # "HVDSHMS1"
HELLO = struct.Struct("<QQQQ32s")  # magic, rank, segment bytes, pid, digest of the group
LENGTH = struct.Struct("<Q")  # length prefix of a message
ONE = struct.pack("<Q", 1)  # one eventfd wake-up
POLL_DEAD = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)
# The fast lane (horovod/engine/lane_board.py): LANE_FIELD_COUNT int64 counters at byte LANE_FIELDS of the header
# (after the step counter, before the metadata at 128), and two payload areas in every segment (only the world
# group's are used).
LANE_FIELDS = 16
LANE_FIELD_COUNT = 10
# 1 MiB: a lone blocking collective up to this size per rank is agreed and carried out in one synchronisation (it
# beats a round plus the data plane's steps 2-3x at 64-256 KiB on one host, np = 2; a broadcast 1.6x at 1 MiB, an
# allgather 1.3-1.8x; the engine's fast lane holds each kind to its own limit below this), and a page for what an
# alltoall's rows travel behind (its splits, 8 bytes a rank: up to 512 ranks), so that its 1 MiB fits.
LANE_PAYLOAD_BYTES = 1024 * 1024 + 4096
# The round board (horovod/engine/shm_round_board.py): per segment, after the fast lane's payloads, two int64 fields and
# two records of 1 + ROUND_WORDS words (only the world group's are used).
ROUND_WORDS = 132
ROUND_BOARD_BYTES = 8 * (2 + 2 * (1 + ROUND_WORDS))
IO_CHUNK = 4 * MIB  # largest single socket read/write when a collective falls back to the sockets
_LIVE_NODES: "weakref.WeakSet[Node]" = weakref.WeakSet()


def _drop_in_forked_child() -> None:
    """In a child forked after setup: close inherited sockets so the parent's death still hangs them up."""
    for node in list(_LIVE_NODES):
        node.close(in_child=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_forked_child)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def meta_bytes(size: int) -> int:
    """One half's metadata block: a more-flag, a buffer address, a byte count per rank and ``size + 1`` byte
    offsets into the buffer (single-copy reads, :mod:`horovod.transport.cma`)."""
    return _round_up(8 * (2 * size + 3), LINE_BYTES)


def lane_payload_offset(size: int) -> int:
    """Where a segment's fast-lane payload starts: after the header and the two metadata blocks."""
    return 128 + 2 * meta_bytes(size)


def round_board_offset(size: int) -> int:
    """Where a segment's round board starts: after the fast lane's two payloads."""
    return _round_up(lane_payload_offset(size) + 2 * LANE_PAYLOAD_BYTES, LINE_BYTES)


def _make_wake() -> Tuple[int, int]:
    """(read end, write end) of this process's wake-up channel: an eventfd (both ends equal) or a pipe."""
    if hasattr(os, "eventfd"):
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return fd, fd
    r, w = os.pipe()
    for fd in (r, w):
        os.set_blocking(fd, False)
        os.set_inheritable(fd, False)
    return r, w


def new_segment_fd(name: str, nbytes: int, backing: str) -> int:
    """A descriptor of ``nbytes`` of fresh shared memory that has no name left anywhere once this returns."""
    if backing == "memfd" and hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    else:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        # The descriptor (passed to the peers) keeps the memory alive; unlinking now means a crash leaks nothing.
        os.unlink(path)
    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


def _dial_unix(addr: str, seconds: float) -> socket.socket:
    """A blocking connection to a peer's listening Unix socket (``addr``: a path, or ``\\0``-prefixed name)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(0.1, seconds))
        sock.connect(addr)
    except BaseException:
        sock.close()
        raise
    return sock


def map_segment(fd: int, nbytes: int, writable: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in now, not in a collective
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, nbytes, flags=flags, prot=prot)


def segment_layout(segment_bytes: int, size: int) -> Tuple[int, int, int, int]:
    """(metadata bytes per half, data offset, half bytes, total bytes) of a segment.

    Header: step counter at 0, the fast lane's counters at :data:`LANE_FIELDS`, then one metadata block per half
    at 128 (:func:`meta_bytes`: a more-flag, a buffer address for single-copy reads, per-peer byte counts or
    offsets), then the fast lane's two payloads (:func:`lane_payload_offset`) and the round board
    (:func:`round_board_offset`).
    """
    meta = meta_bytes(size)
    data_off = _round_up(round_board_offset(size) + ROUND_BOARD_BYTES, _PAGE)
    # at least one cache line per peer in the per-destination subslots of alltoallv / reducescatter
    half = max(_round_up(size * LINE_BYTES, _PAGE), segment_bytes // 2 // _PAGE * _PAGE)
    return meta, data_off, half, data_off + 2 * half


class _Peer:
    """Another rank on this host: the authenticated socket to it and its wake-up descriptor."""

    def __init__(self, rank: int, sock: socket.socket, wake_fd: int, pid: int):
        self.rank, self.sock, self.wake_fd, self.pid = rank, sock, wake_fd, pid


def send_msg(sock: socket.socket, payload: bytes, fds: Sequence[int], deadline: float, peer: str) -> None:
    """Send one small message (with descriptors) on a non-blocking socket."""
    while True:
        try:
            n = socket.send_fds(sock, [payload], list(fds)) if fds else sock.send(payload, socket.MSG_NOSIGNAL)
            break
        except (BlockingIOError, InterruptedError):
            _poll_one(sock, select.POLLOUT, deadline, peer)
        except OSError as exc:
            raise TransportError(f"shm transport: sending to {peer} failed ({exc}); the process may have exited",
                                 peer=peer) from exc
    if n < len(payload):
        _send_all(sock, memoryview(payload)[n:], deadline, peer)


def _send_all(sock: socket.socket, view: memoryview, deadline: float, peer: str) -> None:
    sent = 0
    while sent < len(view):
        try:
            sent += sock.send(view[sent:sent + IO_CHUNK], socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            _poll_one(sock, select.POLLOUT, deadline, peer)
        except OSError as exc:
            raise TransportError(f"shm transport: sending to {peer} failed ({exc}); the process may have exited",
                                 peer=peer) from exc


def recv_msg(sock: socket.socket, size: int, nfds: int, deadline: float, peer: str) -> Tuple[bytes, List[int]]:
    """Receive one ``size``-byte message and up to ``nfds`` descriptors on a non-blocking socket."""
    data, fds = b"", []  # type: Tuple[bytes, List[int]]
    while len(data) < size:
        try:
            chunk, got, _flags, _addr = socket.recv_fds(sock, size - len(data), nfds if not data else 0)
        except (BlockingIOError, InterruptedError):
            _poll_one(sock, select.POLLIN, deadline, peer)
            continue
        except OSError as exc:
            raise TransportError(f"shm transport: receiving from {peer} failed ({exc})", peer=peer) from exc
        if not chunk:
            for fd in fds + got:
                os.close(fd)
            raise TransportError(f"shm transport: {peer} closed its connection during setup (the process exited or "
                                 f"was killed)", peer=peer)
        data += chunk
        fds += got
    return data, fds


def _poll_one(sock: socket.socket, events: int, deadline: float, peer: str) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransportError(f"shm transport: timed out waiting for {peer}", peer=peer)
    p = select.poll()
    p.register(sock, events)
    p.poll(remaining * 1000 + 1)


class Node:
    """What this process shares between the world group and its subgroups: identity, sockets, wake-ups.

    Args:
        boot: the bootstrap of the world group.
    """

    def __init__(self, boot: Bootstrap, group_type: type):
        opts = boot.options
        self.group_type = group_type   # the transport class groups are built with
        self.rank, self.size = boot.rank, boot.size
        self.timeout = float(boot.timeout)
        self.token = hmac.new(boot.secret, b"shm|" + boot.scope.encode(), hashlib.sha256).hexdigest()[:16]
        self.segment_bytes = max(int(opts.shm_segment_bytes), 2 * _PAGE)
        self.chunk_bytes = max(int(opts.shm_chunk_bytes), _PAGE)
        self.small_bytes = int(opts.shm_small_bytes)
        self.spin_us = opts.shm_spin_us
        self.backing = str(opts.shm_backing)
        self.single_copy_bytes = max(0, int(opts.shm_single_copy_bytes))
        #: Reads from the peers' memory, once the world group found every rank can (ShmGroup.probe_single_copy).
        self.cma: Optional[Reader] = None
        if self.backing not in ("memfd", "file"):
            raise ValueError(f"shm_backing must be 'memfd' or 'file', got {self.backing!r}")
        self.wake_r, self.wake_w = _make_wake()
        self.peers: Dict[int, _Peer] = {}
        self.gone: set = set()  # world ranks whose socket hung up
        self.heard_at: Dict[int, float] = {}   # world rank -> when it was last seen to progress (a slow wait only)
        self.groups: Dict[Tuple[int, ...], Group] = {}   # of ``group_type``
        self.world: Optional[Group] = None
        self.closed = False
        _LIVE_NODES.add(self)

    def segment_name(self, what: str) -> str:
        return f"hvd-shm-{self.token}-{what}-r{self.rank}-{secrets.token_hex(4)}"

    def describe(self, world_rank: int) -> str:
        peer = self.peers.get(world_rank)
        return f"local rank {world_rank}" + (f" (pid {peer.pid})" if peer else "")

    # -- setup -------------------------------------------------------------------------------------------------

    def connect(self, boot: Bootstrap, seg_fd: int, seg_bytes: int) -> Dict[int, int]:
        """Connect and authenticate every pair, exchanging wake-up and segment descriptors.

        Returns:
            world rank -> the peer's segment descriptor (to be mapped, then closed).
        """
        scope = boot.scope + "-shm"
        deadline = time.monotonic() + self.timeout
        hello = f"{scope}|{self.rank}".encode()
        digest = self.group_digest(tuple(range(self.size)))
        seg_fds: Dict[int, int] = {}
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = None
        try:
            if sys.platform.startswith("linux"):
                addr = f"\0hvd-shm-{self.token}-r{self.rank}-{secrets.token_hex(8)}"
            else:
                path = addr = os.path.join(tempfile.gettempdir(), f"hvd-shm-{self.token}-{secrets.token_hex(6)}")
            listener.bind(addr)
            listener.listen(_sk.LISTEN_BACKLOG)   # the name is listed in /proc/net/unix: strangers may connect
            self._store(boot.store.put, scope, f"addr.{self.rank}", addr.encode())
            for q in range(self.rank):  # connect to lower ranks, accept higher ones: no cycle, no deadlock
                what = f"local rank {q}"
                peer_addr = self._store(boot.store.get, scope, f"addr.{q}",
                                        timeout=max(0.1, deadline - time.monotonic()))
                sock = None
                try:
                    # Dials again if the peer's listener pushed us out under a flood of strangers (see accept).
                    sock, theirs = _sk.dial_authenticated(lambda seconds: _dial_unix(peer_addr.decode(), seconds),
                                                          boot.secret, hello, max(0.1, deadline - time.monotonic()),
                                                          what)
                    if theirs != f"{scope}|{q}".encode():
                        raise TransportError(f"shm transport: {what} answered as {theirs!r}; expected "
                                             f"{scope}|{q} (a stale job?)", peer=q)
                    seg_fds[q] = self._exchange(sock, q, seg_fd, seg_bytes, digest, deadline)
                except (OSError, _sk.PeerError) as exc:
                    _sk.maybe_close(sock)
                    raise TransportError(f"shm transport: could not connect to {what}: {exc}", peer=q) from exc
                except BaseException:
                    _sk.maybe_close(sock)
                    raise
            self._accept_higher(listener, boot, scope, hello, seg_fds, seg_fd, seg_bytes, digest, deadline)
        except BaseException:
            for fd in seg_fds.values():
                os.close(fd)
            raise
        finally:
            listener.close()
            if path:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        return seg_fds

    def _accept_higher(self, listener: socket.socket, boot: Bootstrap, scope: str, hello: bytes,
                       seg_fds: Dict[int, int], seg_fd: int, seg_bytes: int, digest: bytes, deadline: float) -> None:
        """Accept the higher ranks: each connection authenticated in a thread of its own, at most
        :data:`~horovod.transport.sockets.MAX_PENDING_HANDSHAKES` pending with the oldest pushed out, so silent
        local strangers can neither hold up a real peer nor lock it out; descriptors are exchanged here, in order."""
        pending = _sk.PendingHandshakes()
        done: "queue.Queue[Tuple[socket.socket, Optional[bytes], Optional[BaseException]]]" = queue.Queue()
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        listener.setblocking(False)

        def handshake(sock: socket.socket, limit: float) -> None:
            try:
                done.put((sock, _sk.authenticate_pending(sock, pending, boot.secret, hello, limit, "a local peer"),
                          None))
            except (_sk.PeerError, OSError) as exc:
                done.put((sock, None, exc))
            try:
                wake_w.send(b"\0")
            except OSError:
                pass   # the setup finished (or failed) meanwhile

        try:
            while len(seg_fds) < self.size - 1:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self.rank + 1, self.size)) - set(seg_fds))
                    raise TransportError(f"shm transport: local ranks {missing} did not connect within "
                                         f"{self.timeout:.0f} s; did they start and call init()?", peer=missing[0])
                check = getattr(boot.store, "check_abandoned", None)   # an elastic epoch being formed
                if check is not None:
                    check()
                readable, _, _ = select.select([listener, wake_r], [], [],
                                               remaining if check is None else min(remaining, 0.25))
                if listener in readable:
                    try:
                        sock, _ = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        sock = None
                    if sock is not None:
                        sock.setblocking(True)
                        pending.add(sock)
                        # a genuine peer answers at once; a silent stranger holds only its own thread
                        threading.Thread(target=handshake, args=(sock, max(0.1, min(remaining, 10.0))),
                                         name="hvd-shm-handshake", daemon=True).start()
                if wake_r in readable:
                    try:
                        wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                while True:
                    try:
                        sock, theirs, error = done.get_nowait()
                    except queue.Empty:
                        break
                    q = -1
                    if error is None and theirs is not None:
                        sc, _, qs = theirs.decode(errors="replace").rpartition("|")
                        q = int(qs) if qs.isdigit() else -1
                        if sc != scope or not self.rank < q < self.size or q in seg_fds:
                            error = _sk.PeerError(f"unexpected hello {theirs!r}")
                    if error is not None:
                        logger.log(logging.DEBUG if isinstance(error, _sk.PushedOut) else logging.WARNING,
                                   "shm transport: dropped a connection that failed authentication: %s", error)
                        sock.close()
                        continue
                    try:
                        _sk.admit(sock)
                        seg_fds[q] = self._exchange(sock, q, seg_fd, seg_bytes, digest, deadline)
                    except BaseException:
                        sock.close()
                        raise
        finally:
            wake_r.close()
            wake_w.close()

    @staticmethod
    def _store(call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except (TimeoutError, ConnectionError, PermissionError) as exc:
            raise TransportError(f"shm transport: rendezvous failed while finding the local peers: {exc}") from exc

    def _exchange(self, sock: socket.socket, q: int, seg_fd: int, seg_bytes: int, digest: bytes,
                  deadline: float) -> int:
        sock.setblocking(False)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, 4 * MIB)
            except OSError:
                pass
        what = f"local rank {q}"
        send_msg(sock, HELLO.pack(MAGIC, self.rank, seg_bytes, os.getpid(), digest), [self.wake_w, seg_fd],
                  deadline, what)
        data, fds = recv_msg(sock, HELLO.size, 2, deadline, what)
        magic, rank, nbytes, pid, their_digest = HELLO.unpack(data)
        if magic != MAGIC or rank != q or their_digest != digest or nbytes != seg_bytes or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise TransportError(f"shm transport: {what} sent a malformed setup message (rank {rank}, "
                                 f"{nbytes} bytes, {len(fds)} descriptors); are both ranks the same version "
                                 f"with the same options?", peer=q)
        self.peers[q] = _Peer(q, sock, fds[0], pid)
        return fds[1]

    def group_digest(self, members: Tuple[int, ...]) -> bytes:
        return hashlib.sha256(f"{self.token}|{members}".encode()).digest()

    # -- groups ------------------------------------------------------------------------------------------------

    def subgroup(self, members: Tuple[int, ...]) -> Transport:
        if self.closed:
            raise TransportError("shm transport: subgroup() after close()")
        if len(members) == 1:
            return LocalTransport()
        if members == tuple(range(self.size)):
            if self.world is None:
                raise TransportError("shm transport: subgroup() before the world group was built")
            return cast(Transport, self.world)   # every group is a Transport (ShmGroup)
        group = self.groups.get(members)
        if group is None or group._closed:
            group = self.groups[members] = self.group_type(self, members)
        return cast(Transport, group)

    def close(self, in_child: bool = False) -> None:
        """Release every group, socket and descriptor (``in_child``: only descriptors; mappings die with us)."""
        if self.closed:
            return
        self.closed = True
        _LIVE_NODES.discard(self)
        groups: List[Optional[Group]] = [] if in_child else [*self.groups.values(), self.world]
        for group in groups:
            if group is not None:
                group._release()
        for peer in self.peers.values():
            _sk.maybe_close(peer.sock)
            try:
                os.close(peer.wake_fd)
            except OSError:
                pass
        self.peers.clear()
        for fd in {self.wake_r, self.wake_w}:
            try:
                os.close(fd)
            except OSError:
                pass
