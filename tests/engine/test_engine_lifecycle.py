"""Engine lifecycle and concurrency: re-initialisation with other process sets, many threads, many ops in flight."""
from __future__ import annotations

import pytest

from engine_helpers import TRANSPORTS, Failures, assert_no_failures, run, transport_skip_reason


def reinit_worker() -> dict:
    import os

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    fails = Failures(rank)

    def check_sum(label, ps):
        if rank in ps.ranks:
            res = hvd.allreduce(np.full(3, rank + 1.0), op=hvd.Sum, process_set=ps, name=label)
            fails.add(None if res.tolist() == [float(sum(r + 1 for r in ps.ranks))] * 3 else f"{label}: {res}")

    first = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[first])
    hvd.init()  # idempotent while running: same engine, same sets
    fails.add(None if first.process_set_id == 1 else f"first set id {first.process_set_id}")
    check_sum("first", first)
    hvd.barrier()  # nobody shuts down while others still use the engine
    hvd.shutdown()
    fails.add(None if first.process_set_id is None else "a set keeps its id after shutdown")

    second = hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[second])
    fails.add(None if second.process_set_id == 1 else f"second set id {second.process_set_id}")
    fails.expect_raises("a set of the previous engine", ValueError,
                        lambda: hvd.allreduce(np.ones(2), process_set=first, name="stale"))
    check_sum("second", second)
    hvd.barrier()
    hvd.shutdown()

    hvd.init(process_sets="dynamic")
    third = hvd.add_process_set([0, 2])
    again = hvd.add_process_set(hvd.ProcessSet([0, 1]))
    fails.add(None if (third.process_set_id, again.process_set_id) == (1, 2) else
              f"dynamic ids {third.process_set_id}, {again.process_set_id}")
    check_sum("third", third)
    check_sum("again", again)
    fails.add(None if hvd.remove_process_set(third) is True else "remove_process_set did not return True")
    fails.add(None if hvd.remove_process_set(third) is False else "removing twice did not return False")
    check_sum("again_after_removal", again)
    hvd.barrier()
    hvd.shutdown()
    return fails.report()


def test_shutdown_then_init_with_other_process_sets():
    assert_no_failures(run(reinit_worker, 3, "tcp", timeout=90))


def concurrency_worker() -> dict:
    import os
    import threading

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    fails = Failures(rank)
    hvd.init()
    size = hvd.size()
    lock = threading.Lock()

    def thread_body(t):
        # named ops only: unnamed ones from several threads would be numbered in a different order per rank
        for i in range(40):
            n = 3 if i % 2 else 3000  # inline and data-plane paths
            try:
                res = hvd.allreduce(np.full(n, float(rank + t)), op=hvd.Sum, name=f"thread{t}_{i}")
                want = float(sum(r + t for r in range(size)))
                gathered = hvd.allgather(np.full((rank + 1, 2), t, np.int16), name=f"thread{t}_ag{i}")
                with lock:
                    fails.add(None if np.all(res == want) else f"thread {t} step {i}: {res[:3]}")
                    fails.add(None if gathered.shape == (size * (size + 1) // 2, 2) and np.all(gathered == t)
                              else f"thread {t} allgather {i}: {gathered.shape}")
            except Exception as exc:  # noqa: BLE001
                with lock:
                    fails.error(f"thread {t} step {i}", exc)

    threads = [threading.Thread(target=thread_body, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()

    # thousands of operations in flight at once, completed in reverse order
    handles = [hvd.allreduce_async(np.full(200, float(rank + i % 7)), op=hvd.Sum, name=f"many{i}")
               for i in range(3000)]
    for i, h in reversed(list(enumerate(handles))):
        res = hvd.synchronize(h)
        fails.add(None if res[0] == sum(r + i % 7 for r in range(size)) else f"many{i}: {res[0]}")

    # a handle synchronized from another thread than the one that created it
    h = hvd.allreduce_async(np.ones(5000), op=hvd.Sum, name="cross_thread")
    box = []
    th = threading.Thread(target=lambda: box.append(hvd.synchronize(h)))
    th.start()
    th.join()
    fails.add(None if box and box[0][0] == size else f"cross-thread synchronize: {box}")
    hvd.shutdown()
    return fails.report()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_threads_and_thousands_of_inflight_ops(transport):
    reason = transport_skip_reason(transport)
    if reason:
        pytest.skip(reason)
    assert_no_failures(run(concurrency_worker, 3, transport, timeout=120))


# --------------------------------------------------------------------------------------- fork after init
def fork_after_init_worker() -> dict:
    import multiprocessing as mp

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank = hvd.rank()
    out = {"before": hvd.allreduce(np.ones(3), op=hvd.Sum, name="before").tolist()}
    if rank == 0:
        def child(conn):
            report = {"rank": hvd.rank(), "size": hvd.size()}   # queries still answer
            for label, call in (("allreduce", lambda: hvd.allreduce(np.ones(3), name="from_child")),
                                ("big allreduce", lambda: hvd.allreduce(np.ones(1 << 18), name="big_child")),
                                ("barrier", hvd.barrier)):
                try:
                    call()
                    report[label] = "no error"
                except hvd.HorovodInternalError as exc:
                    report[label] = "forked" in str(exc) and "hvd.init()" in str(exc)
                except Exception as exc:  # noqa: BLE001 (the wrong type is reported)
                    report[label] = f"{type(exc).__name__}: {exc}"
            conn.send(report)

        parent_end, child_end = mp.Pipe()
        proc = mp.get_context("fork").Process(target=child, args=(child_end,))
        proc.start()
        out["child"] = parent_end.recv() if parent_end.poll(60) else "no report"
        proc.join(30)
    # the parent's job goes on unaffected, small and large collectives alike
    out["after"] = [hvd.allreduce(np.full(n, rank + 1.0), op=hvd.Sum, name=f"after{n}")[0] for n in (3, 1 << 18)]
    hvd.shutdown()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_child_forked_after_init_gets_a_clear_error_and_the_parent_is_unaffected(transport):
    results = run(fork_after_init_worker, 2, transport, timeout=90)
    child = results[0]["child"]
    assert child == {"rank": 0, "size": 2, "allreduce": True, "big allreduce": True, "barrier": True}, child
    for out in results:
        assert out["before"] == [2.0] * 3 and out["after"] == [3.0, 3.0], out
