"""A lone asynchronous collective held a moment for its caller (horovod/engine/hold.py): waited for at once it
takes the fast lane as a blocking call does; issued before other work, or not waited for within the hold, it goes
the coordinator's way. Every result against numpy on real processes, with the lane's counts read, so that a hold
that never engages (or engages where it must not) fails.
"""
from __future__ import annotations

import pytest

from engine_helpers import assert_no_failures, run, transport_skip_reason


def held_worker(scenario: str) -> dict:
    import time

    import numpy as np

    import horovod.numpy as hvd
    from checks import Checks
    from horovod.common import basics

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = Checks(rank, rtol=1e-6)
    lane = basics.runtime().state.lane
    before = (lane.fast, lane.slow)
    calls = 0
    if scenario in ("at_once", "at_once_off"):
        # every kind the lane carries, started asynchronously and waited for at once
        for i in range(10):
            x = np.full(7, rank + i, np.float32)
            checks.close(hvd.synchronize(hvd.allreduce_async(x, name="ar", op=hvd.Sum)),
                         np.full(7, sum(range(size)) + size * i, np.float32), f"allreduce {i}")
            inplace = np.full(3, float(rank), np.float64)
            hvd.synchronize(hvd.allreduce_async_(inplace, name="ar_", op=hvd.Average))
            checks.close(inplace, np.full(3, sum(range(size)) / size), f"allreduce_ average {i}")
            root = i % size
            got = hvd.synchronize(hvd.broadcast_async(np.arange(4) * (rank + 1), root_rank=root, name="bc"))
            checks.equal(got, np.arange(4) * (root + 1), f"broadcast {i}")
            got = hvd.synchronize(hvd.allgather_async(np.full((rank + 1, 2), rank, np.int32), name="ag"))
            checks.equal(got, np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(size)]),
                         f"allgather {i}")
            got = hvd.synchronize(hvd.reducescatter_async(np.ones((2 * size, 2), np.float32) * (rank + 1), name="rs",
                                                          op=hvd.Sum))
            checks.close(got, np.full((2, 2), sum(range(1, size + 1)), np.float32), f"reducescatter {i}")
            out, received = hvd.synchronize(hvd.alltoall_async(np.full((size, 1), rank, np.int64), name="a2a"))
            checks.equal(out, np.arange(size).reshape(size, 1), f"alltoall {i}")
            # larger than the board: agreed on the lane, carried by the data plane
            big = np.full(200_000, float(rank), np.float32)
            hvd.synchronize(hvd.allreduce_async_(big, name="big", op=hvd.Sum))
            checks.close(big[:5], np.full(5, float(sum(range(size))), np.float32), f"800 KB allreduce {i}")
            calls += 7
    elif scenario == "overlap":
        # rank 0 computes for much longer than the hold before it waits: every rank's call goes the coordinator's
        # way and completes, waited for or not
        for i in range(5):
            handle = hvd.allreduce_async(np.full(4, rank * 10.0 + i), name="ov", op=hvd.Sum)
            if rank == 0:
                time.sleep(0.05)
                deadline = time.monotonic() + 30
                while not hvd.poll(handle) and time.monotonic() < deadline:   # nobody waits: it completes anyway
                    time.sleep(0.001)
                checks.true(hvd.poll(handle), f"call {i} completed without a wait")
            checks.close(hvd.synchronize(handle), np.full(4, 10.0 * sum(range(size)) + size * i), f"overlap {i}")
            calls += 1
    elif scenario == "then_another":
        # a held call, then another call before the wait: the held one is numbered first; waits in reverse order
        for i in range(10):
            first = hvd.allreduce_async(np.full(2, float(rank + i)), name="first", op=hvd.Sum)
            second = hvd.allgather_async(np.full((1, 3), rank, np.int32), name="second")
            checks.equal(hvd.synchronize(second), np.repeat(np.arange(size, dtype=np.int32), 3).reshape(size, 3),
                         f"second {i}")
            checks.close(hvd.synchronize(first), np.full(2, float(sum(range(size)) + size * i)), f"first {i}")
            blocking = hvd.allreduce(np.ones(1), name="after", op=hvd.Sum)
            checks.close(blocking, np.full(1, float(size)), f"blocking after {i}")
            calls += 3
    fast, slow = lane.fast - before[0], lane.slow - before[1]
    hvd.shutdown()
    return {"checks": checks.report(), "fast": fast, "slow": slow, "calls": calls}


def _skip_without(transport: str) -> None:
    if transport_skip_reason(transport):
        pytest.skip(transport_skip_reason(transport))


@pytest.mark.parametrize("transport,np_", [("shm", 2), ("shm", 3), ("shm", 4), ("tcp", 2), ("tcp", 3)])
def test_an_asynchronous_call_waited_for_at_once_takes_the_lane(transport, np_):
    _skip_without(transport)
    # a hold long enough that a loaded machine's caller always waits within it
    results = run(held_worker, np_, transport, args=("at_once",), timeout=300,
                  env={"HOROVOD_FAST_LANE_HOLD_US": "200000"})
    assert_no_failures([r["checks"] for r in results])
    for r in results:
        assert r["fast"] == results[0]["fast"], [(x["fast"], x["slow"]) for x in results]
        assert r["fast"] >= r["calls"] - 3, f"only {r['fast']} of {r['calls']} calls were decided fast"


def test_without_the_hold_asynchronous_calls_never_take_the_lane():
    _skip_without("shm")
    results = run(held_worker, 2, "shm", args=("at_once",), timeout=300, env={"HOROVOD_FAST_LANE_HOLD_US": "0"})
    assert_no_failures([r["checks"] for r in results])
    assert all(r["fast"] == 0 for r in results), [(r["fast"], r["slow"]) for r in results]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_call_nobody_waits_for_completes_when_its_hold_ends(transport):
    _skip_without(transport)
    results = run(held_worker, 3, transport, args=("overlap",), timeout=300,
                  env={"HOROVOD_FAST_LANE_HOLD_US": "2000"})
    assert_no_failures([r["checks"] for r in results])
    # rank 0 never proposes: its hold ends first; the others' proposals meet its slow entries
    assert results[0]["fast"] == 0 and results[0]["slow"] == 0, results[0]
    assert all(r["fast"] == 0 for r in results), [(r["fast"], r["slow"]) for r in results]


@pytest.mark.parametrize("transport,np_", [("shm", 2), ("shm", 4), ("tcp", 3)])
def test_a_held_call_is_numbered_before_the_next_call(transport, np_):
    _skip_without(transport)
    results = run(held_worker, np_, transport, args=("then_another",), timeout=300,
                  env={"HOROVOD_FAST_LANE_HOLD_US": "200000"})
    assert_no_failures([r["checks"] for r in results])
    for r in results:   # only the blocking call after each pair may be alone on the lane (when nothing lingers)
        assert r["fast"] <= 10, [(x["fast"], x["slow"]) for x in results]
