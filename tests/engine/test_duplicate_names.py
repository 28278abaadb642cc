"""Two threads of one rank calling a blocking collective with the same name (issue 38, E3).

A name may be in flight only once per rank: the second call fails at once with a clear ``ValueError`` on every
transport (the duplicate check is in the engine's ``enqueue``, which the shm fast lane goes through too). When
the calls do not overlap on every rank alike (the first finished before the second started on one rank), the ranks
disagree on how many collectives of that name there are: that is a race in the program, and it ends in the stall
check's error, never in a silent hang.
"""
from __future__ import annotations

import pytest

from engine_helpers import run, transport_skip_reason


def overlapping_worker(late: int) -> dict:
    """Every rank but ``late`` starts two threads calling ``allreduce(name="same")`` at once; the first waits for
    rank ``late`` (which calls once, a moment later), so the second overlaps it on every such rank."""
    import threading
    import time

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    hvd.allreduce(np.zeros(1, np.float32), name="warmup")
    results: dict = {}

    def call(who: str) -> None:
        try:
            results[who] = hvd.allreduce(np.full(4, rank + 1, np.float32), op=hvd.Sum, name="same").tolist()
        except ValueError as exc:
            results[who] = f"ValueError: {exc}"

    if rank == late:
        time.sleep(1.0)
        call("A")
    else:
        threads = [threading.Thread(target=call, args=(who,), daemon=True) for who in "AB"]
        threads[0].start()
        time.sleep(0.2)   # A is in flight (rank ``late`` has not called yet) when B calls
        threads[1].start()
        for t in threads:
            t.join(60)
        results["hung"] = [t.name for t in threads if t.is_alive()]
    hvd.shutdown()
    return {"results": results, "want": [size * (size + 1) / 2] * 4}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_second_thread_with_the_same_name_gets_a_clear_error(transport):
    reason = transport_skip_reason(transport)
    if reason:
        pytest.skip(reason)
    late = 2
    results = run(overlapping_worker, 3, transport, args=(late,), timeout=120)
    for rank, out in enumerate(results):
        res = out["results"]
        assert res["A"] == out["want"], f"rank {rank}: {res}"
        if rank != late:
            assert not res["hung"], f"rank {rank}: threads {res['hung']} never returned"
            assert isinstance(res["B"], str) and "still in progress" in res["B"], f"rank {rank}: {res}"


def desynchronised_worker() -> dict:
    """Rank 0's two calls overlap (its second is refused); rank 1's do not (both run): rank 1 has one collective
    more than rank 0, which must end in an error on rank 1, not a hang."""
    import threading
    import time

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank = hvd.rank()
    hvd.allreduce(np.zeros(1, np.float32), name="warmup")
    delays = {"A": 0.0, "B": 0.2} if rank == 0 else {"A": 0.5, "B": 1.5}
    start = time.monotonic()
    results: dict = {}

    def call(who: str) -> None:
        time.sleep(max(0.0, start + delays[who] - time.monotonic()))
        try:
            results[who] = hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum, name="same").tolist()
        except Exception as exc:  # noqa: BLE001  (the outcome is what is checked)
            results[who] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=call, args=(who,), daemon=True) for who in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    results["hung"] = [t.name for t in threads if t.is_alive()]
    if rank == 0:
        time.sleep(20)   # rank 0 stays (a job would go on computing) while rank 1's extra call waits for it
    hvd.shutdown()
    return results


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_desynchronised_same_name_calls_end_in_an_error(transport):
    reason = transport_skip_reason(transport)
    if reason:
        pytest.skip(reason)
    results = run(desynchronised_worker, 2, transport, timeout=180,
                  env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"})
    rank0, rank1 = results
    assert not rank0["hung"] and not rank1["hung"], results
    assert rank0["A"] == [2.0] * 4 and "still in progress" in rank0["B"], rank0
    assert rank1["A"] == [2.0] * 4, rank1
    assert isinstance(rank1["B"], str) and "Stall" in rank1["B"] and "allreduce.same" in rank1["B"], rank1
