"""Socket plumbing shared by the control plane and the TCP data plane.

Framing is a 8-byte little-endian length followed by the payload.  Every connection starts with a mutual
HMAC challenge over the job secret, so nothing read afterwards comes from a stranger; only then may a
caller unpickle what it receives.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional, Tuple

_LEN = struct.Struct("<Q")
_NONCE_BYTES = 32
_MAGIC = b"HVDN1"


class PeerError(ConnectionError):
    """A peer misbehaved: it closed, timed out, or failed authentication.

    Attributes:
        peer: the rank (or address) of the peer, for the message.
    """

    def __init__(self, message: str, peer: object = None):
        super().__init__(message)
        self.peer = peer


class AuthenticationError(PeerError):
    """The peer did not prove it knows the job secret."""


class PushedOut(PeerError):
    """A connection was still authenticating when newer ones pushed it out (see :class:`PendingHandshakes`)."""


def configure(sock: socket.socket) -> socket.socket:
    """Low latency and large buffers for a connected TCP socket."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
        except OSError:
            pass
    return sock


#: Connections the kernel queues before a listener accepts them.  A stranger's flood of connects must not fill the
#: queue a real peer needs (the kernel caps it at ``net.core.somaxconn``).
LISTEN_BACKLOG = 1024

#: Connections a listener authenticates at once; one more pushes out the oldest (see :class:`PendingHandshakes`).
MAX_PENDING_HANDSHAKES = 64


