"""Two threads of one rank calling a blocking collective with the same name (issue 38, E3).

Was: the second call failed with "a collective with that name is still in progress" only where it overlapped the
first; where the first had already finished (the shm fast lane finishes a tiny allreduce in microseconds, but TCP
too), it ran as a new collective. The ranks then disagreed on how many collectives of that name there were and the
job hung, silently, on every transport. Now a blocking call whose name another thread has in flight waits for it
and runs as the next collective of that name, so every rank runs the same collectives whatever the timing; an
asynchronous call with a name in flight still fails at once (it cannot wait: it must return a handle).
"""
from __future__ import annotations

import pytest

from engine_helpers import run, transport_skip_reason


def racing_threads_worker(rounds: int) -> dict:
    """Each round, two threads released together call ``allreduce(name=f"same{i}")``; every call must return the
    right sum and no thread may be left waiting."""
    import threading

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    problems = []
    for i in range(rounds):
        start = threading.Barrier(2)
        results: dict = {}

        def call(who: str, i: int = i, start: threading.Barrier = start, results: dict = results) -> None:
            start.wait()
            try:
                results[who] = hvd.allreduce(np.full(4, rank + 1, np.float32), op=hvd.Sum, name=f"same{i}").tolist()
            except Exception as exc:  # noqa: BLE001  (the outcome is what is checked)
                results[who] = f"{type(exc).__name__}: {exc}"

        threads = [threading.Thread(target=call, args=(who,), daemon=True) for who in "AB"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        hung = [who for who, t in zip("AB", threads) if t.is_alive()]
        want = [size * (size + 1) / 2] * 4
        if hung or any(results.get(who) != want for who in "AB"):
            problems.append(f"round {i}: hung {hung}, results {results}")
            break   # a thread is stuck: the job cannot go on
        hvd.allreduce(np.zeros(1, np.float32), name=f"sync{i}")
    hvd.shutdown()
    return {"problems": problems}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_two_threads_with_the_same_name_never_hang(transport):
    reason = transport_skip_reason(transport)
    if reason:
        pytest.skip(reason)
    results = run(racing_threads_worker, 2, transport, args=(20,), timeout=300,
                  env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"})
    for rank, out in enumerate(results):
        assert not out["problems"], f"rank {rank}: {out['problems']}"


def async_duplicate_worker() -> dict:
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank = hvd.rank()
    out = {}
    # Rank 0 submits "dup" before the broadcast the others wait for, so "dup" is surely still in flight there.
    if rank == 0:
        first = hvd.allreduce_async(np.ones(2, np.float32), name="dup")
        try:
            hvd.allreduce_async(np.ones(2, np.float32), name="dup")
            out["second"] = "accepted"
        except ValueError as exc:
            out["second"] = str(exc)
    hvd.broadcast(np.ones(1, np.float32), 0, name="go")
    if rank != 0:
        first = hvd.allreduce_async(np.ones(2, np.float32), name="dup")
    out["first"] = hvd.synchronize(first).tolist()
    hvd.shutdown()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_asynchronous_duplicate_still_fails_at_once(transport):
    reason = transport_skip_reason(transport)
    if reason:
        pytest.skip(reason)
    results = run(async_duplicate_worker, 2, transport, timeout=120)
    assert "still in progress" in results[0]["second"], results[0]
    assert all(out["first"] == [1.0, 1.0] for out in results), results
