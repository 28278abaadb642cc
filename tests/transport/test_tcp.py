"""What only the TCP transport has, on real processes and real sockets: authentication, failure detection and
blame, scratch memory, the pure schedules its algorithms follow, and the typed options.

Its collectives against numpy, at np = 1 to 4 and with tiny and default thresholds, are in the shared transport
suite (test_transport_conformance.py).
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import secrets
import select
import socket
import time

import numpy as np
import pytest

from horovod.transport import algorithms as alg
from horovod.transport import sockets
from horovod.transport.base import MAX, SUM, TransportError

from multiproc import Outcome, report, run_ranks, with_transport


def run_world(size, fn, args=(), *, options=None, transport_timeout=10.0, launcher="fork", **kwargs):
    """``fn(transport, *args)`` on ``size`` ranks over TCP; every rank's :class:`Outcome`."""
    return run_ranks(with_transport(fn, "tcp", "tcp-test", options, transport_timeout), size, args=args,
                     launcher=launcher, expect_failure=True, **kwargs)


def values(outcomes):
    """The return values of every rank; fails the test with every rank's story unless all succeeded."""
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "some ranks failed:\n" + "\n".join(f"--- rank {o.rank}: {o.status}, exit code {o.exitcode}\n"
                                                       f"{o.value}" for o in bad)
    return [o.value for o in outcomes]


# -------------------------------------------------------------------------------------------- failures


def _describe(o: Outcome) -> str:
    return f"rank {o.rank}: {o.status} {o.value!r}"


def _impostor(host, port, scope, q):
    """A process holding the wrong secret that claims to be rank 1."""
    try:
        s = sockets.connect(host, port, 5.0, what="rank 0")
        try:
            sockets.authenticate(s, secrets.token_bytes(16), initiator=True, hello=f"hvd-tcp|{scope}|1".encode(),
                                 timeout=5.0, peer="rank 0")
            q.put("joined")
        finally:
            s.close()
    except sockets.PeerError as exc:
        q.put(f"rejected: {type(exc).__name__}")


def allreduce_once(t):
    a = np.full(1000, t.rank + 1, dtype=np.int64)
    t.allreduce(a)
    big = np.full(200_000, t.rank + 1, dtype=np.int64)
    t.allreduce(big)
    return int(a[0]), int(big[-1])


def test_wrong_secret_is_rejected():
    """A stranger with the wrong secret (and a silent one) connect first; the real ranks still form the world."""
    ctx = mp.get_context("fork")
    seen = {}

    def on_start(job):
        deadline = time.monotonic() + 15
        while job.server.store.get(("tcp-test", "0")) is None:
            assert time.monotonic() < deadline, "rank 0 never published its address"
            time.sleep(0.01)
        host, port = sockets.parse_hostport(job.server.store.get(("tcp-test", "0")).decode())
        seen["silent"] = socket.create_connection((host, port), timeout=5)  # connects, never speaks
        q = ctx.Queue()
        p = ctx.Process(target=_impostor, args=(host, port, "tcp-test", q), daemon=True)
        p.start()
        try:
            seen["impostor"] = q.get(timeout=15)
        finally:
            p.join(5)
            if p.is_alive():
                p.kill()
        job.release()  # only now may the real rank 1 connect

    try:
        out = run_world(2, allreduce_once, hold=(1,), on_start=on_start, timeout=40, transport_timeout=15)
    finally:
        if "silent" in seen:
            seen["silent"].close()
    assert seen["impostor"].startswith("rejected"), seen
    assert values(out) == [(3, 3), (3, 3)]
    assert any("dropped" in line and "authentication" in line for line in out[0].output.splitlines()), out[0].output


def looping_allreduce(t, victim):
    a = np.ones(1 << 20, dtype=np.float32)
    for i in range(100000):
        if i == 2:
            report("looping")
        if t.rank == victim and i >= 2:
            time.sleep(60)  # killed here by the test, possibly while peers are mid-allreduce with it
        t.allreduce(a, MAX)
    return "finished"


