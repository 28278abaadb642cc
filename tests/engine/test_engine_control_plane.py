"""The control plane's connections: a Unix socket between ranks of one machine, authenticated like TCP.

Ranks in separate network namespaces (separate "hosts" on this machine) cannot reach the coordinator's Unix
socket and fall back to TCP; the multi-host runner tests cover that path.
"""
from __future__ import annotations

import socket
import threading

import pytest

from engine_helpers import run
from horovod.engine import controller
from horovod.transport import sockets

pytestmark = pytest.mark.skipif(controller._listen_local() is None, reason="no abstract Unix sockets here")


def _connect(listener: socket.socket) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(listener.getsockname())
    return conn


def test_a_local_stranger_is_dropped_and_the_rank_with_the_secret_admitted():
    listener = controller._listen_local()
    result = {}

    def accept():
        result["peers"] = controller.ControlPlane._accept_all(2, [listener], b"job-secret", 20.0, "here")

    thread = threading.Thread(target=accept)
    thread.start()
    stranger = _connect(listener)
    with pytest.raises(sockets.PeerError):
        sockets.authenticate(stranger, b"another-secret", initiator=True, hello=b"1", timeout=10.0)
    rank = _connect(listener)
    sockets.authenticate(rank, b"job-secret", initiator=True, hello=b"1", timeout=10.0)
    thread.join(20.0)
    listener.close()
    assert set(result["peers"]) == {1}
    for s in (stranger, rank, *result["peers"].values()):
        s.close()


def test_silent_connections_do_not_hold_up_the_ranks():
    """Handshakes run side by side: 8 strangers that connect and say nothing (4 over TCP, 4 over the Unix socket)
    must not make the real ranks wait for their 10 s handshake windows one after another (80 s serially)."""
    local = controller._listen_local()
    tcp = sockets.listen("127.0.0.1")
    result = {}

    def accept():
        result["peers"] = controller.ControlPlane._accept_all(3, [tcp, local], b"job-secret", 60.0, "here")

    silent = [_connect(local) for _ in range(4)] + [socket.create_connection(tcp.getsockname()) for _ in range(4)]
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    ranks = []
    for rank, listener in ((1, local), (2, tcp)):
        conn = _connect(listener) if listener is local else socket.create_connection(tcp.getsockname())
        sockets.authenticate(conn, b"job-secret", initiator=True, hello=str(rank).encode(), timeout=10.0)
        ranks.append(conn)
    thread.join(8.0)   # well inside the strangers' 10 s windows: nobody waited for them
    try:
        assert not thread.is_alive(), "the coordinator waited for silent connections before admitting the ranks"
        assert set(result["peers"]) == {1, 2}
    finally:
        for s in (*silent, *ranks, *result.get("peers", {}).values(), local, tcp):
            s.close()


def families_worker() -> list:
    import horovod.numpy as hvd
    from horovod.common import basics

    hvd.init()
    families = [sock.family.name for sock in basics.runtime().control.peers.values()]
    hvd.shutdown()
    return families


def test_ranks_on_one_machine_talk_to_the_coordinator_over_unix_sockets():
    results = run(families_worker, 3, "tcp")
    assert results[0] == ["AF_UNIX", "AF_UNIX"] and results[1] == results[2] == ["AF_UNIX"], results
