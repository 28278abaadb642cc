"""hvd.init() while a local process floods rank 0's listening ports with silent connections (real ranks, real sockets).

Any local user can read a job's listening ports from /proc/net/tcp and connect without the secret.  However many
such connections there are, the real ranks must still connect: pending handshakes are bounded and the oldest is
pushed out, never an authenticated peer, and a rank pushed out mid-handshake dials again.
"""
from __future__ import annotations

import resource
import socket
import time

import pytest

from horovod.transport import sockets
from multiproc import run_ranks

STRANGERS = 300   # far over the pending-handshake bound (sockets.MAX_PENDING_HANDSHAKES)


def _init_and_allreduce():
    import numpy as np

    import horovod.numpy as hvd

    start = time.monotonic()
    hvd.init()
    out = hvd.allreduce(np.full(4, hvd.rank() + 1, np.float32), op=hvd.Sum, name="after-flood")
    took = time.monotonic() - start
    hvd.shutdown()
    return [float(v) for v in out], took


def _wait_for_key(store, key: str, scope_suffix: str = "", timeout: float = 30.0):
    """The first ``(scope, value)`` in the rendezvous store under ``key`` (in a scope ending with ``scope_suffix``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for (scope, k), value in list(store._data.items()):
            if k == key and scope.endswith(scope_suffix):
                return scope, value
        time.sleep(0.01)
    raise AssertionError(f"no rank published '{key}' within {timeout} s")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_hundreds_of_silent_connections_to_rank_0_do_not_push_out_rank_1(transport):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * STRANGERS:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8 * STRANGERS), hard))
    planted = []

    def flood(job):
        # Rank 1 is held before hvd.init(); rank 0 publishes its control-plane address and waits for it.
        _, value = _wait_for_key(job.server.store, "coordinator")
        host, port = sockets.parse_hostport(value.decode())
        for _ in range(STRANGERS):
            planted.append(socket.create_connection((host, port), timeout=10))
        if transport == "tcp":
            # The data plane's listener too (rank 0 publishes it once the control plane formed, so only after
            # rank 1 joined): flood it from a thread while the ranks connect.
            import threading

            def flood_data_plane():
                try:
                    _, addr = _wait_for_key(job.server.store, "0", "-tcp")
                except AssertionError:
                    return
                h, p = sockets.parse_hostport(addr.decode())
                for _ in range(STRANGERS):
                    try:
                        planted.append(socket.create_connection((h, p), timeout=10))
                    except OSError:
                        return   # the mesh formed and closed its listener: the flood came too late, harmless

            threading.Thread(target=flood_data_plane, daemon=True).start()
        time.sleep(0.5)   # let rank 0 accept them all: the flood is in place before rank 1 arrives
        job.release()

    try:
        out = run_ranks(_init_and_allreduce, 2, hold=[1], on_start=flood, timeout=60,
                        env={"HOROVOD_TRANSPORT": transport})
    finally:
        for s in planted:
            s.close()
    for rank, (values, took) in enumerate(out):
        assert values == [3.0] * 4, f"rank {rank}: {values}"
        # Strangers are pushed out, not waited for: far from the 120 s init timeout or their 10 s windows.
        assert took < 30, f"rank {rank}: init + allreduce took {took:.1f} s beside {STRANGERS} silent connections"


def test_pending_handshakes_push_out_the_oldest_and_keep_the_bound():
    pending = sockets.PendingHandshakes(limit=3)
    pairs = [socket.socketpair() for _ in range(5)]
    try:
        pushed = [pending.add(a) for a, _ in pairs]
        assert pushed[:3] == [None, None, None]
        assert pushed[3] is pairs[0][0] and pushed[4] is pairs[1][0]
        assert len(pending) == 3 and pending.pushed_out == 2
        # The pushed-out connections were shut down: their peers see the end at once.
        assert pairs[0][1].recv(1) == b"" and pairs[1][1].recv(1) == b""
        assert not pending.settle(pairs[0][0]), "a pushed-out connection must not be admitted"
        assert pending.settle(pairs[4][0]) and len(pending) == 2
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def _shm_transport_allreduce():
    import numpy as np

    from multiproc import open_transport

    start = time.monotonic()
    t = open_transport("shm", scope="flood", timeout=30.0)
    try:
        a = np.full(4, t.rank + 1, np.float32)
        t.allreduce(a)
        return [float(v) for v in a], time.monotonic() - start
    finally:
        t.close()


def test_silent_local_connections_to_the_shm_listener_do_not_hold_up_its_peers():
    """The shm transport's Unix socket is listed in /proc/net/unix; strangers there must not eat its deadline."""
    planted = []

    def flood(job):
        _, value = _wait_for_key(job.server.store, "addr.0", "-shm")
        for _ in range(40):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            planted.append(s)
            s.setblocking(False)   # a full accept queue refuses or would block: a stranger just moves on
            try:
                s.connect(value.decode())
            except (BlockingIOError, ConnectionRefusedError):
                pass
        time.sleep(0.3)
        job.release()

    try:
        out = run_ranks(_shm_transport_allreduce, 2, hold=[1], on_start=flood, timeout=60)
    finally:
        for s in planted:
            s.close()
    for rank, (values, took) in enumerate(out):
        assert values == [3.0] * 4, f"rank {rank}: {values}"
        assert took < 20, f"rank {rank}: the shm transport took {took:.1f} s to connect beside 40 silent connections"


def test_a_pushed_out_handshake_is_reported_as_such_and_a_real_dialer_gets_in():
    import threading

    pending = sockets.PendingHandshakes(limit=1)
    stranger, stranger_peer = socket.socketpair()
    newcomer, newcomer_peer = socket.socketpair()
    outcome = {}

    def listen_side():
        try:
            sockets.authenticate_pending(stranger, pending, b"secret", b"me", timeout=10.0, peer="stranger")
        except sockets.PeerError as exc:
            outcome["error"] = exc

    try:
        pending.add(stranger)
        thread = threading.Thread(target=listen_side)
        thread.start()
        time.sleep(0.2)                 # the stranger's handshake is waiting for it to speak
        pending.add(newcomer)           # ...and is pushed out by the next connection
        thread.join(5)
        assert not thread.is_alive(), "the pushed-out handshake kept waiting"
        assert isinstance(outcome.get("error"), sockets.PushedOut), outcome
        # The newcomer, a real peer, completes the handshake and is admitted.
        got = {}
        accept = threading.Thread(target=lambda: got.setdefault(
            "hello", sockets.authenticate_pending(newcomer, pending, b"secret", b"me", 10.0, "peer")))
        accept.start()
        sockets.authenticate(newcomer_peer, b"secret", initiator=True, hello=b"you", timeout=10.0, peer="listener")
        accept.join(5)
        assert got.get("hello") == b"you" and len(pending) == 0
    finally:
        for s in (stranger, stranger_peer, newcomer, newcomer_peer):
            s.close()
