"""The built-in TCP transport on real processes and real sockets, checked against numpy.

Inputs are regenerated from ``(seed, rank)`` in the test process, so every rank's result is compared with a numpy
reduction of what every rank really held.  Results travel back as SHA-256 digests (exact, integer-valued data)
or as arrays (non-integer floats, compared with a tolerance and for bitwise agreement across ranks).
"""
from __future__ import annotations

import dataclasses
import hashlib
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
from horovod.transport.base import MAX, MIN, PRODUCT, SUM, TransportError

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

OPS = (SUM, MIN, MAX, PRODUCT)
DTYPES = ("float32", "float64", "int32", "int64", "uint8", "float16", "bool")
SIZES = (0, 1, 7, 100, 3001, 70001)
# Tiny thresholds so that modest buffers take the ring paths with many, unevenly cut pipeline segments.
SMALL_OPTS = {"small_message_bytes": 4096, "tcp_chunk_bytes": 16384}
SEED = 20261122


# ------------------------------------------------------------------------------------------------ inputs


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([SEED, *key])


def make(rank: int, dtype: str, op: str, n: int, tag: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: small integers, so every reduction order gives the same exact result."""
    rng = _rng(rank, DTYPES.index(dtype), OPS.index(op), n, tag)
    if dtype == "bool":
        return rng.random(n) < (0.8 if op in (MIN, PRODUCT) else 0.2)
    if op == PRODUCT:
        vals = rng.choice([1, 2], size=n) if dtype == "uint8" else rng.choice([-2, -1, 1, 2], size=n)
    elif op == SUM:
        vals = rng.integers(0, 30, size=n) if dtype == "uint8" else rng.integers(-30, 30, size=n)
    else:
        vals = rng.integers(0, 200, size=n) if dtype == "uint8" else rng.integers(-1000, 1000, size=n)
    return vals.astype(dtype)


def reduce_np(arrays, op: str) -> np.ndarray:
    stack = np.stack(arrays)
    if stack.dtype == np.bool_:
        return stack.any(axis=0) if op in (SUM, MAX) else stack.all(axis=0)
    fn = {SUM: np.sum, MIN: np.min, MAX: np.max, PRODUCT: np.prod}[op]
    return fn(stack, axis=0).astype(stack.dtype)


def digest(a: np.ndarray) -> str:
    return f"{a.dtype}:{a.size}:" + hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:24]


def gather_counts(n: int, tag: int, scale: int) -> list:
    rng = _rng(99, n, tag)
    counts = list(rng.integers(0, scale, size=n))
    if n > 1:
        counts[int(rng.integers(0, n))] = 0  # some rank contributes nothing
    return [int(c) for c in counts]


def a2a_matrix(n: int, tag: int, scale: int) -> np.ndarray:
    """``m[i, j]``: elements rank i sends to rank j."""
    m = _rng(7, n, tag).integers(0, scale, size=(n, n))
    if n > 1:
        m[0, n - 1] = 0
    return m


def a2a_block(src: int, dst: int, count: int, dtype: str) -> np.ndarray:
    return (np.arange(count) % 97 + 1000 * src + 100 * dst).astype(dtype) if dtype != "bool" else \
        (np.arange(count) + src + dst) % 3 == 0


# ---------------------------------------------------------------------------------------- worker suites


def conformance(t, sizes, dtypes, ops, gather_scale, a2a_scale):
    """Every collective over the given cases; returns ``{case: digest}`` (plus float arrays)."""
    r, n = t.rank, t.size
    out = {}
    for dt in dtypes:
        for op in ops:
            for sz in sizes:
                a = make(r, dt, op, sz)
                t.allreduce(a, op)
                out[("allreduce", dt, op, sz)] = digest(a)
    for sz in sizes:  # non-integer floats: tolerance vs numpy, and bitwise agreement across ranks
        f = _rng(r, sz, 5).standard_normal(sz).astype(np.float32)
        t.allreduce(f, SUM)
        out[("allreduce-float", sz)] = f
    for tag, dt in enumerate(dtypes):
        counts = gather_counts(n, tag, gather_scale)
        send = make(r, dt, SUM, counts[r], tag=1)
        recv = np.empty(sum(counts), dtype=dt)
        t.allgatherv(send, recv, counts)
        out[("allgatherv", dt)] = digest(recv)
    for root in range(n):
        for sz in sizes:
            for dt in ("float64", "uint8", "bool"):
                b = make(r, dt, MAX, sz, tag=2) if r == root else np.zeros(sz, dtype=dt)
                t.broadcast(b, root)
                out[("broadcast", root, dt, sz)] = digest(b)
    for tag, dt in enumerate(("float32", "int64", "uint8", "bool")):
        m = a2a_matrix(n, tag, a2a_scale)
        send = np.concatenate([a2a_block(r, j, int(m[r, j]), dt) for j in range(n)])
        recv = np.empty(int(m[:, r].sum()), dtype=dt)
        t.alltoallv(send, [int(c) for c in m[r]], recv, [int(c) for c in m[:, r]])
        out[("alltoallv", dt)] = digest(recv)
    for tag, dt in enumerate(dtypes):
        for op in ops:
            counts = gather_counts(n, tag + 10, gather_scale)
            send = make(r, dt, op, sum(counts), tag=3)
            recv = np.empty(counts[r], dtype=dt)
            t.reducescatter(send, recv, counts, op)
            out[("reducescatter", dt, op)] = digest(recv)
    for sz in sizes:
        s = make(r, "int32", SUM, sz, tag=4)
        got = np.empty(sz, dtype="int32")
        t.sendrecv(s, (r + 1) % n, got, (r - 1) % n)
        out[("sendrecv", sz)] = digest(got)
        if n > 1:  # one-sided: even ranks send to the next, odd ranks receive from the previous
            if r % 2 == 0 and r + 1 < n:
                t.sendrecv(s, r + 1, None, None)
            elif r % 2 == 1:
                t.sendrecv(None, None, got, r - 1)
                out[("send-only", sz)] = digest(got)
    for _ in range(3):
        t.barrier()
    return out


def expected_conformance(n, sizes, dtypes, ops, gather_scale, a2a_scale):
    """What :func:`conformance` must return on rank r, as ``[{case: expected}]`` per rank."""
    exp = [dict() for _ in range(n)]
    for dt in dtypes:
        for op in ops:
            for sz in sizes:
                d = digest(reduce_np([make(q, dt, op, sz) for q in range(n)], op))
                for r in range(n):
                    exp[r][("allreduce", dt, op, sz)] = d
    for sz in sizes:
        f = np.sum(np.stack([_rng(q, sz, 5).standard_normal(sz).astype(np.float32) for q in range(n)]), axis=0)
        for r in range(n):
            exp[r][("allreduce-float", sz)] = f
    for tag, dt in enumerate(dtypes):
        counts = gather_counts(n, tag, gather_scale)
        d = digest(np.concatenate([make(q, dt, SUM, counts[q], tag=1) for q in range(n)]))
        for r in range(n):
            exp[r][("allgatherv", dt)] = d
    for root in range(n):
        for sz in sizes:
            for dt in ("float64", "uint8", "bool"):
                d = digest(make(root, dt, MAX, sz, tag=2))
                for r in range(n):
                    exp[r][("broadcast", root, dt, sz)] = d
    for tag, dt in enumerate(("float32", "int64", "uint8", "bool")):
        m = a2a_matrix(n, tag, a2a_scale)
        for r in range(n):
            blocks = [a2a_block(q, r, int(m[q, r]), dt) for q in range(n)]
            exp[r][("alltoallv", dt)] = digest(np.concatenate(blocks).astype(dt))
    for tag, dt in enumerate(dtypes):
        for op in ops:
            counts = gather_counts(n, tag + 10, gather_scale)
            total = reduce_np([make(q, dt, op, sum(counts), tag=3) for q in range(n)], op)
            offs = alg.offsets(counts)
            for r in range(n):
                exp[r][("reducescatter", dt, op)] = digest(total[offs[r]:offs[r] + counts[r]])
    for sz in sizes:
        for r in range(n):
            exp[r][("sendrecv", sz)] = digest(make((r - 1) % n, "int32", SUM, sz, tag=4))
            if n > 1 and r % 2 == 1:
                exp[r][("send-only", sz)] = digest(make(r - 1, "int32", SUM, sz, tag=4))
    return exp


def check(results, expected):
    assert len(results) == len(expected)
    bad = []
    for r, (got, exp) in enumerate(zip(results, expected)):
        assert set(got) == set(exp), f"rank {r}: cases differ: {set(got) ^ set(exp)}"
        for case, e in exp.items():
            g = got[case]
            if isinstance(e, np.ndarray):
                if not np.allclose(g, e, rtol=1e-5, atol=1e-5):
                    bad.append(f"rank {r} {case}: max error {np.max(np.abs(g - e))}")
                elif digest(g) != digest(results[0][case]):
                    bad.append(f"rank {r} {case}: result not bitwise identical to rank 0's")
            elif g != e:
                bad.append(f"rank {r} {case}: got {g}, expected {e}")
    assert not bad, f"{len(bad)} mismatches, first ones:\n" + "\n".join(bad[:15])


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_collectives_all_paths(np_):
    """Small thresholds: small and large algorithms, many pipeline segments, every dtype and op."""
    cases = (SIZES, DTYPES, OPS, 3000, 2500)
    res = values(run_world(np_, conformance, cases, options=SMALL_OPTS, timeout=90))
    check(res, expected_conformance(np_, *cases))


@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_large_default_options(np_):
    """Default thresholds (64 KiB / 1 MiB segments) with buffers of a few MB that cross segment boundaries."""
    cases = ((1 << 20) + 3, 9), ("float32", "int64"), (SUM, MAX), 700_000, 300_000
    res = values(run_world(np_, conformance, cases, timeout=90))
    check(res, expected_conformance(np_, *cases))


def _finish_job(t, sizes):
    """allreduce_into with a finish (Average's division, with and without a postscale), in place and not."""
    from horovod.engine import ops

    out = {}
    for dtype in ("float32", "float64", "int32"):
        for n in sizes:
            for post in (1.0, 0.5):
                finish = ops.Finish(post, t.size)
                buf = make(t.rank, dtype, SUM, n)
                t.allreduce_into(buf, buf, SUM, finish)
                fresh = np.empty(n, dtype)
                t.allreduce_into(make(t.rank, dtype, SUM, n), fresh, SUM, finish)
                out[(dtype, n, post)] = (digest(buf), digest(fresh))
    return out


@pytest.mark.parametrize("np_,options", [(1, SMALL_OPTS), (2, SMALL_OPTS), (3, SMALL_OPTS), (4, SMALL_OPTS),
                                         (3, None)])
def test_allreduce_finish_matches_finishing_afterwards(np_, options):
    """The ring finishes each block on its owner before passing it on; the result must be the same bits as
    reducing and then finishing the whole buffer (small buffers: recursive doubling, then the finish)."""
    from horovod.engine import ops

    sizes = (0, 1, 7, 3001, 70001) if options else ((1 << 20) + 3,)
    res = values(run_world(np_, _finish_job, (sizes,), options=options, timeout=90))
    for dtype in ("float32", "float64", "int32"):
        for n in sizes:
            total = reduce_np([make(q, dtype, SUM, n) for q in range(np_)], SUM)
            for post in (1.0, 0.5):
                want = total.copy()
                ops.Finish(post, np_)(want)
                for r, got in enumerate(res):
                    assert got[(dtype, n, post)] == (digest(want), digest(want)), (r, dtype, n, post)


def test_spawned_processes():
    """The transport works in freshly spawned interpreters too (nothing relies on fork)."""
    cases = ((0, 5, 30000), ("float64",), (SUM,), 40000, 20000)
    res = values(run_world(2, conformance, cases, launcher="subprocess", options=SMALL_OPTS, timeout=60))
    check(res, expected_conformance(2, *cases))


def subgroup_worker(t, groups):
    """Run collectives on nested subgroups, interleaved with world collectives, and report group digests."""
    out = {}
    w = t.rank
    for name, path in groups:
        # path: successive rank lists, each in the previous group's numbering.
        g, inside = t, True
        for ranks in path:
            if g.rank not in ranks:
                inside = False
                break
            g = g.subgroup(ranks)
        if inside:
            a = make(w, "float64", SUM, 5000)
            g.allreduce(a, SUM)
            big = make(w, "int32", MAX, 60001)
            g.allreduce(big, MAX)
            b = make(w, "uint8", MAX, 20000, tag=2) if g.rank == g.size - 1 else np.zeros(20000, "uint8")
            g.broadcast(b, g.size - 1)
            counts = [3000 + 11 * k for k in range(g.size)]
            recv = np.empty(sum(counts), dtype="int64")
            g.allgatherv(make(w, "int64", SUM, counts[g.rank], tag=1), recv, counts)
            g.barrier()
            out[name] = (g.rank, g.size, list(g.members), digest(a), digest(big), digest(b), digest(recv))
            g.close()  # a view: the world's connections stay open
        world = np.full(10, w, dtype=np.int64)
        t.allreduce(world, SUM)
        out[name + "/world"] = int(world[0])
    return out


@pytest.mark.parametrize("np_,groups", [
    (3, [("g02", [[0, 2]]), ("g12", [[1, 2]])]),
    (4, [("g123", [[1, 2, 3]]), ("g123/02", [[1, 2, 3], [0, 2]]), ("g0", [[0]]), ("g03", [[0, 3]])]),
])
def test_subgroups(np_, groups):
    res = values(run_world(np_, subgroup_worker, (groups,), options={"small_message_bytes": 4096,
                                                                     "tcp_chunk_bytes": 16384}, timeout=60))
    for name, path in groups:
        members = list(range(np_))
        for ranks in path:
            members = [members[g] for g in ranks]
        exp = (digest(reduce_np([make(w, "float64", SUM, 5000) for w in members], SUM)),
               digest(reduce_np([make(w, "int32", MAX, 60001) for w in members], MAX)),
               digest(make(members[-1], "uint8", MAX, 20000, tag=2)),
               digest(np.concatenate([make(w, "int64", SUM, 3000 + 11 * k, tag=1) for k, w in enumerate(members)])))
        for w in range(np_):
            assert res[w][name + "/world"] == sum(range(np_))
            if w in members:
                assert res[w][name] == (members.index(w), len(members), members) + exp, (name, w)
            else:
                assert name not in res[w]


def lifecycle_worker(t):
    """Argument checks, close() idempotence, and errors after close."""
    errors = []
    with pytest.raises(ValueError):
        t.subgroup([t.rank, t.size])
    if t.size > 1:
        with pytest.raises(ValueError):
            t.subgroup([(t.rank + 1) % t.size])
    with pytest.raises(ValueError):
        t.allgatherv(np.zeros(1), np.zeros(0), [1] * t.size)
    sub = t.subgroup([t.rank])
    a = np.arange(4.0)
    sub.allreduce(a)
    sub.close()
    sub.close()
    try:
        sub.allreduce(a)
        errors.append("closed subgroup still usable")
    except TransportError:
        pass
    t.barrier()
    t.close()
    t.close()
    for call in (lambda: t.allreduce(np.ones(3)), t.barrier):
        try:
            call()
            if t.size > 1:
                errors.append("closed transport still usable")
        except TransportError as exc:
            if "closed" not in str(exc):
                errors.append(f"unclear error after close: {exc}")
    return errors


@pytest.mark.parametrize("np_", [1, 3])
def test_lifecycle(np_):
    assert values(run_world(np_, lifecycle_worker, timeout=30)) == [[]] * np_


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
