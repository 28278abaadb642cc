"""The fast lane (horovod/engine/fast_lane.py): lone blocking collectives agreed on by the ranks themselves, on a
board in shared memory (the shm transport) or over TCP among log2(size) partners (the tcp transport, and across
hosts: horovod/engine/tcp_lane.py).

Every check compares with numpy on real processes, and reads how many proposals the lane decided fast, so that a
lane that silently never engages (or engages where it must not) fails. np = 3 over TCP has a rank past the largest
power of two, which reaches the others through a proxy.
"""
from __future__ import annotations

import pytest

from engine_helpers import assert_no_failures, capture_horovod_logs, run, transport_skip_reason


def _lane_counts():
    from horovod.common import basics

    lane = basics.runtime().state.lane
    return None if lane is None else (lane.fast, lane.slow)


def results_worker(scenario: str) -> dict:
    """Tiny allreduces of every dtype and op, mixed with other work; every result against numpy."""
    import os
    import threading

    import numpy as np

    import horovod.numpy as hvd
    from checks import Checks

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = Checks(rank, rtol=1e-6)
    ops = {"sum": (hvd.Sum, lambda xs: np.sum(xs, axis=0)), "min": (hvd.Min, lambda xs: np.min(xs, axis=0)),
           "max": (hvd.Max, lambda xs: np.max(xs, axis=0)), "prod": (hvd.Product, lambda xs: np.prod(xs, axis=0)),
           "avg": (hvd.Average, lambda xs: np.mean(xs, axis=0))}
    dtypes = ("float32", "float64", "float16", "int32", "int64", "uint8", "int8")

    def data(i, r, dtype, n):
        return (((np.arange(n) + 3 * r + i) % 5) + 1).astype(dtype)

    def round_(i, prefix=""):
        dtype = dtypes[i % len(dtypes)]
        label, (op, ref) = list(ops.items())[i % len(ops)]
        if label == "avg" and dtype not in ("float32", "float64", "float16"):
            label, (op, ref) = "sum", ops["sum"]
        n = 1 + i % 7
        got = hvd.allreduce(data(i, rank, dtype, n), name=f"{prefix}t{i % 11}", op=op)
        want = ref(np.stack([data(i, r, dtype, n).astype(np.float64) for r in range(size)])).astype(dtype)
        checks.close(got, want, f"{prefix}round {i}: {label} {dtype}[{n}]")

    if scenario == "plain":
        for i in range(300):
            round_(i)
        scaled = hvd.allreduce(np.full(3, rank + 1.0, np.float32), name="scaled", op=hvd.Sum, prescale_factor=0.5,
                               postscale_factor=3.0)
        checks.close(scaled, np.full(3, 1.5 * sum(range(1, size + 1)), np.float32), "pre- and postscale")
        inplace = np.full(4, float(rank), np.float64)
        hvd.allreduce_(inplace, name="inplace", op=hvd.Sum)
        checks.close(inplace, np.full(4, float(sum(range(size)))), "in place")
    elif scenario == "mixed":
        # asynchronous and large collectives between tiny blocking ones: proposals while others are in flight
        for i in range(60):
            handle = hvd.allreduce_async(np.full(5, float(rank), np.float32), name=f"async{i}", op=hvd.Sum)
            if rank % 2 == 0:
                round_(i)
                got_async = hvd.synchronize(handle)
            else:
                got_async = hvd.synchronize(handle)
                round_(i)
            checks.close(got_async, np.full(5, float(sum(range(size))), np.float32), f"async {i}")
            if i % 20 == 0:
                big = hvd.allreduce(np.full(300000, 1.0, np.float32), name="big", op=hvd.Sum)
                checks.close(big[:3], np.full(3, float(size), np.float32), f"big {i}")
                gathered = hvd.allgather(np.full((1, 2), rank, np.int64), name=f"ag{i}")
                checks.equal(gathered, np.repeat(np.arange(size), 2).reshape(size, 2), f"allgather {i}")
    elif scenario == "threads":
        # two threads of every rank issue tiny blocking allreduces at the same time, under distinct names
        workers = [threading.Thread(target=lambda p=p: [round_(i, prefix=p) for i in range(80)]) for p in "ab"]
        for w in workers:
            w.start()
        for w in workers:
            w.join(300)
        checks.true(not any(w.is_alive() for w in workers), "both threads finished")
    elif scenario == "join":
        # the last rank joins at once; the others keep reducing; joined ranks contribute zeros
        if rank != size - 1:
            for i in range(30):
                got = hvd.allreduce(np.full(2, 1.0, np.float32), name="j", op=hvd.Sum)
                checks.close(got, np.full(2, float(size - 1), np.float32), f"with a joined rank {i}")
        last = hvd.join()
        checks.true(0 <= last < size - 1, f"join returns the last joiner, one of the ranks that kept going: {last}")
        checks.close(hvd.allreduce(np.ones(1, np.float32), name="after_join", op=hvd.Sum),
                     np.full(1, float(size), np.float32), "after everyone joined")
    elif scenario == "subset":
        # a process set without rank 0: the coordinator serves it, so nobody's proposal may be decided fast while
        # it exists on rank 0... but every result stays right
        others = hvd.add_process_set(list(range(1, size)))
        for i in range(20):
            round_(i)
            if rank > 0:
                got = hvd.allreduce(np.full(2, float(rank), np.float32), name="sub", op=hvd.Sum, process_set=others)
                checks.close(got, np.full(2, float(sum(range(1, size))), np.float32), f"subset {i}")
        hvd.remove_process_set(others)
        for i in range(20):
            round_(i, prefix="after")
    counts = _lane_counts()
    hvd.shutdown()
    return {"checks": checks.report(), "lane": counts, "off": os.environ.get("HOROVOD_FAST_LANE")}


