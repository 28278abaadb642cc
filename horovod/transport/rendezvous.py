"""Authenticated key-value store the launcher serves and the workers use to find each other.

``PUT /<scope>/<key>`` stores bytes, ``GET`` returns them (404 when absent), ``DELETE`` removes them, over plain
HTTP/1.1 with keep-alive. Values are opaque bytes: the server never unpickles anything.

Every request is signed: ``X-Horovod-Auth`` is an HMAC of the job secret over the method, the path, a timestamp, a
random nonce, the body's length and its SHA-256 (sent in ``X-Horovod-Body``). The server is built to be cheap to
attack and hard to fool, because on a multi-host job it listens on the job's network:

* it checks the signature from the headers alone, *before* reading any body, and refuses bodies over
  :data:`MAX_BODY_BYTES`; the body must then match the signed hash;
* a nonce is accepted once within the timestamp window, so a captured request cannot be replayed;
* it runs on one asyncio event loop: an idle connection costs a few kilobytes, not a thread; a connection must
  send its first request within :data:`HEADER_TIMEOUT_S` and may idle :data:`IDLE_TIMEOUT_S` between requests; at
  :data:`MAX_CONNECTIONS` the oldest connection that has not yet made a signed request is dropped, never a
  worker's;
* refusals are logged once, then summarised at most every :data:`LOG_EVERY_S` seconds.

A worker started with another job's secret (or a corrupted one) cannot join, and the ranks waiting for it would
only see it missing.  So a refused request that carries the Horovod headers and the rank its sender claims
(``X-Horovod-Rank``) is noted under the reserved scope :data:`AUTH_FAILURES_SCOPE`, and the waiting ranks' timeout
errors say "rank N failed to authenticate".  The claim is unauthenticated by nature: it only ever adds words to
an error, it never fails or shortens anybody's wait (a local user could otherwise break any job's start).
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import http.client
import json
import logging
import os
import secrets as _secrets
import socket
import threading
import time
from typing import Dict, Optional, Tuple

logger = logging.getLogger(__name__)

_AUTH = "X-Horovod-Auth"
_STAMP = "X-Horovod-Time"
_NONCE = "X-Horovod-Nonce"
_BODY = "X-Horovod-Body"
_RANK = "X-Horovod-Rank"
#: Where refused requests' claimed ranks are noted (``str(rank)`` → ``"<address>|<unix time>"``).
AUTH_FAILURES_SCOPE = "_auth_failures"
#: Ranks noted at most (claims are unauthenticated: a flood of them must stay small).
MAX_AUTH_FAILURES = 64
_AUTH_NOTES_KEY = (AUTH_FAILURES_SCOPE, "notes")   # JSON {rank: sender's address}
_MAX_SKEW_S = 300.0
#: Largest value a signed request may store (results of ``horovod.run`` travel through the store).
MAX_BODY_BYTES = 512 << 20
#: Request line and headers, at most.
MAX_HEADER_BYTES = 16 << 10
#: Seconds a new connection has to send its first request's headers.
HEADER_TIMEOUT_S = 5.0
#: Seconds a connection may idle between requests (workers keep theirs open), and to send a body.
IDLE_TIMEOUT_S = 60.0
#: Open connections at most; beyond it the oldest one that has not made a signed request goes.
MAX_CONNECTIONS = 4096
#: Connections the kernel queues before the event loop accepts them (a flood must not make a worker wait).
LISTEN_BACKLOG = 1024
LOG_EVERY_S = 10.0

_REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 413: "Payload Too Large"}


def _sign(secret: bytes, method: str, path: str, stamp: str, nonce: str, length: int, body_hash: str) -> str:
    msg = "\n".join([method, path, stamp, nonce, str(length), body_hash]).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


class _Refusals:
    """Logs the first refusal, then one summary per :data:`LOG_EVERY_S` (a flood must not flood the log)."""

    def __init__(self) -> None:
        self.count = 0
        self._since_log = 0
        self._last_log = 0.0

    def note(self, what: str, peer: str) -> None:
        self.count += 1
        self._since_log += 1
        now = time.monotonic()
        if self.count == 1 or now - self._last_log >= LOG_EVERY_S:
            logger.warning("rendezvous: refused %d request(s)%s; latest: %s from %s",
                           self._since_log, "" if self.count == 1 else f" in the last {LOG_EVERY_S:.0f} s", what,
                           peer)
            self._since_log, self._last_log = 0, now
        else:
            logger.debug("rendezvous: refused %s from %s", what, peer)


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
    """The driver's key-value store (see the module docstring for how it defends itself).

    Args:
        secret: the job secret every request must be signed with.
        host: the address to bind; ``127.0.0.1`` for single-host jobs, the job's interface otherwise.
    """

    def __init__(self, secret: bytes, host: str = "127.0.0.1"):
        self.store = MemoryStore()
        self.secret = secret
        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, 0), family=family, backlog=LISTEN_BACKLOG)
        self.port = self._sock.getsockname()[1]
        self.refusals = _Refusals()
        self._nonces: Dict[str, float] = {}
        self._auth_notes: Dict[int, str] = {}
        self._unproven: "collections.OrderedDict[asyncio.StreamWriter, None]" = collections.OrderedDict()
        self._open = 0
        self._writers: "set[asyncio.StreamWriter]" = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hvd-rendezvous", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> "RendezvousServer":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the rendezvous server did not start within 30 s")
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._sock.close()

    def __enter__(self) -> "RendezvousServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        # start_server listens again on the socket it is given, with its own default backlog (100) unless told.
        server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, sock=self._sock, limit=MAX_HEADER_BYTES,
                                 backlog=LISTEN_BACKLOG))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            # Hang up every connection and let its handler finish by itself (cancelling handlers trips a bug of
            # Python 3.11's asyncio streams, which then logs a traceback per connection).
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = list(asyncio.all_tasks(self._loop))
            if tasks:
                self._loop.run_until_complete(asyncio.wait(tasks, timeout=5))
            self._loop.close()

    # -- one connection -------------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str((writer.get_extra_info("peername") or ("?",))[0])
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._open += 1
        self._writers.add(writer)
        self._unproven[writer] = None
        if self._open > MAX_CONNECTIONS:
            oldest = next(iter(self._unproven))
            self._unproven.pop(oldest)
            oldest.close()
            self.refusals.note("a connection (too many open; dropped the oldest unauthenticated one)", peer)
        try:
            timeout = HEADER_TIMEOUT_S
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
                except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                        ConnectionError):
                    return
                if not await self._request(head, reader, writer, peer):
                    return
                self._unproven.pop(writer, None)
                timeout = IDLE_TIMEOUT_S
        finally:
            self._open -= 1
            self._writers.discard(writer)
            self._unproven.pop(writer, None)
            writer.close()

    async def _request(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       peer: str) -> bool:
        """Serve one request; False when the connection must be closed."""
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, path, _version = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if line:
                    name, _, text = line.partition(":")
                    headers[name.strip().lower()] = text.strip()
            length = int(headers.get("content-length", "0"))
        except ValueError:
            self.refusals.note("a malformed request", peer)
            await self._reply(writer, 400, b"malformed request")
            return False
        if not self._signed(method, path, headers, length):
            self.refusals.note(f"an unauthenticated {method} {path[:64]}", peer)
            self._note_auth_failure(headers, peer)
            await self._reply(writer, 403, b"forbidden: request not signed with this job's secret")
            return False
        if length > MAX_BODY_BYTES:
            await self._reply(writer, 413, f"a value may hold at most {MAX_BODY_BYTES} bytes".encode())
            return False
        try:
            body = await asyncio.wait_for(reader.readexactly(length), IDLE_TIMEOUT_S) if length else b""
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return False
        if hashlib.sha256(body).hexdigest() != headers.get(_BODY.lower()):
            self.refusals.note("a body that does not match its signed hash", peer)
            await self._reply(writer, 400, b"body does not match its signed hash")
            return False
        parts = path.lstrip("/").split("/", 1)
        if len(parts) != 2 or not parts[0] or not parts[1]:
            await self._reply(writer, 400, b"path must be /<scope>/<key>")
            return True
        key = (parts[0], parts[1])
        if method == "GET":
            value = self.store.get(key)
            await self._reply(writer, 404 if value is None else 200, value or b"")
        elif method == "PUT":
            self.store.put(key, body)
            await self._reply(writer, 200)
        elif method == "DELETE":
            self.store.delete(key)
            await self._reply(writer, 200)
        else:
            await self._reply(writer, 400, b"method must be GET, PUT or DELETE")
        return True

    def _note_auth_failure(self, headers: Dict[str, str], peer: str) -> None:
        """Remember the rank a refused Horovod client claims to be (see the module docstring)."""
        if _AUTH.lower() not in headers:
            return   # not a Horovod client with a wrong secret: a stray or hostile request
        try:
            rank = int(headers.get(_RANK.lower(), ""))
        except ValueError:
            return
        if not 0 <= rank < 1 << 20 or (rank not in self._auth_notes and len(self._auth_notes) >= MAX_AUTH_FAILURES):
            return
        self._auth_notes[rank] = peer
        self.store.put(_AUTH_NOTES_KEY, json.dumps({str(r): p for r, p in self._auth_notes.items()}).encode())

    def _signed(self, method: str, path: str, headers: Dict[str, str], length: int) -> bool:
        stamp, nonce = headers.get(_STAMP.lower(), ""), headers.get(_NONCE.lower(), "")
        try:
            sent = float(stamp)
        except ValueError:
            return False
        now = time.time()
        if abs(now - sent) >= _MAX_SKEW_S or not nonce or nonce in self._nonces:
            return False
        expected = _sign(self.secret, method, path, stamp, nonce, length, headers.get(_BODY.lower(), ""))
        if not hmac.compare_digest(expected, headers.get(_AUTH.lower(), "")):
            return False
        self._nonces[nonce] = sent
        if len(self._nonces) > 50_000:   # forget nonces whose timestamps can no longer pass the window
            self._nonces = {n: t for n, t in self._nonces.items() if abs(now - t) < _MAX_SKEW_S}
        return True

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, code: int, body: bytes = b"") -> None:
        writer.write(f"HTTP/1.1 {code} {_REASONS[code]}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            await writer.drain()
        except ConnectionError:
            pass


class RendezvousClient:
    """Signed HTTP client of :class:`RendezvousServer`.

    Args:
        addr, port: where the driver's store listens.
        secret: the job secret.
        timeout: default seconds :meth:`get` waits for a key to appear.
    """

    def __init__(self, addr: str, port: int, secret: bytes, timeout: float = 30.0, rank: Optional[int] = None):
        self.addr, self.port, self.secret, self.timeout = addr, port, secret, timeout
        # Named in the server's note should our secret be refused (every launcher sets HOROVOD_RANK).
        if rank is None and os.environ.get("HOROVOD_RANK", "").isdigit():
            rank = int(os.environ["HOROVOD_RANK"])
        self.rank = rank
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
        body_hash = hashlib.sha256(body).hexdigest()
        last_exc: Optional[Exception] = None
        for _ in range(3):
            stamp, nonce = repr(time.time()), _secrets.token_hex(16)   # a fresh nonce per attempt
            headers = {_STAMP: stamp, _NONCE: nonce, _BODY: body_hash, "Content-Length": str(len(body)),
                       _AUTH: _sign(self.secret, method, path, stamp, nonce, len(body), body_hash)}
            if self.rank is not None:
                headers[_RANK] = str(self.rank)
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
                who = "this process" if self.rank is None else f"rank {self.rank}"
                raise PermissionError(
                    f"{who} failed to authenticate (wrong or missing job secret): the rendezvous server at "
                    f"{self.addr}:{self.port} rejected it ({data.decode(errors='replace')}); start every worker "
                    f"of a job with the same _HOROVOD_SECRET_KEY (horovodrun does)")
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
                    f"another rank did not start or did not reach init() (raise --start-timeout if it is slow)"
                    f"{auth_failure_note(self)}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def delete(self, scope: str, key: str) -> None:
        self._request("DELETE", scope, key)


def auth_failure_note(store) -> str:
    """``"; rank N failed to authenticate (wrong or missing job secret) ..."`` for every rank the server noted
    (empty when none, or when the store cannot tell): for the timeout errors of ranks waiting for others.

    Args:
        store: the server's :class:`MemoryStore` or a :class:`RendezvousClient`.
    """
    try:
        raw = store.get(_AUTH_NOTES_KEY) if isinstance(store, MemoryStore) else store.try_get(*_AUTH_NOTES_KEY)
        notes = json.loads(raw.decode()) if raw else {}
    except (OSError, ValueError, PermissionError, AttributeError):
        return ""
    parts = [f"rank {rank} failed to authenticate (wrong or missing job secret; its requests came from {peer})"
             for rank, peer in sorted(notes.items(), key=lambda kv: int(kv[0]))]
    return "; " + "; ".join(parts) if parts else ""
