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
import time
from typing import Optional, Tuple

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


def listen(host: str, backlog: int = 128) -> socket.socket:
    """A listening socket on ``host`` (never wider than asked) and an ephemeral port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, 0))
    srv.listen(backlog)
    return srv


def connect(host: str, port: int, timeout: float, what: str = "peer") -> socket.socket:
    """Connect, retrying refused connections until ``timeout`` (the peer may still be starting)."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            return configure(sock)
        except OSError as exc:
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


def recv_frame(sock: socket.socket, peer: object = None, max_bytes: int = 1 << 40) -> bytes:
    """Receive one length-prefixed frame."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, peer))
    if n > max_bytes:
        raise PeerError(f"{peer} announced a frame of {n} bytes (limit {max_bytes}); protocol mismatch", peer=peer)
    return recv_exact(sock, n, peer)


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
