"""The rendezvous store under attack: unsigned, oversized, replayed and idle connections (real sockets, loopback)."""
from __future__ import annotations

import hashlib
import logging
import resource
import secrets
import socket
import threading
import time

import pytest

from horovod.transport import rendezvous
from horovod.transport.rendezvous import RendezvousClient, RendezvousServer

SECRET = b"s" * 32


@pytest.fixture
def server():
    with RendezvousServer(SECRET) as srv:
        yield srv


def _raw(srv, data: bytes, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(data)
        return sock.recv(65536) if read else b""


def _signed_request(method: str, path: str, body: bytes, nonce: str = None) -> bytes:
    stamp, nonce = repr(time.time()), nonce or secrets.token_hex(16)
    digest = hashlib.sha256(body).hexdigest()
    auth = rendezvous._sign(SECRET, method, path, stamp, nonce, len(body), digest)
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nX-Horovod-Time: {stamp}\r\nX-Horovod-Nonce: {nonce}\r\n"
            f"X-Horovod-Body: {digest}\r\nX-Horovod-Auth: {auth}\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_unsigned_request_is_refused_before_its_body_is_read(server):
    # Declares 1 GiB and sends none of it: the refusal must come from the headers alone.
    reply = _raw(server, b"PUT /s/k HTTP/1.1\r\nContent-Length: 1073741824\r\nX-Horovod-Time: 1\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 403"), reply
    assert server.store.get(("s", "k")) is None


def test_signed_request_over_the_size_cap_is_refused(server, monkeypatch):
    monkeypatch.setattr(rendezvous, "MAX_BODY_BYTES", 1024)
    reply = _raw(server, _signed_request("PUT", "/s/big", b"x" * 2048)[:-2048])  # headers only
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert server.store.get(("s", "big")) is None


def test_body_must_match_its_signed_hash(server):
    request = _signed_request("PUT", "/s/k", b"good")
    reply = _raw(server, request[:-4] + b"evil")
    assert reply.startswith(b"HTTP/1.1 400"), reply
    assert server.store.get(("s", "k")) is None


def test_a_replayed_request_is_refused(server):
    request = _signed_request("PUT", "/s/k", b"v1")
    assert _raw(server, request).startswith(b"HTTP/1.1 200")
    server.store.delete(("s", "k"))
    assert _raw(server, request).startswith(b"HTTP/1.1 403")   # same nonce: a replay
    assert server.store.get(("s", "k")) is None


def test_the_client_round_trips_through_the_hardened_server(server):
    client = RendezvousClient("127.0.0.1", server.port, SECRET)
    client.put("scope", "a/b:c", b"\x00value")
    assert client.get("scope", "a/b:c") == b"\x00value"
    assert client.try_get("scope", "missing") is None
    client.delete("scope", "a/b:c")
    assert client.try_get("scope", "a/b:c") is None
    with pytest.raises(PermissionError):
        RendezvousClient("127.0.0.1", server.port, b"wrong-secret").put("scope", "x", b"y")


def test_silent_connections_are_dropped_after_the_header_timeout(server, monkeypatch):
    monkeypatch.setattr(rendezvous, "HEADER_TIMEOUT_S", 0.3)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        assert sock.recv(1) == b""   # the server closed it (recv would time out after 10 s otherwise)


def test_a_thousand_hostile_connections_cost_little_and_do_not_delay_a_worker(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    client = RendezvousClient("127.0.0.1", server.port, SECRET)
    client.put("warm", "up", b"1")   # the loop, the store and the client exist before the baseline
    threads, rss = threading.active_count(), _rss_kib()
    hostile = []
    try:
        for i in range(1000):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            if i % 2:
                sock.sendall(b"PUT /s/k HTTP/1.1\r\nContent-Length: 1073741824\r\n")   # headers never finish
            hostile.append(sock)
        time.sleep(0.5)   # let the server accept them all
        start = time.monotonic()
        client.put("job", "addr", b"10.0.0.1:1234")
        assert client.get("job", "addr") == b"10.0.0.1:1234"
        elapsed = time.monotonic() - start
        grown_mib = (_rss_kib() - rss) / 1024
        assert threading.active_count() == threads, "connections must not cost threads"
        assert grown_mib < 20, f"1,000 idle connections grew the process by {grown_mib:.1f} MiB"
        assert elapsed < 1.0, f"a worker's put+get took {elapsed:.2f} s beside 1,000 hostile connections"
    finally:
        for sock in hostile:
            sock.close()


def test_refusals_are_logged_once_then_summarised(server, caplog):
    with caplog.at_level(logging.DEBUG, logger="horovod.transport.rendezvous"):
        for _ in range(50):
            _raw(server, b"GET /s/k HTTP/1.1\r\n\r\n")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]
    assert server.refusals.count == 50


def _listen_backlog(port: int) -> int:
    """The accept queue's limit of the listening socket on ``port``, as the kernel reports it (``ss``'s Send-Q)."""
    import shutil
    import subprocess
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to read a listening socket's backlog")
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    fields = out.split()
    assert fields, f"ss does not list a listening socket on port {port}: {out!r}"
    return int(fields[2])


def test_the_listen_backlog_is_the_one_asked_for_not_asyncios_default(server):
    # asyncio.start_server(sock=...) calls listen() again; with its default the queue would be 100.
    assert _listen_backlog(server.port) == min(rendezvous.LISTEN_BACKLOG, _somaxconn())


def _somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn") as f:
        return int(f.read())


def _init_only():
    import horovod.numpy as hvd

    hvd.init()
    hvd.shutdown()
    return "joined"


@pytest.mark.parametrize("wrong_rank", [1, 0], ids=["a-worker", "rank-0"])
def test_a_rank_with_another_jobs_secret_is_named_in_the_others_errors(wrong_rank):
    """Outside horovodrun nobody stops the job when one worker holds the wrong secret: the others wait their
    init timeout, and their error must say which rank failed to authenticate, and how."""
    from multiproc import run_ranks

    out = run_ranks(_init_only, 3, expect_failure=True, timeout=60,
                    env={"HOROVOD_INIT_TIMEOUT_SECONDS": "4", "HOROVOD_GLOO_TIMEOUT_SECONDS": "4"},
                    rank_env_overrides={wrong_rank: {"_HOROVOD_SECRET_KEY": secrets.token_bytes(16).hex()}})
    wrong = out[wrong_rank]
    assert wrong.status == "error", wrong
    assert f"rank {wrong_rank} failed to authenticate (wrong or missing job secret)" in wrong.error["message"], \
        wrong.error["message"]
    for o in out:
        if o.rank == wrong_rank:
            continue
        assert o.status == "error", o
        assert f"rank {wrong_rank} failed to authenticate (wrong or missing job secret" in o.error["message"], \
            f"rank {o.rank}: {o.error['message']}"


def test_an_unsigned_claim_only_adds_words_and_never_more_than_the_bound(server):
    # A request without the Horovod headers is a stray, not a worker with the wrong secret: not noted.
    _raw(server, b"GET /s/k HTTP/1.1\r\nX-Horovod-Rank: 999\r\n\r\n")
    assert rendezvous.auth_failure_note(server.store) == ""
    for rank in range(rendezvous.MAX_AUTH_FAILURES + 10):
        _raw(server, (f"GET /s/k HTTP/1.1\r\nX-Horovod-Auth: forged\r\nX-Horovod-Rank: {rank}\r\n"
                      f"Content-Length: 0\r\n\r\n").encode())
    note = rendezvous.auth_failure_note(server.store)
    assert note.count("failed to authenticate") == rendezvous.MAX_AUTH_FAILURES, note[:300]
