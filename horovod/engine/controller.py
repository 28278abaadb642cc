"""The control plane: a star of authenticated connections between the coordinator (rank 0) and every rank.

Requests go up, planned responses come down, as pickled :class:`ControlMessage` frames.  Pickle is safe here
because each connection is authenticated with the job secret before the first frame is read.  The control
plane is separate from the data plane so that a request arriving mid-collective can never be mistaken for data.
"""
from __future__ import annotations

import logging
import pickle
import queue
import secrets
import select
import socket
import struct
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from horovod.engine.messages import ControlMessage
from horovod.transport import sockets
from horovod.transport.rendezvous import auth_failure_note
from horovod.transport.sockets import PeerError

logger = logging.getLogger(__name__)


class ControlPlane:
    """Authenticated control connections.

    Attributes:
        rank, size: this process's place in the world.
        peers: rank -> socket (the coordinator holds one per worker; a worker holds ``{0: socket}``).
    """

    def __init__(self, rank: int, size: int, peers: Dict[int, socket.socket], listener=None):
        self.rank, self.size, self.peers = rank, size, peers
        self._listener = listener
        self._readers = {peer: FrameReader(sock, f"rank {peer}") for peer, sock in peers.items()}
        # User threads (requests) and the background thread (shutdown notices) both send: frames must not mix.
        self._send_locks = {peer: threading.Lock() for peer in peers}

    @classmethod
    def connect(cls, rank: int, size: int, store, scope: str, secret: bytes, bind_addr: str,
                timeout: float) -> "ControlPlane":
        """Build the star: rank 0 listens and publishes its address; the others connect and authenticate.

        Raises:
            TimeoutError: some ranks did not connect within ``timeout``; the message lists them.
        """
        if size == 1:
            return cls(rank, size, {})
        if rank == 0:
            listener = sockets.listen(bind_addr)
            host, port = listener.getsockname()[:2]
            # Ranks on this machine connect over a Unix socket: a loopback TCP message costs ~5 µs more to send,
            # twice on every small collective's critical path.
            local = _listen_local()
            if local is not None:
                store.put(scope, "coordinator-local", f"{_machine_id()}|{local.getsockname()[1:].decode()}".encode())
            store.put(scope, "coordinator", f"{host}:{port}".encode())
            try:
                peers = cls._accept_all(size, [s for s in (listener, local) if s is not None], secret, timeout,
                                        f"{host}:{port}", getattr(store, "check_abandoned", None))
            except TimeoutError as exc:   # a rank refused by the store for its secret is named
                raise TimeoutError(f"{exc}{auth_failure_note(store)}") from None
            finally:
                listener.close()
                sockets.maybe_close(local)
            return cls(rank, size, peers)
        value = store.get(scope, "coordinator", timeout=timeout).decode()   # published after the local name
        local = store.try_get(scope, "coordinator-local")
        host, port = sockets.parse_hostport(value)

        def dial(seconds: float) -> socket.socket:
            conn = _connect_local(local, seconds)
            return conn if conn is not None else sockets.connect(host, port, seconds, what="the coordinator (rank 0)",
                                                                 check=getattr(store, "check_abandoned", None))

        conn, _ = sockets.dial_authenticated(dial, secret, str(rank).encode(), timeout, "the coordinator (rank 0)")
        conn.settimeout(None)
        return cls(rank, size, {0: conn})

    @staticmethod
    def _accept_all(size: int, listeners: List[socket.socket], secret: bytes, timeout: float,
                    where: str, check: Optional[Callable[[], None]] = None) -> Dict[int, socket.socket]:
        """Accept and authenticate one connection from every other rank.

        Each connection is authenticated in a thread of its own, so a stranger that connects and stays silent
        cannot hold up the real ranks behind it; pending handshakes are bounded, the oldest pushed out first
        (:class:`~horovod.transport.sockets.PendingHandshakes`), so no number of strangers locks a rank out.
        """
        peers: Dict[int, socket.socket] = {}
        done: "queue.Queue[Tuple[socket.socket, str, Optional[int], Optional[BaseException]]]" = queue.Queue()
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        pending = sockets.PendingHandshakes()
        deadline = time.monotonic() + timeout

        def handshake(conn: socket.socket, who: str, limit: float) -> None:
            try:
                hello = sockets.authenticate_pending(conn, pending, secret, b"", timeout=limit, peer=who)
                done.put((conn, who, int(hello.decode()), None))
            except (PeerError, ValueError, OSError) as exc:
                done.put((conn, who, None, exc))
            try:
                wake_w.send(b"\0")
            except OSError:
                pass   # the coordinator finished (or gave up) meanwhile

        try:
            while len(peers) < size - 1:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(1, size)) - set(peers))
                    for s in peers.values():
                        s.close()
                    raise TimeoutError(
                        f"coordinator waited {timeout:.0f} s for ranks {missing} to connect; they did not start, "
                        f"crashed before hvd.init(), or cannot reach {where}")
                if check is not None:   # an elastic epoch being formed: give up once the driver abandons it
                    try:
                        check()
                    except Exception:
                        for s in peers.values():
                            s.close()
                        raise
                readable, _, _ = select.select(listeners + [wake_r], [], [],
                                               remaining if check is None else min(remaining, 0.25))
                for listener in readable:
                    if listener is wake_r:
                        try:
                            wake_r.recv(4096)
                        except BlockingIOError:
                            pass
                        continue
                    try:
                        conn, addr = listener.accept()
                    except (BlockingIOError, socket.timeout):
                        continue
                    who = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "a local process"
                    sockets.configure(conn)
                    if pending.add(conn) is not None:
                        logger.debug("control plane: pushed out the oldest pending connection (%d so far)",
                                     pending.pushed_out)
                    threading.Thread(target=handshake, args=(conn, who, min(remaining, 10.0)),
                                     name="hvd-control-handshake", daemon=True).start()
                while True:
                    try:
                        conn, who, peer_rank, error = done.get_nowait()
                    except queue.Empty:
                        break
                    if error is None and (peer_rank is None or not (0 < peer_rank < size and peer_rank not in peers)):
                        error = PeerError(f"unexpected rank {peer_rank} from {who}")
                    if error is not None:
                        # A flood pushes out hundreds of strangers: a line each only when debugging.
                        level = logging.DEBUG if isinstance(error, sockets.PushedOut) else logging.WARNING
                        logger.log(level, "control plane: dropped connection from %s: %s", who, error)
                        conn.close()
                        continue
                    try:
                        sockets.admit(conn)
                    except OSError as exc:
                        logger.warning("control plane: rank %d's connection broke as it was admitted: %s",
                                       peer_rank, exc)
                        conn.close()
                        continue
                    conn.settimeout(None)
                    assert peer_rank is not None   # an admitted handshake named its rank
                    peers[peer_rank] = conn
        finally:
            wake_r.close()
            wake_w.close()
        return peers

    # -- messaging ------------------------------------------------------------------------------------
    def send(self, peer: int, message: ControlMessage) -> None:
        self.send_bytes(peer, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, peer: int, payload: bytes) -> None:
        sock = self.peers.get(peer)
        if sock is None:
            raise PeerError(f"no control connection to rank {peer} (it was closed)", peer=peer)
        with self._send_locks[peer]:
            sockets.send_frame(sock, payload, peer=f"rank {peer}")

    def try_send_bytes(self, peer: int, payload: bytes) -> bool:
        """Send ``payload`` unless another thread is sending to ``peer`` right now (then False: its frame is on the
        way, which is what a heartbeat is for; a heartbeat must never wait behind a large message)."""
        sock = self.peers.get(peer)
        lock = self._send_locks.get(peer)
        if sock is None or lock is None:
            raise PeerError(f"no control connection to rank {peer} (it was closed)", peer=peer)
        if not lock.acquire(blocking=False):
            return False
        try:
            sockets.send_frame(sock, payload, peer=f"rank {peer}")
        finally:
            lock.release()
        return True

    def last_heard(self, peer: int) -> float:
        """When (``time.monotonic()``) the last byte from ``peer`` was read, by whatever path read it; 0.0 if never."""
        reader = self._readers.get(peer)
        return 0.0 if reader is None else reader.heard_at

    def broadcast(self, message: ControlMessage) -> List[int]:
        """Send ``message`` to every worker (pickled once); returns the ranks that could not be reached."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return self._send_payloads({peer: payload for peer in self.peers})

    def send_many(self, peers: List[int], message: ControlMessage) -> List[int]:
        """Send ``message`` (pickled once) to each of ``peers``; returns the ranks that could not be reached."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return self._send_payloads({peer: payload for peer in peers})

    def send_each(self, messages: Dict[int, ControlMessage]) -> List[int]:
        """Send each peer its own message; returns the ranks that could not be reached."""
        return self._send_payloads({peer: pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
                                    for peer, message in messages.items()})

    def _send_payloads(self, payloads: Dict[int, bytes]) -> List[int]:
        failed = []
        for peer, payload in payloads.items():
            try:
                self.send_bytes(peer, payload)
            except PeerError:
                failed.append(peer)
        return failed

    def receive(self, peer: int) -> List[ControlMessage]:
        """Every complete message ``peer`` has sent so far (call when its socket is readable).

        Raises:
            PeerError: the peer closed the connection or the stream is corrupt.
        """
        return [pickle.loads(frame) for frame in self._readers[peer].read_available()]

    def drop(self, peer: int) -> None:
        sock = self.peers.pop(peer, None)
        self._readers.pop(peer, None)
        sockets.maybe_close(sock)

    def close(self) -> None:
        for peer in list(self.peers):
            self.drop(peer)
        sockets.maybe_close(self._listener)