def test_peer_killed_mid_allreduce():
    """Survivors fail promptly with a TransportError naming the dead rank (not after the 60 s timeout)."""
    victim = 1

    def kill_when_looping(job):
        assert sorted(rank for rank, _ in job.messages(3)) == [0, 1, 2]
        time.sleep(0.2)
        job.kill(victim)

    # The world's hard limit (25 s) is far below the transport timeout (60 s): only prompt detection passes.
    out = run_world(3, looping_allreduce, (victim,), on_start=kill_when_looping, transport_timeout=60, timeout=25)
    assert out[victim].status == "died"
    for o in out:
        if o.rank != victim:
            assert o.status == "error" and o.error["type"] == "TransportError", _describe(o)
            assert o.error["peer"] == victim and f"rank {victim}" in o.error["message"], _describe(o)


def victim_exits_mid_transfer(t, victim):
    """Like :func:`looping_allreduce`, but the victim's death interrupts a large allreduce in flight."""
    a = np.ones(4 << 20, dtype=np.float32)
    if t.rank == victim:
        import threading
        threading.Timer(0.3, lambda: os._exit(3)).start()
    for _ in range(100000):
        t.allreduce(a, SUM)
        a.fill(1)
    return "finished"


def test_peer_exits_during_large_allreduce():
    victim = 3
    out = run_world(4, victim_exits_mid_transfer, (victim,), transport_timeout=60, timeout=25)
    assert out[victim].exitcode == 3
    for o in out:
        if o.rank != victim:
            assert o.status == "error" and o.error["type"] == "TransportError", _describe(o)
            assert o.error["peer"] == victim, _describe(o)


def silent_peer(t):
    if t.rank == 1:
        # Never join the allreduce: just wait (bounded) until rank 0 gives up and closes the connection.
        poller = select.poll()
        poller.register(t._mesh.socks[0], select.POLLRDHUP)
        poller.poll(20_000)
        return "stayed silent"
    start = time.monotonic()
    try:
        t.allreduce(np.ones(10, dtype=np.float32))
    except TransportError as exc:
        return {"message": str(exc), "peer": exc.peer, "elapsed": time.monotonic() - start}
    return "no error"


def test_silent_peer_times_out():
    out = run_world(2, silent_peer, transport_timeout=2.0, timeout=30)
    got = out[0].value
    assert isinstance(got, dict), _describe(out[0])
    assert got["peer"] == 1 and "rank 1" in got["message"] and "allreduce" in got["message"], got
    assert "timed out" in got["message"], got
    assert out[1].value == "stayed silent", _describe(out[1])


def frozen_rank_loop(t, frozen, elements):
    """Allreduce in a loop; rank ``frozen`` stops itself (SIGSTOP) between two of them, the others report the error."""
    import signal

    a = np.ones(elements, dtype=np.float32)
    for i in range(100000):
        if t.rank == frozen and i == 20:
            os.kill(os.getpid(), signal.SIGSTOP)   # frozen for good: the test kills it once the others reported
        try:
            t.allreduce(a, SUM)
        except TransportError as exc:
            got = {"peer": exc.peer, "message": str(exc)}
            report(got)
            return got
        a.fill(1)
    return "finished"


@pytest.mark.parametrize("size,elements", [(3, 1000), (4, 1000), (3, 1 << 18), (4, 1 << 18)],
                         ids=["np3-doubling", "np4-doubling", "np3-ring", "np4-ring"])
def test_a_frozen_rank_is_blamed_not_the_peer_waiting_for_it(size, elements):
    """Rank 2 freezes.  Ranks that wait on it only through another rank (the extra rank of recursive doubling
    waits for its proxy; a ring waits on its left neighbour) must still name rank 2, not the rank in between."""
    frozen = 2

    def kill_frozen_once_reported(job):
        job.messages(size - 1, timeout=60)
        job.kill(frozen)

    out = run_world(size, frozen_rank_loop, (frozen, elements), on_start=kill_frozen_once_reported,
                    transport_timeout=2.0, timeout=90)
    for o in out:
        if o.rank == frozen:
            continue
        assert o.status == "ok" and isinstance(o.value, dict), _describe(o)
        assert o.value["peer"] == frozen, f"rank {o.rank} blamed rank {o.value['peer']}: {o.value['message']}"


def huge_reducescatter_then_scratch(t):
    from horovod.transport.tcp_mesh import SCRATCH_KEEP_BYTES

    n = (SCRATCH_KEEP_BYTES // 4) * 3 // 2 // t.size * t.size   # 1.5x the kept size, in float32
    send = np.full(n, t.rank + 1, dtype=np.float32)
    recv = np.empty(n // t.size, dtype=np.float32)
    t.reducescatter(send, recv, [n // t.size] * t.size, SUM)
    total = t.size * (t.size + 1) // 2
    return bool(np.all(recv == total)), max((b.nbytes for b in t._mesh._scratch.values()), default=0)


def test_one_huge_collective_leaves_no_scratch_beyond_the_kept_size():
    from horovod.transport.tcp_mesh import SCRATCH_KEEP_BYTES

    for ok, kept in values(run_world(2, huge_reducescatter_then_scratch, timeout=120)):
        assert ok
        assert kept <= SCRATCH_KEEP_BYTES, f"the mesh keeps {kept >> 20} MiB of scratch after the collective"


def nothing(t):
    return "connected"


def test_bootstrap_names_missing_rank():
    out = run_world(3, nothing, ranks=[0, 1], transport_timeout=1.5, timeout=20)
    for o in out:
        assert o.status == "error" and o.error["type"] == "TransportError", _describe(o)
        assert "2" in str(o.error["peer"]) and "rank" in o.error["message"], _describe(o)


# ------------------------------------------------------------------------------------------ schedules


@pytest.mark.parametrize("size", range(1, 10))
def test_schedules(size):
    for root in range(size):
        parents = {r: alg.binomial_tree(r, size, root)[0] for r in range(size)}
        assert parents[root] is None and all(parents[r] is not None for r in range(size) if r != root)
        for r in range(size):
            for c in alg.binomial_tree(r, size, root)[1]:
                assert parents[c] == r
    folds = [alg.Fold(r, size) for r in range(size)]
    core = sorted(f.vrank for f in folds if f.vrank is not None)
    assert core == list(range(folds[0].pow2))
    for r, f in enumerate(folds):
        for p in f.partners():
            assert r in folds[p].partners()
        if f.partner is not None:
            assert folds[f.partner].partner == r
    for r in range(size):
        for k, (to, frm) in enumerate(alg.dissemination(r, size)):
            # Round k pairs up: whom r sends to receives from r, and whom r receives from sends to r.
            assert alg.dissemination(to, size)[k][1] == r
            assert alg.dissemination(frm, size)[k][0] == r
    assert sum(alg.partition(17, size)) == 17
    assert alg.segments(5, 0, 4) == [] and alg.segments(5, 9, 4) == [(5, 4), (9, 4), (13, 1)]


def test_transport_options_are_typed_and_refuse_unknown_names():
    from horovod.transport.base import Bootstrap, TransportOptions

    boot = Bootstrap(0, 1, options={"small_message_bytes": 4096, "shm_backing": "file"})
    assert isinstance(boot.options, TransportOptions)
    assert (boot.options.small_message_bytes, boot.options.shm_backing) == (4096, "file")
    assert Bootstrap(0, 1).options == TransportOptions()
    with pytest.raises(ValueError, match="unknown transport option.*'chunk_bytes'"):
        Bootstrap(0, 1, options={"chunk_bytes": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen: a transport cannot change what another reads
        boot.options.small_message_bytes = 1
