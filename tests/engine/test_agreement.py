"""One agreement interface, one strategy per situation (horovod/engine/agreement.py): the engine picks a job of
one, the coordinator with the warm path, or the fast lane in front of it, and every strategy gets the same results
for blocking, asynchronous and grouped calls and the same error on a mismatch. Real processes, results against
numpy, the strategy and the lane's counts read, so that a situation given the wrong strategy fails.
"""
from __future__ import annotations

import pytest

from engine_helpers import assert_no_failures, run, transport_skip_reason


def strategy_worker() -> dict:
    import numpy as np

    import horovod.numpy as hvd
    from checks import Checks
    from horovod.common import basics

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = Checks(rank, rtol=1e-6)
    runtime = basics.runtime()
    lane = runtime.state.lane
    total = sum(range(size))
    for i in range(20):
        checks.close(hvd.allreduce(np.full(5, rank + i, np.float32), name="blocking", op=hvd.Sum),
                     np.full(5, total + size * i, np.float32), f"blocking allreduce {i}")
        handle = hvd.allreduce_async(np.full(3, float(rank)), name="async", op=hvd.Average)
        checks.close(hvd.synchronize(handle), np.full(3, total / size), f"async allreduce {i}")
        handles = [hvd.allgather_async(np.full((1, 2), rank + k, np.int32), name=f"gather.{k}") for k in range(3)]
        for k, h in enumerate(handles):
            checks.equal(hvd.synchronize(h), np.arange(size, dtype=np.int32).reshape(size, 1).repeat(2, 1) + k,
                         f"allgather {k} of a burst {i}")
        grouped = hvd.grouped_allreduce([np.ones(4) * rank, np.ones(2) * (rank + 1)], name="grouped", op=hvd.Sum)
        checks.close(grouped[1], np.full(2, float(total + size)), f"grouped allreduce {i}")
        checks.equal(hvd.broadcast(np.arange(3) + rank, root_rank=size - 1, name="bcast"), np.arange(3) + size - 1,
                     f"broadcast {i}")
    mismatch = None
    if size > 1:
        try:   # rank 0 passes another shape: every rank gets the coordinator's error naming the ranks
            hvd.allreduce(np.ones(2 if rank == 0 else 3), name="mismatch")
        except Exception as exc:  # noqa: BLE001
            mismatch = f"{type(exc).__name__}: {exc}"
    fast = lane.fast if lane is not None else 0
    name = type(runtime.agreement).__name__
    hvd.shutdown()
    return {"checks": checks.report(), "strategy": name, "fast": fast, "mismatch": mismatch}


@pytest.mark.parametrize("np_,transport,env,strategy", [
    (1, "tcp", {}, "Alone"),
    (2, "shm", {}, "LaneUse"),
    (3, "tcp", {}, "LaneUse"),
    (2, "shm", {"HOROVOD_FAST_LANE": "0"}, "Coordinated"),
    (3, "tcp", {"HOROVOD_FAST_LANE": "0"}, "Coordinated"),
])
def test_each_situation_gets_its_strategy_and_the_same_results(np_, transport, env, strategy):
    if transport_skip_reason(transport):
        pytest.skip(transport_skip_reason(transport))
    results = run(strategy_worker, np_, transport, env=env, timeout=300)
    assert_no_failures([r["checks"] for r in results])
    assert [r["strategy"] for r in results] == [strategy] * np_
    if strategy == "LaneUse":   # the lone blocking calls were agreed on the lane, on every rank alike
        assert all(r["fast"] == results[0]["fast"] >= 20 for r in results), [r["fast"] for r in results]
    else:
        assert all(r["fast"] == 0 for r in results), [r["fast"] for r in results]
    if np_ > 1:
        errors = {r["mismatch"] for r in results}
        assert len(errors) == 1 and None not in errors, errors
        message = errors.pop()
        assert "Mismatched" in message or "mismatch" in message.lower(), message