def _skip_without(transport: str) -> None:
    if transport_skip_reason(transport):
        pytest.skip(transport_skip_reason(transport))


@pytest.mark.parametrize("transport,np_", [("shm", 2), ("shm", 3), ("shm", 4), ("tcp", 2), ("tcp", 3), ("tcp", 4)])
def test_fast_lane_results_match_numpy_and_engage(transport, np_):
    _skip_without(transport)
    results = run(results_worker, np_, transport, args=("plain",), timeout=300)
    assert_no_failures([r["checks"] for r in results])
    for rank, r in enumerate(results):
        fast, slow = r["lane"]
        # every rank agreed on the same fast decisions (a fast one needs every rank's proposal; a rank whose other
        # thread was driving at that moment posts a slow entry instead of proposing, so slow counts may differ);
        # nearly all of the 300 tiny calls skip the coordinator
        assert fast == results[0]["lane"][0], (rank, r["lane"], results[0]["lane"])
        assert fast >= 250, f"rank {rank}: only {fast} of 302 tiny allreduces were decided fast ({slow} slow)"


@pytest.mark.parametrize("scenario", ["mixed", "threads", "join", "subset"])
@pytest.mark.parametrize("transport,np_", [("shm", 2), ("shm", 3), ("tcp", 3)])
def test_fast_lane_with_other_work(scenario, transport, np_):
    _skip_without(transport)
    results = run(results_worker, np_, transport, args=(scenario,), timeout=300,
                  env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert_no_failures([r["checks"] for r in results])


def test_fast_lane_off_on_one_rank_decides_everything_slow():
    _skip_without("shm")
    results = run(results_worker, 3, "shm", args=("plain",), timeout=300,
                  rank_env_overrides={1: {"HOROVOD_FAST_LANE": "0"}})
    assert_no_failures([r["checks"] for r in results])
    assert results[1]["lane"] is None
    for rank in (0, 2):
        fast, slow = results[rank]["lane"]
        assert fast == 0, (rank, results[rank]["lane"])   # its closed board keeps everyone off the lane


def test_fast_lane_off_on_one_rank_over_tcp_is_off_everywhere():
    """Over TCP the ranks agree at init whether to connect the lane at all: one rank without it means none."""
    results = run(results_worker, 3, "tcp", args=("plain",), timeout=300,
                  rank_env_overrides={1: {"HOROVOD_FAST_LANE": "0"}})
    assert_no_failures([r["checks"] for r in results])
    assert all(r["lane"] is None for r in results), [r["lane"] for r in results]


def sizes_worker() -> dict:
    """Allreduces of 4 KiB, of the lane's limit and of just past it, with the lane counts read after each size."""
    import numpy as np

    import horovod.numpy as hvd
    from checks import Checks
    from horovod.common import basics

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = Checks(rank, rtol=1e-6)
    limit = basics.runtime().state.lane.limit
    decided = {}
    for label, nbytes in (("4K", 4096), ("limit", limit), ("past", limit + 4)):
        before = _lane_counts()
        for i in range(10):
            x = (np.arange(nbytes // 4) % 7 + rank + i).astype(np.float32)
            got = hvd.allreduce(x, name=f"s{nbytes}", op=hvd.Sum)
            want = sum((np.arange(nbytes // 4) % 7 + r + i).astype(np.float32) for r in range(size))
            checks.close(got, want, f"{nbytes} bytes, call {i}")
        after = _lane_counts()
        decided[label] = (after[0] - before[0], after[1] - before[1])
    hvd.shutdown()
    return {"checks": checks.report(), "decided": decided, "limit": limit}


@pytest.mark.parametrize("transport,np_", [("shm", 2), ("shm", 4), ("tcp", 2)])
def test_fast_lane_takes_allreduces_up_to_its_limit(transport, np_):
    """A lone blocking allreduce of up to HOROVOD_FAST_LANE_BYTES (256 KiB), and 512 KiB over every rank's payload
    (each rank reads them all), is decided and carried out on the lane in one synchronisation; one of 4 bytes more
    is agreed there and carried by the data plane. Results against numpy either way."""
    _skip_without(transport)
    results = run(sizes_worker, np_, transport, timeout=300)
    assert_no_failures([r["checks"] for r in results])
    for r in results:
        assert r["limit"] == {2: 256 * 1024, 4: 128 * 1024}[np_], r["limit"]   # (the allreduce's limit)
        # up to the limit on the board, past it agreed on the lane and carried by the data plane
        assert all(r["decided"][size][0] >= 8 for size in ("4K", "limit", "past")), r["decided"]


def test_fast_lane_limit_is_a_knob():
    _skip_without("shm")
    results = run(sizes_worker, 2, "shm", timeout=300, env={"HOROVOD_FAST_LANE_BYTES": "1024"})
    assert_no_failures([r["checks"] for r in results])
    for r in results:
        assert r["limit"] == 1024 and r["decided"]["4K"][0] >= 8, r   # agreed on the lane, data off the board


def moves_worker() -> dict:
    """Allgathers, broadcasts, alltoalls and reducescatters whose payload is the lane's limit for their kind (larger
    than an allreduce's) and just past it."""
    import numpy as np

    import horovod.numpy as hvd
    from checks import Checks
    from horovod.common import basics
    from horovod.engine import ops

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = Checks(rank, rtol=1e-6)
    limits = basics.runtime().state.lane.limits
    before = _lane_counts()
    for label, extra in (("limit", 0), ("past", 1)):
        for i in range(3):
            # float32 rows of one element, counted from each kind's limit on the payload a rank posts
            rows = limits[ops.ALLGATHER] // 4 + extra
            mine = np.arange(rows, dtype=np.float32) + 1000 * rank + i
            want = np.concatenate([np.arange(rows, dtype=np.float32) + 1000 * r + i for r in range(size)])
            checks.equal(hvd.allgather(mine, name="ag"), want, f"allgather {label} {i}")
            rows = limits[ops.BROADCAST] // 4 + extra
            buf = np.arange(rows, dtype=np.float32) * (rank + 1) + i
            hvd.broadcast_(buf, root_rank=size - 1, name="bc")
            checks.equal(buf, np.arange(rows, dtype=np.float32) * size + i, f"broadcast {label} {i}")
            block = limits[ops.ALLTOALL] // 4 // size + extra
            send = (np.arange(block * size, dtype=np.float32) + 100 * rank + i).reshape(-1, 1)
            want = np.concatenate([np.arange(rank * block, (rank + 1) * block, dtype=np.float32) + 100 * r + i
                                   for r in range(size)]).reshape(-1, 1)
            checks.equal(hvd.alltoall(send, name="a2a"), want, f"alltoall {label} {i}")
            block = limits[ops.REDUCESCATTER] // 4 // size + extra
            x = np.arange(block * size, dtype=np.float32) + rank + i
            full = sum(np.arange(block * size, dtype=np.float32) + r + i for r in range(size))
            checks.close(hvd.reducescatter(x, name="rs", op=hvd.Sum), full[rank * block:(rank + 1) * block],
                         f"reducescatter {label} {i}")
    after = _lane_counts()
    hvd.shutdown()
    return {"checks": checks.report(), "fast": after[0] - before[0], "limits": dict(limits)}


@pytest.mark.parametrize("transport,np_", [("shm", 2), ("shm", 4), ("tcp", 2)])
def test_each_kind_takes_the_lane_up_to_its_own_limit(transport, np_):
    """An allgather, a broadcast, an alltoall (its splits included) or a reducescatter up to the lane's whole payload
    area (1 MiB on shm, 256 KiB over TCP), an allreduce up to 512 KiB over every rank's payload: results against numpy
    on both sides of each limit, every call decided on the lane (on the board, or agreed there for the data
    plane)."""
    from horovod.engine import ops

    _skip_without(transport)
    results = run(moves_worker, np_, transport, timeout=300)
    assert_no_failures([r["checks"] for r in results])
    area = {"shm": 1024 * 1024, "tcp": 256 * 1024}[transport]
    # (on shm the records have room for an alltoall's splits beyond the 1 MiB; over TCP they count against it)
    alltoall = {"shm": area, "tcp": area - 8 * np_}[transport]
    for r in results:
        assert r["limits"] == {ops.ALLREDUCE: min(area, 512 * 1024 // np_), ops.ALLGATHER: area,
                               ops.BROADCAST: area, ops.ALLTOALL: alltoall, ops.REDUCESCATTER: area}, r["limits"]
        assert r["fast"] >= 24, r


def kinds_worker() -> dict:
    """Broadcasts (from each root, in place and not), allgathers (ranks with different rows), reducescatters
    (uneven blocks) and alltoalls (uneven splits) on the lane."""
    import numpy as np

    import horovod.numpy as hvd
    from checks import Checks

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = Checks(rank, rtol=1e-6)
    before = _lane_counts()
    for i in range(12):
        root = i % size
        value = np.arange(6, dtype=np.float64).reshape(2, 3) * (rank + 1) + i
        got = hvd.broadcast(value, root_rank=root, name=f"b{root}")
        checks.equal(got, np.arange(6, dtype=np.float64).reshape(2, 3) * (root + 1) + i, f"broadcast {i}")
        inplace = np.full(1000, rank + i, np.int32)   # 4,000 bytes
        hvd.broadcast_(inplace, root_rank=root, name=f"bi{root}")
        checks.equal(inplace, np.full(1000, root + i, np.int32), f"broadcast_ {i}")
        rows = np.full((rank + 1, 2), rank * 10 + i, np.int64)
        gathered = hvd.allgather(rows, name="g")
        want = np.concatenate([np.full((r + 1, 2), r * 10 + i, np.int64) for r in range(size)])
        checks.equal(gathered, want, f"allgather {i}")
        empty = hvd.allgather(np.zeros((0 if rank == 0 else 1, 3), np.float32), name="ge")
        checks.equal(empty, np.zeros((size - 1, 3), np.float32), f"allgather with no rows on rank 0, {i}")
        # 5 rows over 2 or 3 ranks: uneven blocks, the first ranks get one more
        def contribution(r):
            return np.arange(15, dtype=np.float32).reshape(5, 3) * (r + 1) + i
        total = sum(contribution(r) for r in range(size))
        bounds = np.cumsum([0] + [5 // size + (1 if r < 5 % size else 0) for r in range(size)])
        mine = total[bounds[rank]:bounds[rank + 1]]
        got = hvd.reducescatter(contribution(rank), name="rs", op=hvd.Sum)
        checks.equal(got, mine, f"reducescatter sum {i}")
        got = hvd.reducescatter(contribution(rank), name="rsa", op=hvd.Average)
        checks.close(got, mine / size, f"reducescatter average {i}")
        # alltoall, uneven: rank r sends q + r + (i % 2) rows to rank q, each row [r, q, row index, i]
        def sent(r, q):
            return np.array([[r, q, j, i] for j in range(q + r + i % 2)], np.int32).reshape(-1, 4)
        splits = [q + rank + i % 2 for q in range(size)]
        out, received = hvd.alltoall(np.concatenate([sent(rank, q) for q in range(size)]), splits=splits,
                                     name="a2a")
        checks.equal(out, np.concatenate([sent(r, rank) for r in range(size)]), f"alltoall {i}")
        checks.equal(np.asarray(received), np.array([rank + r + i % 2 for r in range(size)], np.int32),
                     f"received {i}")
        even = hvd.alltoall(np.full((2 * size, 2), rank, np.float64), name="a2a_even")
        checks.equal(even, np.repeat(np.arange(size, dtype=np.float64), 2 * 2).reshape(2 * size, 2),
                     f"even alltoall {i}")
    after = _lane_counts()
    hvd.shutdown()
    return {"checks": checks.report(), "fast": after[0] - before[0]}


@pytest.mark.parametrize("board_bytes", ["default", "64"])
@pytest.mark.parametrize("transport,np_", [("shm", 2), ("shm", 3), ("tcp", 3)])
def test_fast_lane_carries_every_kind_of_collective(transport, np_, board_bytes):
    """On the board (the default limit), and, with a limit of 64 bytes, most of them agreed on the lane and
    carried by the data plane (an allgather's rows and an alltoall's splits travel on the board then)."""
    _skip_without(transport)
    env = {} if board_bytes == "default" else {"HOROVOD_FAST_LANE_BYTES": board_bytes}
    results = run(kinds_worker, np_, transport, timeout=300, env=env)
    assert_no_failures([r["checks"] for r in results])
    for r in results:
        # nearly all of the 96 calls; with 64 bytes on the board an uneven alltoall may be on the board on one rank
        # and off it on another (at np = 2 those of odd rounds, at np = 3 of even ones), so it takes the
        # coordinator's way (6 of them), and at np = 3 on 2 cores a busy rank makes 10-20 more slow (70-84 seen)
        assert r["fast"] >= (85 if board_bytes == "default" else 60), r


def grouped_worker() -> dict:
    """Grouped allreduces on the lane, against numpy: a group of one tensor (as TensorFlow's gradients packed into
    one bucket) is a lone call; a group of several that share a dtype travels as one payload; a group of mixed
    dtypes, or one too large for the board, keeps the coordinator's way. Collectives after each check that every
    rank still numbers the lane alike (a group is one number)."""
    import numpy as np

    import horovod.numpy as hvd
    from checks import Checks

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = Checks(rank, rtol=1e-6)
    total = float(sum(range(1, size + 1)))
    counts = {}

    def lone(i, label):
        before = _lane_counts()[0]
        got = hvd.allreduce(np.full(3, rank + 1.0), name=f"lone_{label}", op=hvd.Sum)
        checks.close(got, np.full(3, total), f"lone allreduce after {label} {i}")
        counts[f"{label} then lone"] = counts.get(f"{label} then lone", 0) + _lane_counts()[0] - before

    for label, rounds in (("one", 20), ("several", 20), ("staggered", 5), ("mixed", 5), ("large", 5)):
        before, lone_before = _lane_counts()[0], counts.get(f"{label} then lone", 0)
        for i in range(rounds):
            if label == "one":
                (got,) = hvd.grouped_allreduce([np.full(7, rank + 1.0, np.float32)], name="one", op=hvd.Sum)
                checks.close(got, np.full(7, total, np.float32), f"group of one {i}")
                inplace = [np.full(3, rank + 1 + i, np.int64)]
                hvd.grouped_allreduce_(inplace, name="one_inplace", op=hvd.Sum)
                checks.equal(inplace[0], np.full(3, total + size * i, np.int64), f"group of one, in place {i}")
            elif label == "several":
                a, b, c = hvd.grouped_allreduce([np.full((2, 3), rank + 1.0, np.float32), np.full(5, -(rank + i),
                                                 np.float32), np.arange(4, dtype=np.float32) * rank],
                                                name="several", op=hvd.Average, postscale_factor=2.0)
                checks.close(a, np.full((2, 3), 2 * total / size, np.float32), f"group of three, first {i}")
                checks.close(b, np.full(5, -2 * (total - size + size * i) / size, np.float32),
                             f"group of three, second {i}")
                checks.close(c, np.arange(4, dtype=np.float32) * 2 * (total - size) / size,
                             f"group of three, third {i}")
                inplace = [np.full(2, rank + 1, np.int32), np.full(3, 10 * rank, np.int32)]
                hvd.grouped_allreduce_(inplace, name="several_inplace", op=hvd.Max)
                checks.equal(inplace[0], np.full(2, size, np.int32), f"group of two in place, first {i}")
                checks.equal(inplace[1], np.full(3, 10 * (size - 1), np.int32), f"group of two in place, second {i}")
            elif label == "staggered":
                # rank 0 issues the group while an asynchronous call is in flight (it cannot propose: it numbers
                # the group slow), the others after that call finished (they propose it)
                handle = hvd.allreduce_async(np.ones(2), name="pending", op=hvd.Sum)
                if rank:
                    hvd.synchronize(handle)
                a, b = hvd.grouped_allreduce([np.full(2, rank + 1.0), np.full(3, rank + 2.0)], name="staggered",
                                             op=hvd.Sum)
                if not rank:
                    hvd.synchronize(handle)
                checks.close(a, np.full(2, total), f"staggered group, first {i}")
                checks.close(b, np.full(3, total + size), f"staggered group, second {i}")
            elif label == "mixed":
                a, b = hvd.grouped_allreduce([np.full(2, rank + 1.0), np.full(5, -(rank + 1.0), np.float32)],
                                             name="mixed", op=hvd.Sum)
                checks.close(a, np.full(2, total), f"mixed group, float64 {i}")
                checks.close(b, np.full(5, -total, np.float32), f"mixed group, float32 {i}")
            else:
                a, b = hvd.grouped_allreduce([np.ones(40000, np.float32), np.ones(40000, np.float32)],
                                             name="large", op=hvd.Sum)   # 320 KB together: past the board
                checks.close(a[:3], np.full(3, float(size), np.float32), f"large group, first {i}")
                checks.close(b[-3:], np.full(3, float(size), np.float32), f"large group, second {i}")
            lone(i, label)
        counts[label] = _lane_counts()[0] - before - (counts[f"{label} then lone"] - lone_before)
    hvd.shutdown()
    return {"checks": checks.report(), "fast": counts}


@pytest.mark.parametrize("transport,np_", [("shm", 2), ("shm", 3), ("tcp", 3)])
def test_grouped_allreduces_take_the_lane(transport, np_):
    _skip_without(transport)
    results = run(grouped_worker, np_, transport, timeout=300)
    assert_no_failures([r["checks"] for r in results])
    for r in results:
        fast = r["fast"]
        # of 40 each (a busy rank may make a few slow)
        assert fast["one"] >= 32 and fast["several"] >= 32, r
        assert fast["mixed"] == 0 and fast["large"] == 0, r   # (the coordinator's way)
        # the lone calls after the groups stay on the lane (the one right after a staggered group is often slow:
        # rank 0 is still busy with what the coordinator ran, and on a loaded host so is one after a mixed or large
        # group now and then: a CI run saw 3 of 5); ranks that numbered a group on the lane differently would hang
        # instead
        assert all(fast[f"{label} then lone"] >= share * n for label, n, share in (
            ("one", 20, 0.8), ("several", 20, 0.8), ("mixed", 5, 0.6), ("large", 5, 0.6))), r


def dying_peer_worker() -> dict:
    import os
    import time

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    hvd.allreduce(np.ones(1, np.float32), name="warm")
    if hvd.rank() == 1:
        time.sleep(1.0)   # rank 0 is waiting on the lane by now
        os._exit(3)
    started = time.monotonic()
    try:
        hvd.allreduce(np.ones(1, np.float32), name="never")
        out = ("no error", False, "")
    except Exception as exc:  # noqa: BLE001
        out = (type(exc).__name__, isinstance(exc, hvd.HorovodInternalError), str(exc))
    return {"error": out, "seconds": time.monotonic() - started}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_peer_dying_during_a_lane_wait_fails_the_waiter_naming_it(transport):
    _skip_without(transport)
    results = run(dying_peer_worker, 2, transport, timeout=120, expect_failure=True,
                  env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "60"})
    status, out = results[0]
    assert status == "ok", out
    name, internal, text = out["error"]
    assert internal, f"{name}: {text}"
    assert "rank 1" in text, text
    # noticed through the peer's socket, not after the 60 s liveness timeout
    assert out["seconds"] < 30, out


def stalled_lane_worker(fifo_dir: str) -> dict:
    import os
    import time

    import numpy as np

    import horovod.numpy as hvd

    logs = capture_horovod_logs(wanted="One or more tensors were submitted")
    hvd.init()
    hvd.allreduce(np.ones(1, np.float32), name="warm")
    out = {}
    if hvd.rank() == 0:
        started = time.monotonic()
        try:
            hvd.allreduce(np.ones(1, np.float32), name="stalled_on_lane")
            out["error"] = ("no error", False, "")
        except Exception as exc:  # noqa: BLE001
            out["error"] = (type(exc).__name__, isinstance(exc, hvd.HorovodInternalError), str(exc))
        out["seconds"] = time.monotonic() - started
        out["log"] = logs.text
        with open(os.path.join(fifo_dir, "go"), "wb") as f:
            f.write(b"go")
    else:
        with open(os.path.join(fifo_dir, "go"), "rb") as f:   # outside Horovod until rank 0 gave up
            f.read()
        try:
            hvd.allreduce(np.ones(1, np.float32), name="stalled_on_lane")
            out["error"] = ("no error", False, "")
        except Exception as exc:  # noqa: BLE001
            out["error"] = (type(exc).__name__, isinstance(exc, hvd.HorovodInternalError), str(exc))
    hvd.shutdown()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_stall_on_the_lane_warns_then_fails_every_rank(tmp_path, transport):
    _skip_without(transport)
    import os

    os.mkfifo(tmp_path / "go")
    results = run(stalled_lane_worker, 2, transport, args=(str(tmp_path),), timeout=120,
                  env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    name, internal, text = results[0]["error"]
    assert name == "StallError" and internal and "stalled_on_lane" in text and "[1]" in text, (name, text)
    log = results[0]["log"]   # the original's stall warning, naming the lane's collective and the missing rank
    assert ("One or more tensors were submitted" in log and "'allreduce.stalled_on_lane'" in log
            and "ranks [1]" in log), log
    assert results[0]["seconds"] < 30, results[0]
    name, internal, text = results[1]["error"]
    assert internal, (name, text)   # the engine shut down on every rank, as the original's stall shutdown does
