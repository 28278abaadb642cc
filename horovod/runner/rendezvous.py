"""Authenticated key-value store the launcher serves and the workers use to find each other.

A plain HTTP server on the driver: ``PUT /<scope>/<key>`` stores bytes, ``GET`` returns them (404 when
absent), ``DELETE`` removes them.  Every request carries ``X-Horovod-Auth``, an HMAC of the job secret over
method, path, a timestamp and the body, so a process without the secret can neither read nor write.  Values
are opaque bytes: the server never unpickles anything.
"""
from __future__ import annotations

import hashlib
import hmac
import http.client
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Optional, Tuple

logger = logging.getLogger(__name__)

_AUTH = "X-Horovod-Auth"
_STAMP = "X-Horovod-Time"
_MAX_SKEW_S = 300.0


def _sign(secret: bytes, method: str, path: str, stamp: str, body: bytes) -> str:
    msg = b"\n".join([method.encode(), path.encode(), stamp.encode(), hashlib.sha256(body).digest()])
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        # Headers and body leave in separate writes: without NODELAY each request waits on delayed ACKs.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):  # requests are operator noise, not user output
        logger.debug("rendezvous %s: " + fmt, self.address_string(), *args)

    def _authorised(self, body: bytes) -> bool:
        stamp = self.headers.get(_STAMP, "")
        given = self.headers.get(_AUTH, "")
        try:
            fresh = abs(time.time() - float(stamp)) < _MAX_SKEW_S
        except ValueError:
            fresh = False
        expected = _sign(self.server.secret, self.command, self.path, stamp, body)
        if fresh and hmac.compare_digest(expected, given):
            return True
        logger.warning("rendezvous: rejected unauthenticated %s %s from %s", self.command, self.path,
                       self.client_address[0])
        self._reply(403, b"forbidden: request not signed with this job's secret")
        return False

    def _reply(self, code: int, body: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _key(self) -> Optional[Tuple[str, str]]:
        parts = self.path.lstrip("/").split("/", 1)
        if len(parts) != 2 or not parts[0] or not parts[1]:
            self._reply(400, b"path must be /<scope>/<key>")
            return None
        return parts[0], parts[1]

    def do_GET(self):  # noqa: N802 (http.server naming)
        if not self._authorised(b""):
            return
        key = self._key()
        if key is None:
            return
        value = self.server.store.get(key)
        if value is None:
            self._reply(404)
        else:
            self._reply(200, value)

    def do_PUT(self):  # noqa: N802
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length) if length else b""
        if not self._authorised(body):
            return
        key = self._key()
        if key is None:
            return
        self.server.store.put(key, body)
        self._reply(200)

    def do_DELETE(self):  # noqa: N802
        if not self._authorised(b""):
            return
        key = self._key()
        if key is None:
            return
        self.server.store.delete(key)
        self._reply(200)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    secret: bytes
    store: "MemoryStore"

    def handle_error(self, request, client_address):
        # A worker killed mid-request resets its connection: routine in elastic jobs, not worth a traceback.
        logger.debug("rendezvous: request from %s failed", client_address, exc_info=True)


class MemoryStore:
    """A thread-safe dict of ``(scope, key) -> bytes`` with change notification."""

    def __init__(self) -> None:
        self._data: Dict[Tuple[str, str], bytes] = {}
        self._cond = threading.Condition()

    def put(self, key: Tuple[str, str], value: bytes) -> None:
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: Tuple[str, str]) -> Optional[bytes]:
        with self._cond:
            return self._data.get(key)

    def delete(self, key: Tuple[str, str]) -> None:
        with self._cond:
            self._data.pop(key, None)

    def scope(self, scope: str) -> Dict[str, bytes]:
        with self._cond:
            return {k: v for (s, k), v in self._data.items() if s == scope}

    def clear_scope(self, scope: str) -> None:
        with self._cond:
            for key in [k for k in self._data if k[0] == scope]:
                del self._data[key]


class RendezvousServer:
    """The driver's key-value store.

    Args:
        secret: the job secret every request must be signed with.
        host: the address to bind; ``127.0.0.1`` for single-host jobs, the job's interface otherwise.
    """

    def __init__(self, secret: bytes, host: str = "127.0.0.1"):
        self.store = MemoryStore()
        self._httpd = _Server((host, 0), _Handler)
        self._httpd.secret = secret
        self._httpd.store = self.store
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hvd-rendezvous", daemon=True)

    def start(self) -> "RendezvousServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "RendezvousServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RendezvousClient:
    """Signed HTTP client of :class:`RendezvousServer`.

    Args:
        addr, port: where the driver's store listens.
        secret: the job secret.
        timeout: default seconds :meth:`get` waits for a key to appear.
    """

    def __init__(self, addr: str, port: int, secret: bytes, timeout: float = 30.0):
        self.addr, self.port, self.secret, self.timeout = addr, port, secret, timeout
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.addr, self.port, timeout=self.timeout)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
        return conn

    def _request(self, method: str, scope: str, key: str, body: bytes = b"") -> Tuple[int, bytes]:
        path = f"/{scope}/{key}"
        stamp = repr(time.time())
        headers = {_STAMP: stamp, _AUTH: _sign(self.secret, method, path, stamp, body),
                   "Content-Length": str(len(body))}
        last_exc: Optional[Exception] = None
        for _ in range(3):
            try:
                conn = self._conn()
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                last_exc = exc
                if getattr(self._local, "conn", None) is not None:
                    self._local.conn.close()
                self._local.conn = None
                time.sleep(0.05)
                continue
            if resp.status == 403:
                raise PermissionError(
                    f"rendezvous server at {self.addr}:{self.port} rejected this process: it was not "
                    f"started with this job's secret ({data.decode(errors='replace')})")
            return resp.status, data
        raise ConnectionError(
            f"cannot reach the rendezvous server at {self.addr}:{self.port} ({last_exc}); the launcher may have "
            f"exited, or this host cannot route to it (see --network-interfaces)") from last_exc

    def put(self, scope: str, key: str, value: bytes) -> None:
        """Store ``value`` under ``scope/key``."""
        status, data = self._request("PUT", scope, key, value)
        if status != 200:
            raise ConnectionError(f"rendezvous PUT {scope}/{key} failed: HTTP {status} {data!r}")

    def try_get(self, scope: str, key: str) -> Optional[bytes]:
        """The value under ``scope/key``, or ``None`` when absent."""
        status, data = self._request("GET", scope, key)
        if status == 404:
            return None
        if status != 200:
            raise ConnectionError(f"rendezvous GET {scope}/{key} failed: HTTP {status} {data!r}")
        return data

    def get(self, scope: str, key: str, timeout: Optional[float] = None) -> bytes:
        """Wait until ``scope/key`` exists and return it.

        Raises:
            TimeoutError: the key did not appear within ``timeout`` seconds; the message names it.
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            value = self.try_get(scope, key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {timeout:.0f} s for '{scope}/{key}' at the rendezvous server {self.addr}:{self.port}; "
                    f"another rank did not start or did not reach init() (raise --start-timeout if it is slow)")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def delete(self, scope: str, key: str) -> None:
        self._request("DELETE", scope, key)
