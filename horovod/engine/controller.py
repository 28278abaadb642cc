"""The control plane: a star of authenticated connections between the coordinator (rank 0) and every rank.

Requests go up, planned responses come down, as pickled :class:`ControlMessage` frames.  Pickle is safe here
because each connection is authenticated with the job secret before the first frame is read.  The control
plane is separate from the data plane so that a request arriving mid-collective can never be mistaken for data.
"""
from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
import time
from typing import Dict, List

from horovod.engine.messages import ControlMessage
from horovod.transport import sockets
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

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

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
            store.put(scope, "coordinator", f"{host}:{port}".encode())
            peers: Dict[int, socket.socket] = {}
            deadline = time.monotonic() + timeout
            while len(peers) < size - 1:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(1, size)) - set(peers))
                    listener.close()
                    for s in peers.values():
                        s.close()
                    raise TimeoutError(
                        f"coordinator waited {timeout:.0f} s for ranks {missing} to connect; they did not start, "
                        f"crashed before hvd.init(), or cannot reach {host}:{port}")
                listener.settimeout(remaining)
                try:
                    conn, addr = listener.accept()
                except socket.timeout:
                    continue
                sockets.configure(conn)
                try:
                    hello = sockets.authenticate(conn, secret, initiator=False, timeout=min(remaining, 10.0),
                                                 peer=f"{addr[0]}:{addr[1]}")
                    peer_rank = int(hello.decode())
                    if not 0 < peer_rank < size or peer_rank in peers:
                        raise PeerError(f"unexpected rank {peer_rank} from {addr}")
                except (PeerError, ValueError) as exc:
                    logger.warning("control plane: dropped connection from %s: %s", addr[0], exc)
                    conn.close()
                    continue
                conn.settimeout(None)
                peers[peer_rank] = conn
            listener.close()
            return cls(rank, size, peers)
        value = store.get(scope, "coordinator", timeout=timeout).decode()
        host, port = sockets.parse_hostport(value)
        conn = sockets.connect(host, port, timeout, what="the coordinator (rank 0)")
        sockets.authenticate(conn, secret, initiator=True, hello=str(rank).encode(), timeout=timeout,
                             peer="the coordinator (rank 0)")
        conn.settimeout(None)
        return cls(rank, size, {0: conn})

    # -- messaging ------------------------------------------------------------------------------------
    def send(self, peer: int, message: ControlMessage) -> None:
        self.send_bytes(peer, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, peer: int, payload: bytes) -> None:
        sock = self.peers.get(peer)
        if sock is None:
            raise PeerError(f"no control connection to rank {peer} (it was closed)", peer=peer)
        with self._send_locks[peer]:
            sockets.send_frame(sock, payload, peer=f"rank {peer}")

    def broadcast(self, message: ControlMessage) -> List[int]:
        """Send ``message`` to every worker; returns the ranks that could not be reached."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        failed = []
        for peer in list(self.peers):
            try:
                self.send_bytes(peer, payload)
            except PeerError:
                failed.append(peer)
        return failed

    def send_each(self, messages: Dict[int, ControlMessage]) -> List[int]:
        """Send each peer its own message; returns the ranks that could not be reached."""
        failed = []
        for peer, message in messages.items():
            try:
                self.send(peer, message)
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
                raise PeerError(f"{self.peer} closed the control connection (the process exited or crashed)",
                                peer=self.peer)
            self._buf += self._view[:n]
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
