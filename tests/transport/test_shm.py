"""Shared-memory transport: real processes, a real rendezvous server, results checked against numpy.

Every job runs in forked processes under a hard deadline (the parent kills stragglers and fails the test), so
nothing can hang the suite.  Reductions are checked for bitwise equality with a numpy fold in rank order, which is
the order the transport promises.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import time
import warnings

import numpy as np
import pytest

from horovod.engine import ops
from horovod.transport.base import REGISTRY, Bootstrap, LocalTransport, TransportError
from horovod.transport.shm import _MEMORY_ORDER_OK, ShmTransport, create_shm

from checks import Checks, assert_no_failures
from multiproc import bootstrap, rank_and_size, run_ranks

pytestmark = pytest.mark.skipif(not _MEMORY_ORDER_OK, reason="the shm transport needs an x86 (TSO) CPU")
CTX = mp.get_context("fork")
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8, np.float16, np.bool_]
OPS = ["sum", "min", "max", "product"]
# A tiny segment (4 KiB halves) makes every size cross many rounds and both halves; the default one is 4 MiB.
TINY = {"shm_segment_bytes": 8192, "shm_chunk_bytes": 4096, "shm_small_bytes": 256}
SIZES = [0, 1, 7, 1000]  # plus a large size per configuration, see _sizes
JOB_TIMEOUT = 45.0


def _sizes(opts, dtype) -> list:
    # tiny: ~5 chunks / rounds of 4 KiB; default: ~2.5 MB crosses the 1 MiB allreduce chunks and the 2 MiB halves
    big = (20000 if opts else 5 << 19) // np.dtype(dtype).itemsize + 13
    return SIZES + [big]


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


def _data(seed, rank, n, dtype, op="sum"):
    """Deterministic per-rank input (read-only, cached): small values, near 1 for products (no overflow)."""
    return _cached_data(seed, rank, n, np.dtype(dtype), op == "product")


def _buf(seed, rank, n, dtype, op="sum"):
    """A writable copy of :func:`_data`, for collectives that work in place."""
    return _data(seed, rank, n, dtype, op).copy()


@functools.lru_cache(maxsize=256)
def _cached_data(seed, rank, n, dtype, product):
    rng = np.random.default_rng([seed, rank, n])
    k = min(n, 4099)  # a random block of prime length, tiled: cheap, and never aligned with a chunk boundary
    if dtype == np.bool_:
        base = rng.random(k) < 0.5
    elif dtype.kind == "f":
        base = (rng.uniform(0.5, 1.5, k) if product else rng.uniform(-4, 4, k)).astype(dtype)
    elif dtype.kind == "u":
        base = rng.integers(0, 3 if product else 60, k).astype(dtype)
    else:
        base = rng.integers(-3 if product else -1000, 4 if product else 1000, k).astype(dtype)
    out = np.resize(base, n)
    out.setflags(write=False)
    return out


def _fold(arrays, op):
    """numpy reference: a0 op a1 op ... in rank order (bool: sum/max are OR, min/product are AND)."""
    if arrays[0].dtype == np.bool_:
        f = np.logical_or if op in ("sum", "max") else np.logical_and
    else:
        f = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}[op]
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = f(out, a)
    return out


def _transports(rank, size, tiny_too=True):
    """The default transport and (optionally) a tiny-segment one: two concurrent jobs in the same processes."""
    ts = [("default", create_shm(_boot("w-default", {})))]
    if tiny_too:
        ts.append(("tiny", create_shm(_boot("w-tiny", TINY))))
    return ts


def _each_case(rank, size):
    """``(label, transport, dtype, n)`` for every transport, dtype and size; each transport is closed after its
    cases."""
    for label, t in _transports(rank, size):
        opts = TINY if label == "tiny" else {}
        for dtype in DTYPES:
            for n in _sizes(opts, dtype):
                yield label, t, dtype, n
        t.close()


# -- collective bodies (run inside the ranks) ----------------------------------------------------------------------

def _body_allreduce(rank, size):
    chk = Checks(rank)
    for label, t in _transports(rank, size):
        opts = TINY if label == "tiny" else {}
        for dtype in DTYPES:
            for op in OPS:
                for n in _sizes(opts, dtype):
                    seed = DTYPES.index(dtype) * 10 + OPS.index(op)
                    buf = _buf(seed, rank, n, dtype, op)
                    t.allreduce(buf, op)
                    want = _fold([_data(seed, q, n, dtype, op) for q in range(size)], op)
                    chk.equal(buf, want, f"{label} allreduce {np.dtype(dtype)} {op} n={n}")
                    # Out of place: the input is read-only here, so a write to it would raise.
                    out = np.empty(n, dtype)
                    t.allreduce_into(_data(seed, rank, n, dtype, op), out, op)
                    chk.equal(out, want, f"{label} allreduce_into {np.dtype(dtype)} {op} n={n}")
                    if op == "sum" and dtype != np.bool_:
                        _check_finish(chk, t, label, seed, rank, size, n, dtype, want)
        for n in (3, 300000):  # overflow to inf is float16's defined result: no RuntimeWarning, on either path
            buf = np.full(n, 6e4, np.float16)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                t.allreduce(buf)
            chk.equal(buf, np.full(n, 6e4 if size == 1 else np.inf, np.float16), f"{label} float16 overflow n={n}")
        t.close()
        t.close()  # idempotent
    return chk.report()


def _check_finish(chk, t, label, seed, rank, size, n, dtype, want):
    """A finish (Average's division, with and without a postscale) applied while each piece of the result is
    written gives the same bits as finishing the whole reduced buffer afterwards, in place and out of place."""
    for finish in (ops.Finish(1.0, size), ops.Finish(0.5, size)):
        expect = want.copy()
        finish(expect)
        what = f"{label} allreduce_into + finish(postscale={finish.postscale}) {np.dtype(dtype)} n={n}"
        out = np.empty(n, dtype)
        t.allreduce_into(_data(seed, rank, n, dtype), out, "sum", finish)
        chk.equal(out, expect, what)
        buf = _buf(seed, rank, n, dtype)
        t.allreduce_into(buf, buf, "sum", finish)
        chk.equal(buf, expect, f"{what} in place")


def _body_allgatherv(rank, size):
    chk = Checks(rank)
    for label, t, dtype, n in _each_case(rank, size):
        for pattern in range(3):
            counts = [n if pattern == 0 else (n * (q + 1)) // size if pattern == 1 else (n if q == size - 1
                                                                                     else 0)
                      for q in range(size)]
            send = _data(5, rank, counts[rank], dtype)
            recv = np.zeros(sum(counts) + 3, dtype)
            t.allgatherv(send, recv, counts)
            want = np.concatenate([_data(5, q, counts[q], dtype) for q in range(size)])
            chk.equal(recv[:sum(counts)], want, f"{label} allgatherv {np.dtype(dtype)} counts={counts}")

    return chk.report()


def _body_broadcast(rank, size):
    chk = Checks(rank)
    for label, t, dtype, n in _each_case(rank, size):
        for root in range(size):
            buf = _buf(7, rank, n, dtype)
            t.broadcast(buf, root)
            chk.equal(buf, _data(7, root, n, dtype), f"{label} broadcast {np.dtype(dtype)} n={n} root={root}")

    return chk.report()


def _a2a_counts(n, size):
    """counts[r][p]: what rank r sends to p (zeros, uneven and large blocks)."""
    return [[(n * ((r + 2 * p) % (size + 1))) // max(1, size) for p in range(size)] for r in range(size)]


def _body_alltoallv(rank, size):
    chk = Checks(rank)
    for label, t, dtype, n in _each_case(rank, size):
        c = _a2a_counts(n, size)
        sends = [_data(11, q, sum(c[q]), dtype) for q in range(size)]
        recv_counts = [c[q][rank] for q in range(size)]
        recv = np.zeros(sum(recv_counts), dtype)
        t.alltoallv(sends[rank], c[rank], recv, recv_counts)
        want = np.concatenate([sends[q][sum(c[q][:rank]):sum(c[q][:rank + 1])] for q in range(size)])
        chk.equal(recv, want, f"{label} alltoallv {np.dtype(dtype)} n={n}")

    return chk.report()


def _body_reducescatter(rank, size):
    chk = Checks(rank)
    for label, t in _transports(rank, size):
        opts = TINY if label == "tiny" else {}
        for dtype in DTYPES:
            for op in OPS:
                for n in _sizes(opts, dtype):
                    for counts in ([n // size + (q < n % size) for q in range(size)],
                                   [n if q == 0 else 0 for q in range(size)]):
                        sends = [_data(13, q, sum(counts), dtype, op) for q in range(size)]
                        recv = np.zeros(counts[rank], dtype)
                        t.reducescatter(sends[rank], recv, counts, op)
                        lo = sum(counts[:rank])
                        want = _fold([s[lo:lo + counts[rank]] for s in sends], op)
                        chk.equal(recv, want, f"{label} reducescatter {np.dtype(dtype)} {op} counts={counts}")
        t.close()
    return chk.report()


def _body_sendrecv_barrier(rank, size):
    chk = Checks(rank)
    for label, t in _transports(rank, size):
        for dtype in (np.float32, np.uint8, np.bool_, np.float16):
            for n in (0, 1, 7, 3 << 20):
                # ring: send right, receive from the left
                right, left = (rank + 1) % size, (rank - 1) % size
                recv = np.zeros(n, dtype)
                t.sendrecv(_data(17, rank, n, dtype), right, recv, left)
                chk.equal(recv, _data(17, left, n, dtype), f"{label} sendrecv ring {np.dtype(dtype)} n={n}")
                # pairs exchange with the same peer (the last rank of an odd group sits out with None)
                partner = rank ^ 1
                if partner < size:
                    recv = np.zeros(n, dtype)
                    t.sendrecv(_data(19, rank, n, dtype), partner, recv, partner)
                    chk.equal(recv, _data(19, partner, n, dtype), f"{label} sendrecv pair n={n}")
                else:
                    t.sendrecv(None, None, None, None)
                # one-way: only rank 0 sends, only the last rank receives; others do not take part
                if size > 1 and rank == 0:
                    t.sendrecv(_data(23, 0, n, dtype), size - 1, None, None)
                elif size > 1 and rank == size - 1:
                    recv = np.zeros(n, dtype)
                    t.sendrecv(None, None, recv, 0)
                    chk.equal(recv, _data(23, 0, n, dtype), f"{label} sendrecv one-way n={n}")
                t.barrier()
        for _ in range(50):
            t.barrier()
        t.close()
    return chk.report()


def _check_group(t, members, tag, chk):
    """A few collectives on group ``t`` whose world ranks are ``members``; data depends on the world rank."""
    r, s = t.rank, t.size
    assert (r, s) == (members.index(members[r]), len(members))
    for n in (1, 5000, 300000):
        buf = _buf(29, members[r], n, np.float32)
        t.allreduce(buf)
        chk.equal(buf, _fold([_data(29, w, n, np.float32) for w in members], "sum"), f"{tag} allreduce n={n}")
        recv = np.zeros(n * s, np.int64)
        t.allgatherv(_data(31, members[r], n, np.int64), recv, [n] * s)
        chk.equal(recv, np.concatenate([_data(31, w, n, np.int64) for w in members]), f"{tag} allgatherv n={n}")
        buf = _buf(37, members[r], n, np.uint8)
        t.broadcast(buf, s - 1)
        chk.equal(buf, _data(37, members[-1], n, np.uint8), f"{tag} broadcast n={n}")
        recv = np.zeros(n * s, np.float64)
        t.alltoallv(_data(41, members[r], n * s, np.float64), [n] * s, recv, [n] * s)
        chk.equal(recv, np.concatenate([_data(41, w, n * s, np.float64)[r * n:(r + 1) * n] for w in members]),
               f"{tag} alltoallv n={n}")
        recv = np.zeros(n, np.int32)
        t.reducescatter(_data(43, members[r], n * s, np.int32), recv, [n] * s, "max")
        chk.equal(recv, _fold([_data(43, w, n * s, np.int32)[r * n:(r + 1) * n] for w in members], "max"),
               f"{tag} reducescatter n={n}")
        recv = np.zeros(n, np.float32)
        t.sendrecv(_data(47, members[r], n, np.float32), (r + 1) % s, recv, (r - 1) % s)
        chk.equal(recv, _data(47, members[(r - 1) % s], n, np.float32), f"{tag} sendrecv n={n}")
        t.barrier()


def _body_subgroups(rank, size):
    chk = Checks(rank)
    world = create_shm(_boot("sub", {"shm_segment_bytes": 1 << 20}))
    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
    ends = sorted({0, size - 1})
    for _pass in range(2):  # the second pass reuses the cached groups
        _check_group(world, list(range(size)), "world", chk)
        mine = evens if rank in evens else odds
        g = world.subgroup(mine)
        if len(mine) == 1:
            assert isinstance(g, LocalTransport)
        else:
            assert isinstance(g, ShmTransport) and g.size == len(mine)
            _check_group(g, mine, f"sub{mine}", chk)
            if len(mine) > 2:  # a subgroup of a subgroup: its ranks are relative to the subgroup
                nested = g.subgroup([0, len(mine) - 1])
                if g.rank in (0, len(mine) - 1):
                    _check_group(nested, [mine[0], mine[-1]], "nested", chk)
        # non-members go straight on to the next world collective while members are still in their subgroup
        if rank in ends and len(ends) > 1:
            _check_group(world.subgroup(ends), ends, f"ends{ends}", chk)
        assert world.subgroup(range(size)) is world
        buf = np.full(3, rank, np.int64)
        world.allreduce(buf)
        chk.equal(buf, np.full(3, sum(range(size)), np.int64), "world after subgroups")
    world.close()
    return chk.report()


def _body_random_program(rank, size, seed):
    """The same random sequence of collectives on every rank (tiny halves: every op spans rounds and halves)."""
    chk = Checks(rank)
    t = create_shm(_boot("fuzz", TINY))
    rng = np.random.default_rng(seed)  # same seed everywhere: same program
    for i in range(150):
        what, n = rng.integers(0, 5), int(rng.choice([0, 1, 5, 100, 1000, 5000]))
        dtype = DTYPES[rng.integers(0, len(DTYPES))]
        if what == 0:
            op = OPS[rng.integers(0, 4)]
            buf = _buf(i, rank, n, dtype, op)
            t.allreduce(buf, op)
            chk.equal(buf, _fold([_data(i, q, n, dtype, op) for q in range(size)], op), f"#{i} allreduce")
        elif what == 1:
            root = int(rng.integers(0, size))
            buf = _buf(i, rank, n, dtype)
            t.broadcast(buf, root)
            chk.equal(buf, _data(i, root, n, dtype), f"#{i} broadcast root {root}")
        elif what == 2:
            counts = [int(c) for c in rng.integers(0, n + 1, size)]
            recv = np.zeros(sum(counts), dtype)
            t.allgatherv(_data(i, rank, counts[rank], dtype), recv, counts)
            chk.equal(recv, np.concatenate([_data(i, q, counts[q], dtype) for q in range(size)]), f"#{i} allgatherv")
        elif what == 3:
            c = [[int(x) for x in row] for row in rng.integers(0, n + 1, (size, size))]
            sends = [_data(i, q, sum(c[q]), dtype) for q in range(size)]
            recv = np.zeros(sum(c[q][rank] for q in range(size)), dtype)
            t.alltoallv(sends[rank], c[rank], recv, [c[q][rank] for q in range(size)])
            chk.equal(recv, np.concatenate([sends[q][sum(c[q][:rank]):sum(c[q][:rank + 1])] for q in range(size)]),
                   f"#{i} alltoallv")
        else:
            counts = [int(x) for x in rng.integers(0, n + 1, size)]
            sends = [_data(i, q, sum(counts), dtype) for q in range(size)]
            recv = np.zeros(counts[rank], dtype)
            t.reducescatter(sends[rank], recv, counts, "max")
            lo = sum(counts[:rank])
            chk.equal(recv, _fold([x[lo:lo + counts[rank]] for x in sends], "max"), f"#{i} reducescatter")
        if rng.random() < 0.1:
            t.barrier()
    t.close()
    return chk.report()


# -- tests ---------------------------------------------------------------------------------------------------------

BODIES = {"allreduce": _body_allreduce, "allgatherv": _body_allgatherv, "broadcast": _body_broadcast,
          "alltoallv": _body_alltoallv, "reducescatter": _body_reducescatter,
          "sendrecv_barrier": _body_sendrecv_barrier}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("what", list(BODIES))
def test_collectives_match_numpy(what, size):
    assert_no_failures(list(_ok(_launch(size, BODIES[what])).values()))


@pytest.mark.parametrize("size", [2, 3, 4])
def test_random_programs(size):
    assert_no_failures(list(_ok(_launch(size, _body_random_program, 1000 + size)).values()))


@pytest.mark.parametrize("size", [2, 3, 4])
def test_subgroups(size):
    assert_no_failures(list(_ok(_launch(size, _body_subgroups)).values()))


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


def _body_killed(rank, size, backing, fork_child, started):
    t = create_shm(_boot("kill", {"shm_backing": backing}, timeout=120.0))
    buf = np.ones(4 << 20, np.float32)  # 16 MB: several chunks per allreduce
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


@pytest.mark.parametrize("size,backing,fork_child", [(2, "memfd", True), (3, "file", False), (4, "memfd", False)])
def test_killed_rank_is_reported_quickly(size, backing, fork_child):
    """SIGKILL one rank mid-allreduce: the others raise TransportError naming it, long before the 120 s timeout."""
    started = CTX.Queue()
    victim = size - 1

    def kill_when_running(job):
        for _ in range(size):
            started.get(timeout=30)
        time.sleep(0.2)  # let the loop get well into an allreduce
        job.kill(victim)  # the harness kills its forked child (it holds the victim's pipes) with its session

    got = _launch(size, _body_killed, backing, fork_child, started, on_start=kill_when_running, timeout=30.0)
    assert got[victim][0] == "died", got[victim]
    for rank, (status, value) in got.items():
        if rank == victim:
            continue
        assert status == "ok", value
        peer, message, token = value
        assert peer == victim, message
        assert f"local rank {victim}" in message and "killed" in message, message
    assert not _shm_entries(token)


def _body_mismatch(rank, size):
    t = create_shm(_boot("bad", {}))
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


def test_alltoallv_count_mismatch_is_reported():
    results = _ok(_launch(2, _body_mismatch))
    assert results[1] is not None and "recv_counts[0] = 4" in results[1]
