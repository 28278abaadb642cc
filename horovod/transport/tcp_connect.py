"""Connecting the TCP mesh: every rank listens, publishes its address, dials the lower ranks, and accepts the higher.

Every connection is authenticated with the job secret (HMAC challenge, :mod:`horovod.transport.sockets`) before
anything else crosses it; each incoming one is authenticated in its own thread, so a silent stranger cannot hold
up the real peers, and at most :data:`~horovod.transport.sockets.MAX_PENDING_HANDSHAKES` are pending at once, the
oldest pushed out first, so no number of strangers can lock a real peer out (it dials again if pushed out).
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Dict, Iterable, List, Optional

from horovod.transport import sockets
from horovod.transport.base import Bootstrap, TransportError
from horovod.transport.rendezvous import auth_failure_note

logger = logging.getLogger(__name__)

_HELLO = "hvd-tcp"

def _hello(scope: str, rank: int) -> bytes:
    return f"{_HELLO}|{scope}|{rank}".encode()


def _advertised_host(boot: Bootstrap) -> str:
    if boot.bind_addr in ("", "0.0.0.0", "::"):
        return boot.hostname
    return boot.bind_addr


class _Acceptor:
    """Accepts and authenticates the connections of the higher ranks in a background thread.

    Each connection is authenticated in its own short-lived thread, so a stranger that connects and stays silent
    cannot hold up the real peers; pending handshakes are bounded (:class:`~horovod.transport.sockets.
    PendingHandshakes`); a connection that fails the handshake, names another job's scope, a rank that
    should not call us, or a rank that already connected is logged and dropped.
    """

    def __init__(self, srv: socket.socket, boot: Bootstrap, deadline: float, expected: Iterable[int]):
        self._srv, self._boot, self._deadline = srv, boot, deadline
        self._expected = set(expected)
        self.socks: Dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._pending = sockets.PendingHandshakes()
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
            if self._pending.add(conn) is not None:
                logger.debug("tcp bootstrap (rank %d): pushed out the oldest pending connection (%d so far)",
                             self._boot.rank, self._pending.pushed_out)
            threading.Thread(target=self._admit, args=(conn, addr), name="hvd-tcp-auth", daemon=True).start()

    def _admit(self, conn: socket.socket, addr) -> None:
        boot = self._boot
        who = f"connection from {addr[0]}:{addr[1]}"
        try:
            sockets.configure(conn)
            hello = sockets.authenticate_pending(conn, self._pending, boot.secret, _hello(boot.scope, boot.rank),
                                                 timeout=max(0.1, min(10.0, self._deadline - time.monotonic())),
                                                 peer=who)
            tag, scope, rank_s = hello.decode(errors="replace").split("|", 2)
            peer = int(rank_s)
            if tag != _HELLO or scope != boot.scope:
                raise sockets.PeerError(f"{who} belongs to another job or initialisation ({hello!r})")
        except (sockets.PeerError, OSError, ValueError) as exc:
            # A flood pushes out hundreds of strangers: a line each only when debugging.
            logger.log(logging.DEBUG if isinstance(exc, sockets.PushedOut) else logging.WARNING,
                       "tcp bootstrap (rank %d): dropped %s: %s", boot.rank, who, exc)
            sockets.maybe_close(conn)
            return
        with self._lock:
            if peer not in self._expected or peer in self.socks or self._stop:
                logger.warning("tcp bootstrap (rank %d): dropped %s claiming rank %d (expected one of %s, "
                               "not yet connected)", boot.rank, who, peer, sorted(self._expected - set(self.socks)))
                sockets.maybe_close(conn)
                return
            try:
                sockets.admit(conn)
            except OSError as exc:
                logger.warning("tcp bootstrap (rank %d): rank %d's connection broke as it was admitted: %s",
                               boot.rank, peer, exc)
                sockets.maybe_close(conn)
                return
            self.socks[peer] = conn
            if len(self.socks) == len(self._expected):
                self._done.set()

    def wait(self) -> Dict[int, socket.socket]:
        check = getattr(self._boot.store, "check_abandoned", None)   # an elastic epoch being formed
        while not self._done.wait(min(0.25, max(0.0, self._deadline - time.monotonic()))):
            if time.monotonic() >= self._deadline:
                break
            if check is not None:
                try:
                    check()
                except Exception:
                    self.discard()
                    raise
        with self._lock:
            self._stop = True
            missing = sorted(self._expected - set(self.socks))
        if missing:
            raise TransportError(
                f"tcp bootstrap (rank {self._boot.rank}): rank(s) {missing} did not connect within "
                f"{self._boot.timeout:g} s; they may have failed to start, be unable to reach "
                f"{self._srv.getsockname()}, or hold a different job secret{auth_failure_note(self._boot.store)}",
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

    def dial(seconds: float) -> socket.socket:
        return sockets.connect(host, port, seconds, what=f"rank {peer}", check=getattr(boot.store, "check_abandoned",
                                                                                    None))

    try:
        sock, hello = sockets.dial_authenticated(dial, boot.secret, _hello(boot.scope, boot.rank),
                                                 max(0.1, deadline - time.monotonic()), peer=f"rank {peer}")
    except sockets.PeerError as exc:
        raise TransportError(f"tcp bootstrap (rank {boot.rank}): handshake with rank {peer} at {host}:{port} "
                             f"failed: {exc}", peer=peer) from None
    try:
        if hello != _hello(boot.scope, peer):
            raise sockets.AuthenticationError(f"the process at {host}:{port} introduced itself as {hello!r}, "
                                              f"not as rank {peer} of this job", peer=peer)
    except (sockets.PeerError, OSError) as exc:
        sockets.maybe_close(sock)
        raise TransportError(f"tcp bootstrap (rank {boot.rank}): handshake with rank {peer} at {host}:{port} "
                             f"failed: {exc}", peer=peer) from None
    return sock


def connect_world(boot: Bootstrap, peers: Optional[Iterable[int]] = None) -> List[Optional[socket.socket]]:
    """One authenticated socket per peer rank (``None`` at this rank's own index, and at ranks outside ``peers``
    when given: then only those are connected, and each of them must list this rank among its own).

    Raises:
        TransportError: a rank did not publish its address, could not be reached, failed the handshake, or did
            not connect within ``boot.timeout``; the message names it.
    """
    socks: List[Optional[socket.socket]] = [None] * boot.size
    if boot.size == 1:
        return socks
    if boot.store is None:
        raise TransportError("tcp bootstrap needs a rendezvous store to exchange addresses (none was given)")
    deadline = time.monotonic() + boot.timeout
    wanted = set(range(boot.size) if peers is None else peers) - {boot.rank}
    srv = sockets.listen(boot.bind_addr)
    acceptor = _Acceptor(srv, boot, deadline, [peer for peer in wanted if peer > boot.rank])
    try:
        boot.store.put(boot.scope, str(boot.rank), f"{_advertised_host(boot)}:{srv.getsockname()[1]}".encode())
        acceptor.start()
        for peer in sorted(p for p in wanted if p < boot.rank):
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
    logger.debug("tcp transport: rank %d connected to %d peers", boot.rank, len(wanted))
    return socks