def listen(host: str, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """A listening socket on ``host`` (never wider than asked) and an ephemeral port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, 0))
    srv.listen(backlog)
    return srv


def connect(host: str, port: int, timeout: float, what: str = "peer",
            check: Optional[Callable[[], None]] = None) -> socket.socket:
    """Connect, retrying refused connections until ``timeout`` (the peer may still be starting).

    ``check`` is called between attempts and may raise to give up early (an elastic epoch abandoned meanwhile).
    """
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            return configure(sock)
        except OSError as exc:
            if check is not None:
                check()
            if time.monotonic() + delay > deadline:
                raise PeerError(
                    f"could not connect to {what} at {host}:{port} within {timeout:.0f} s ({exc}); "
                    f"check that the address is reachable from this host and the job is still running",
                    peer=what) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def recv_exact(sock: socket.socket, n: int, peer: object = None) -> bytes:
    """Read exactly ``n`` bytes (blocking, honouring the socket's timeout)."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), peer)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, peer: object = None) -> None:
    """Fill ``view`` completely from ``sock``."""
    got = 0
    n = len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout as exc:
            raise PeerError(f"timed out waiting for data from {peer}", peer=peer) from exc
        except OSError as exc:
            raise PeerError(f"connection to {peer} failed: {exc}", peer=peer) from exc
        if k == 0:
            raise PeerError(f"{peer} closed the connection (the process may have exited or crashed)", peer=peer)
        got += k


def send_frame(sock: socket.socket, payload: bytes, peer: object = None) -> None:
    """Send one length-prefixed frame."""
    try:
        sock.sendall(_LEN.pack(len(payload)) + payload if len(payload) < 65536 else _LEN.pack(len(payload)))
        if len(payload) >= 65536:
            sock.sendall(payload)
    except OSError as exc:
        raise PeerError(f"sending to {peer} failed: {exc}", peer=peer) from exc


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def authenticate(sock: socket.socket, secret: bytes, initiator: bool, hello: bytes = b"",
                 timeout: float = 30.0, peer: object = None) -> bytes:
    """Mutual HMAC challenge-response; returns the peer's ``hello`` (e.g. its rank), authenticated.

    Both sides send a fresh nonce; each proves knowledge of ``secret`` by MACing both nonces, its role and
    its hello.  Raises :class:`AuthenticationError` naming the peer when the proof is wrong.
    """
    old_timeout = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        mine = secrets.token_bytes(_NONCE_BYTES)
        sock.sendall(_MAGIC + mine)
        head = recv_exact(sock, len(_MAGIC) + _NONCE_BYTES, peer)
        if head[: len(_MAGIC)] != _MAGIC:
            raise AuthenticationError(f"{peer} does not speak this protocol (bad magic)", peer=peer)
        theirs = head[len(_MAGIC):]
        role, other_role = (b"I", b"R") if initiator else (b"R", b"I")
        proof = _mac(secret, role, mine, theirs, hello)
        sock.sendall(_LEN.pack(len(hello)) + hello + proof)
        (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, peer))
        if n > 4096:
            raise AuthenticationError(f"{peer} sent an oversized hello ({n} bytes)", peer=peer)
        their_hello = recv_exact(sock, n, peer)
        their_proof = recv_exact(sock, 32, peer)
        expected = _mac(secret, other_role, theirs, mine, their_hello)
        if not hmac.compare_digest(expected, their_proof):
            raise AuthenticationError(
                f"authentication with {peer} failed: it does not hold this job's secret "
                f"(a process from another job, or a stray connection); connection dropped", peer=peer)
        return their_hello
    finally:
        sock.settimeout(old_timeout)


class PendingHandshakes:
    """The accepted connections that have not yet proved the job secret: at most ``limit``, oldest out first.

    Anyone who can reach a listening port can open connections and stay silent.  Refusing newcomers once full
    would let ``limit`` such connections lock out a real peer; instead a newcomer pushes out the *oldest*
    pending one, so memory and threads stay bounded and a real peer (whose handshake takes a round trip) gets
    through however many strangers there are.  A connection leaves with :meth:`settle` once its handshake ended;
    authenticated connections are never in here, so nothing unauthenticated can push one out.
    """

    def __init__(self, limit: int = MAX_PENDING_HANDSHAKES):
        self._limit = max(1, limit)
        self._pending: "OrderedDict[int, socket.socket]" = OrderedDict()
        self._lock = threading.Lock()
        self.pushed_out = 0

    def add(self, conn: socket.socket) -> Optional[socket.socket]:
        """Track ``conn``; returns the connection it pushed out, if any (already shut down)."""
        with self._lock:
            evicted = None
            if len(self._pending) >= self._limit:
                _, evicted = self._pending.popitem(last=False)
                self.pushed_out += 1
            self._pending[id(conn)] = conn
        if evicted is not None:
            # shutdown, not close: its handshake thread is blocked reading it and must wake up (and close it).
            try:
                evicted.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return evicted

    def settle(self, conn: socket.socket) -> bool:
        """``conn``'s handshake ended: False when it had been pushed out meanwhile (the caller must drop it)."""
        with self._lock:
            return self._pending.pop(id(conn), None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


#: The listener's last word of a handshake: "you are admitted" (it may still push out a connection that proved
#: the secret but whose admission it had not yet decided; without this byte the dialer could not tell).
_ADMITTED = b"+"


def authenticate_pending(conn: socket.socket, pending: PendingHandshakes, secret: bytes, hello: bytes,
                         timeout: float, peer: object) -> bytes:
    """The listener's side: authenticate ``conn`` (tracked in ``pending``) and take it out of ``pending``.

    Returns the peer's authenticated hello; the caller decides whether to admit it and then calls :func:`admit`
    (or closes it).

    Raises:
        AuthenticationError: the peer does not hold the secret.
        PushedOut: newer connections pushed it out meanwhile (its reads failed, or it finished too late).
        PeerError: it closed or timed out.
    """
    try:
        theirs = authenticate(conn, secret, initiator=False, hello=hello, timeout=timeout, peer=peer)
    except (PeerError, OSError) as exc:
        if not pending.settle(conn):   # its reads failed because it was shut down to make room
            raise PushedOut(f"{peer} was pushed out by newer unauthenticated connections before it "
                            f"authenticated", peer=peer) from exc
        raise
    except BaseException:
        pending.settle(conn)
        raise
    if not pending.settle(conn):
        raise PushedOut(f"{peer} was pushed out by newer unauthenticated connections before it finished the "
                        f"handshake (it dials again)", peer=peer)
    return theirs


def admit(conn: socket.socket) -> None:
    """Tell a dialer that its authenticated connection is accepted (see :func:`dial_authenticated`)."""
    conn.sendall(_ADMITTED)


def dial_authenticated(dial: Callable[[float], socket.socket], secret: bytes, hello: bytes, timeout: float,
                       peer: object) -> Tuple[socket.socket, bytes]:
    """Connect with ``dial(seconds_left)``, authenticate and wait to be admitted; returns ``(socket, their hello)``.

    The other side uses :func:`authenticate_pending` and :func:`admit`.  A listener under a flood of strangers
    may push our connection out before it admits it (see :class:`PendingHandshakes`): that looks like a reset
    or a close, and we dial again until ``timeout``.  A wrong secret (:class:`AuthenticationError`) is final.
    """
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        sock = dial(max(0.1, deadline - time.monotonic()))
        old_timeout = sock.gettimeout()
        try:
            theirs = authenticate(sock, secret, initiator=True, hello=hello,
                                  timeout=max(0.1, deadline - time.monotonic()), peer=peer)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            if recv_exact(sock, len(_ADMITTED), peer) != _ADMITTED:
                raise AuthenticationError(f"{peer} answered the handshake with an unknown admission byte "
                                          f"(a different protocol version?)", peer=peer)
            sock.settimeout(old_timeout)
            return sock, theirs
        except AuthenticationError:
            maybe_close(sock)
            raise
        except (PeerError, OSError) as exc:
            maybe_close(sock)
            if time.monotonic() + delay >= deadline:
                raise PeerError(f"the handshake with {peer} kept failing for {timeout:.0f} s (last: {exc}); "
                                f"check that it is still running and reachable", peer=peer) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def local_address_for(host: str) -> str:
    """The address of this machine's interface that routes to ``host`` (no packet is sent)."""
    if host in ("localhost", "127.0.0.1", "::1", ""):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def parse_hostport(value: str) -> Tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def maybe_close(sock: Optional[socket.socket]) -> None:
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass
