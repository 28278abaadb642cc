"""What only the shared-memory transport has, on real forked processes: it refuses a world spread over hosts,
releases every segment on close (memfd and /dev/shm file backing), reports a killed rank quickly, names an
alltoallv count mismatch, and uses single-copy reads only where every rank can.

Every job runs in forked processes under a hard deadline (the parent kills stragglers and fails the test), so
nothing can hang the suite.  Its collectives against numpy, at np = 1 to 4 with tiny and default segments, are in
the shared transport suite (test_transport_conformance.py).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from horovod.transport.base import REGISTRY, Bootstrap, LocalTransport, TransportError
from horovod.transport.shm import _MEMORY_ORDER_OK, create_shm

from multiproc import bootstrap, rank_and_size, run_ranks

pytestmark = pytest.mark.skipif(not _MEMORY_ORDER_OK, reason="the shm transport needs an x86 (TSO) CPU")
CTX = mp.get_context("fork")
JOB_TIMEOUT = 45.0


# -- harness -----------------------------------------------------------------------------------------------------

def _boot(scope, opts, timeout=20.0):
    return bootstrap(scope, opts, timeout)


def _as_rank(body, *args):
    rank, size = rank_and_size()
    return body(rank, size, *args)


def _launch(size, body, *args, timeout=JOB_TIMEOUT, on_start=None):
    """Run ``body(rank, size, *args)`` in ``size`` forked ranks; return ``{rank: (status, value)}``.

    ``on_start(job)`` runs once the ranks are started.  Finished ranks stay alive until every rank finished (peers
    must not see a rank exit early).
    """
    outcomes = run_ranks(_as_rank, size, args=(body,) + args, launcher="fork", timeout=timeout, on_start=on_start,
                         linger=True, expect_failure=True)
    return {o.rank: (o.status, o.value) for o in outcomes}


def _ok(got):
    errors = {r: v for r, (s, v) in got.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}: {v}" for r, v in sorted(errors.items()))
    return {r: v for r, (s, v) in got.items()}


# -- tests ---------------------------------------------------------------------------------------------------------

def test_registered_and_single_rank():
    assert REGISTRY["shm"] is create_shm
    t = create_shm(Bootstrap(0, 1, local_rank=0, local_size=1, store=None, secret=b"x", scope="one"))
    buf = np.arange(5, dtype=np.float32)
    t.allreduce(buf)
    t.barrier()
    assert np.array_equal(buf, np.arange(5, dtype=np.float32))
    assert isinstance(t.subgroup([0]), LocalTransport)
    t.close()
    t.close()


def test_rejects_ranks_on_several_hosts():
    with pytest.raises(TransportError, match="one host"):
        create_shm(Bootstrap(0, 4, local_rank=0, local_size=2, store=None, secret=b"x", scope="multi"))


def _shm_entries(token):
    return [name for name in os.listdir("/dev/shm") if token in name] if os.path.isdir("/dev/shm") else []


def _body_lifecycle(rank, size, backing):
    t = create_shm(_boot("life", {"shm_backing": backing}))
    token = t._node.token
    sub = t.subgroup([0, size - 1]) if rank in (0, size - 1) else None
    if sub is not None:
        sub.barrier()
    # With file backing a name exists between a member's open() and its unlink(); once every rank passed the
    # world barrier, all setups are over and no name may remain, even while the job runs.
    t.barrier()
    visible = _shm_entries(token)
    buf = np.ones(1 << 20, np.float32)
    t.allreduce(buf)
    assert buf[0] == size
    with open("/proc/self/maps") as f:
        mapped_before = sum("hvd-shm-" + token in line for line in f)
    t.close()
    t.close()
    with open("/proc/self/maps") as f:
        mapped_after = [line for line in f if "hvd-shm-" + token in line]
    errors = []
    for call in (lambda: t.allreduce(np.ones(3)), t.barrier, lambda: t.subgroup([rank])):
        try:
            call()
            errors.append("a call after close() did not raise")
        except TransportError:
            pass
    return token, visible, mapped_before, mapped_after, errors


@pytest.mark.parametrize("backing", ["memfd", "file"])
def test_close_releases_everything(backing):
    results = _ok(_launch(3, _body_lifecycle, backing))
    for rank, (token, visible, before, after, errors) in results.items():
        assert not visible, f"rank {rank}: segments visible in /dev/shm during the job: {visible}"
        assert before >= 3, f"rank {rank}: expected every member's segment in /proc/self/maps, found {before}"
        assert not after, f"rank {rank}: still mapped after close(): {after}"
        assert not errors, errors
        assert not _shm_entries(token)


def _body_killed(rank, size, backing, fork_child, started, collective="allreduce"):
    t = create_shm(_boot("kill", {"shm_backing": backing, "shm_single_copy_bytes": 4096}, timeout=120.0))
    buf = np.ones(4 << 20, np.float32)  # 16 MB: several chunks per allreduce
    if collective == "allgather":   # blocks read straight from the peers' memory (single copy), when it can
        out = np.empty(buf.size * size, np.float32)
        t.allreduce = lambda b: t.allgatherv(b, out, [b.size] * size)
    t.allreduce(buf)
    child = 0
    if fork_child and rank == size - 1:
        # a child forked after setup (think data-loader worker) outlives the victim: it must not hide its death
        child = os.fork()
        if child == 0:
            time.sleep(JOB_TIMEOUT)
            os._exit(0)
    started.put((rank, child))
    try:
        while True:
            buf[:] = 1
            t.allreduce(buf)
    except TransportError as exc:
        return exc.peer, str(exc), t._node.token


@pytest.mark.parametrize("size,backing,fork_child,collective", [(2, "memfd", True, "allreduce"),
                                                                 (3, "file", False, "allreduce"),
                                                                 (4, "memfd", False, "allreduce"),
                                                                 (3, "memfd", False, "allgather")])
def test_killed_rank_is_reported_quickly(size, backing, fork_child, collective):
    """SIGKILL one rank mid-allreduce: the others raise TransportError naming it, long before the 120 s timeout."""
    started = CTX.Queue()
    victim = size - 1

    def kill_when_running(job):
        for _ in range(size):
            started.get(timeout=30)
        time.sleep(0.2)  # let the loop get well into an allreduce
        job.kill(victim)  # the harness kills its forked child (it holds the victim's pipes) with its session

    got = _launch(size, _body_killed, backing, fork_child, started, collective, on_start=kill_when_running,
                  timeout=30.0)
    assert got[victim][0] == "died", got[victim]
    for rank, (status, value) in got.items():
        if rank == victim:
            continue
        assert status == "ok", value
        peer, message, token = value
        assert peer == victim, message
        assert f"local rank {victim}" in message and "killed" in message, message
    assert not _shm_entries(token)


def _body_mismatch(rank, size, single_copy_bytes):
    t = create_shm(_boot("bad", {"shm_single_copy_bytes": single_copy_bytes}))
    # rank 0 sends 5 elements to rank 1, which expects 4: rank 1 must say so (rank 0 may finish happily)
    send = np.zeros(10, np.float32)
    recv = np.zeros(10, np.float32)
    try:
        if rank == 0:
            t.alltoallv(send, [5, 5], recv, [5, 5])
        else:
            t.alltoallv(send, [5, 5], recv, [4, 5])
        return None
    except TransportError as exc:
        return str(exc)
    finally:
        t.close()


@pytest.mark.parametrize("single_copy_bytes", [0, 4], ids=["staged", "single-copy"])
def test_alltoallv_count_mismatch_is_reported(single_copy_bytes):
    results = _ok(_launch(2, _body_mismatch, single_copy_bytes))
    assert results[1] is not None and "recv_counts[0] = 4" in results[1]


def _body_broadcast_spin_differs(rank, size):
    # One rank spins, the other never does (shm_spin_us=0): both must still cut a large broadcast into the same
    # pieces, or their step counters part and the data is wrong or the job hangs.
    t = create_shm(_boot("bcast-spin", {"shm_spin_us": 0.0 if rank == 0 else 50.0}))
    try:
        out = []
        for root in range(size):
            buf = np.arange(3 << 18, dtype=np.float32) + root if rank == root else np.zeros(3 << 18, np.float32)
            t.broadcast(buf, root)
            out.append(bool(np.array_equal(buf, np.arange(3 << 18, dtype=np.float32) + root)))
        return out
    finally:
        t.close()


def test_a_broadcast_is_cut_alike_whatever_each_rank_spins():
    results = _ok(_launch(2, _body_broadcast_spin_differs))
    assert results == {0: [True, True], 1: [True, True]}, results


def _body_broadcast_pieces(rank, size):
    # Past 8 pieces of 256 KiB a broadcast takes larger pieces (up to a half): sizes on both sides of each bound,
    # a last piece shorter than the others, and one more than the halves hold, from every root.
    t = create_shm(_boot("bcast-pieces", {"shm_segment_bytes": 4 << 20}))
    try:
        out = []
        for count in (1 << 19, (1 << 19) + 3, (5 << 20) // 4 + 7, (24 << 20) // 4 + 1):
            for root in range(size):
                want = np.random.default_rng(count + root).standard_normal(count).astype(np.float32)
                buf = want.copy() if rank == root else np.full(count, np.nan, np.float32)
                t.broadcast(buf, root)
                out.append(bool(np.array_equal(buf, want)))
        return out
    finally:
        t.close()


@pytest.mark.parametrize("size", [2, 3])
def test_large_broadcasts_take_larger_pieces_and_arrive_whole(size):
    results = _ok(_launch(size, _body_broadcast_pieces))
    assert all(all(v) and len(v) == 4 * size for v in results.values()), results


def _kernel_allows_single_copy():
    """Whether a forked child can read its parent's memory: the kernel's answer, asked without the transport."""
    from horovod.transport import cma
    token = np.array([0x5EED], np.int64)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if cma.probe(cma.Reader(), parent, cma.address(token), 0x5EED) else 1)
        except BaseException:
            os._exit(2)
    return os.waitpid(pid, 0)[1] == 0


def _body_single_copy(rank, size, on_ranks):
    t = create_shm(_boot("single-copy", {"shm_single_copy_bytes": 4096 if rank in on_ranks else 0}))
    try:
        return t._node.cma is not None
    finally:
        t.close()


@pytest.mark.parametrize("size", [2, 3])
def test_single_copy_reads_are_used_only_where_every_rank_can(size):
    """Every rank probes every peer at setup and they agree: on where the kernel allows it and no rank turned it
    off; off everywhere when one rank did (a rank reading by address while a peer staged its bytes would wait)."""
    allowed = _kernel_allows_single_copy()
    assert _ok(_launch(size, _body_single_copy, tuple(range(size)))) == {r: allowed for r in range(size)}
    assert _ok(_launch(size, _body_single_copy, tuple(range(1, size)))) == {r: False for r in range(size)}