def _machine_id() -> str:
    """Identifies this machine (boot id; the host name where there is none)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _listen_local() -> Optional[socket.socket]:
    """A listening Unix socket in the abstract namespace (Linux), or ``None`` where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(b"\0horovod-ctl-" + secrets.token_hex(12).encode())
        sock.listen(128)
    except OSError:
        sock.close()
        return None
    return sock


def _connect_local(published: Optional[bytes], timeout: float) -> Optional[socket.socket]:
    """Connect to the coordinator's Unix socket when it runs on this machine, else ``None`` (use TCP).

    A rank in another network namespace of the same machine cannot see the socket; it falls back to TCP too.
    """
    if not published:
        return None
    machine, _, name = published.decode().partition("|")
    if machine != _machine_id() or not sys.platform.startswith("linux"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(b"\0" + name.encode())
    except OSError:
        sock.close()
        return None
    return sockets.configure(sock)


class FrameReader:
    """Reads length-prefixed frames from a socket without blocking for more than what has arrived.

    One ``recv`` drains whatever the kernel holds, so a burst of requests costs one system call, not two per
    frame.  A partial frame stays buffered until the rest arrives.
    """

    _LEN = struct.Struct("<Q")
    _CHUNK = 64 * 1024

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self._buf = bytearray()
        self.heard_at = 0.0   # when a byte last arrived (liveness: every byte from the peer counts as life)
        # recv_into a reused buffer: ``recv(n)`` would allocate (and map) n bytes on every call.
        self._chunk = bytearray(self._CHUNK)
        self._view = memoryview(self._chunk)

    def read_available(self) -> List[bytes]:
        frames = []
        while True:
            try:
                n = self.sock.recv_into(self._view, self._CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise PeerError(f"control connection to {self.peer} failed: {exc}", peer=self.peer) from exc
            if not n:
                # Only what was seen: the runtime's message (the one users read) says who closed it and why that
                # matters; saying it here too printed the same sentence twice.
                raise PeerError(f"end of stream from {self.peer} (recv returned no bytes)", peer=self.peer)
            self._buf += self._view[:n]
            self.heard_at = time.monotonic()
            if n < self._CHUNK:
                break
        header = self._LEN.size
        buf = self._buf
        start = 0
        while len(buf) - start >= header:
            (n,) = self._LEN.unpack_from(buf, start)
            if len(buf) - start < header + n:
                break
            frames.append(bytes(buf[start + header:start + header + n]))
            start += header + n
        if start:
            del buf[:start]
        return frames
