"""Regression tests for engine bugs this suite found, and strict xfails for the ones still open.

Fixed bugs keep their reproduction here as ordinary tests (the docstring says what was wrong).  An open bug is a
strict xfail whose reason names the defect; when a fix lands the test XPASSes, fails, and the marker goes.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import run
from horovod.engine import negotiation, ops
from horovod.engine.messages import Request


# ------------------------------------------------------------------------------------------------ 0-d tensors
def scalar_worker() -> dict:
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    size = hvd.size()
    out = {"shapes": {}, "raises": {}}
    out["shapes"]["allreduce(np.float32 scalar)"] = np.shape(hvd.allreduce(np.float32(2), op=hvd.Sum, name="s1"))
    out["shapes"]["allreduce(0-d array)"] = np.shape(hvd.allreduce(np.array(2.0), op=hvd.Sum, name="s2"))
    out["shapes"]["allreduce_async + synchronize"] = np.shape(
        hvd.synchronize(hvd.allreduce_async(np.array(2, np.int32), op=hvd.Sum, name="s3")))
    out["shapes"]["broadcast(0-d array)"] = np.shape(hvd.broadcast(np.array(5.0), 0, name="s4"))
    out["shapes"]["grouped_allreduce member"] = np.shape(
        hvd.grouped_allreduce([np.array(1.0), np.ones(2)], op=hvd.Sum, name="s5")[0])
    for label, call in (("allgather", lambda: hvd.allgather(np.array(1.0), name="s6")),
                        ("reducescatter", lambda: hvd.reducescatter(np.array(1.0), name="s7"))):
        try:
            call()
            out["raises"][label] = "returned normally"
        except ValueError as exc:
            out["raises"][label] = "ValueError: " + str(exc)
        except Exception as exc:  # noqa: BLE001
            out["raises"][label] = f"{type(exc).__name__}: {exc}"
    out["size"] = size
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def scalar_results():
    return run(scalar_worker, 2, "tcp", timeout=60)


def test_numpy_binding_keeps_scalars_0d(scalar_results):
    """Fixed in 0b47057. Was: horovod/numpy/__init__.py::_arr uses np.ascontiguousarray, which turns 0-d inputs
    into shape (1,): hvd.allreduce / allreduce_async / broadcast / grouped_allreduce of a scalar return shape
    (1,) instead of () (horovod.torch returns a 0-d tensor); use np.asarray(...) + np.ascontiguousarray only
    when ndim > 0
    """
    for out in scalar_results:
        wrong = {k: v for k, v in out["shapes"].items() if tuple(v) != ()}
        assert not wrong, f"0-d inputs came back with shapes {wrong}"


def test_numpy_binding_rejects_scalars_where_the_contract_does(scalar_results):
    """Fixed in 0b47057. Was: same root cause (_arr in horovod/numpy/__init__.py reshapes 0-d to (1,)):
    hvd.allgather and hvd.reducescatter of a 0-d array silently run on a 1-element vector instead of raising
    ValueError ('scalars -> ValueError' for reducescatter, rank-zero allgather is an error in the contract); the
    engine-level checks in horovod/engine/collectives.py never see ndim == 0 (alltoall of a 0-d array only fails
    by accident, with the 'divisible' message, and succeeds at np=1)
    """
    for out in scalar_results:
        not_raised = {k: v for k, v in out["raises"].items() if not v.startswith("ValueError")}
        assert not not_raised, not_raised


# ------------------------------------------------------------------------------------------------ process sets
def process_set_mismatch_worker() -> dict:
    import os

    import numpy as np

    import horovod.numpy as hvd
    from horovod.engine import collectives

    rank = int(os.environ["HOROVOD_RANK"])
    low = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[low])
    # Same tensor name; rank 1 names the process set {0, 1}, ranks 0 and 2 the global set.
    set_id = low.process_set_id if rank == 1 else 0
    try:
        # A rank that arrives after the others already failed and shut down is refused at enqueue instead.
        handle = collectives.allreduce_async([np.ones(3)], ["allreduce.ps_mismatch"], op=hvd.Sum,
                                             process_set=set_id)
        handle.wait(timeout=10)  # a negotiated error takes milliseconds; 10 s means the job would hang
        outcome = ("completed", "")
    except TimeoutError as exc:
        outcome = ("hang", str(exc))
    except hvd.HorovodInternalError as exc:
        outcome = ("HorovodInternalError", str(exc))
    hvd.shutdown()
    return {"outcome": outcome}


def test_process_set_mismatch_is_an_error_on_every_rank_not_a_hang():
    """Fixed in 0b47057. Was: process-set mismatch hangs instead of erroring: horovod/engine/negotiation.py
    Coordinator keeps pending requests per process set (ProcessSetState.pending), so requests for one name on
    different sets never meet and validate()'s 'Mismatched process sets' check is unreachable; every rank waits
    forever (until the stall inspector, if enabled). Repro: np=3, init(process_sets=[ProcessSet([0, 1])]), rank
    1 allreduces 'allreduce.ps_mismatch' on that set, ranks 0 and 2 on the global set
    """
    results = run(process_set_mismatch_worker, 3, "tcp", timeout=90)
    outcomes = [out["outcome"] for out in results]
    assert all(kind == "HorovodInternalError" for kind, _ in outcomes), outcomes
    assert any("process set" in text.lower() for _, text in outcomes), \
        "\n".join(f"rank {r}: {kind}: {text[:200]}" for r, (kind, text) in enumerate(outcomes))


# ------------------------------------------------------------------------------------------------ join + inline
def join_inline_worker() -> dict:
    import os

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    hvd.init()
    out = {}
    if rank != 0:  # rank 0 joins at once and contributes zeros to everything below
        for n in (4, 4096):  # 16 bytes travel inline with the request; 16 KiB go through the transport
            for op in ("Min", "Max", "Product", "Sum"):
                x = np.full(n, (rank + 1.0) * (-1 if op == "Max" else 1), np.float32)
                out[f"{op}/{n}"] = float(hvd.allreduce(x, op=getattr(hvd, op), name=f"{op}{n}")[0])
    hvd.join()
    hvd.shutdown()
    return out


def test_joined_ranks_contribute_zeros_whatever_the_tensor_size():
    """Fixed in 0b47057. Was: with a joined rank, tiny allreduces disagree with large ones for Min/Max/Product:
    horovod/engine/negotiation.py reduce_inline() (tensors <= HOROVOD_INLINE_BYTES) reduces only
    the active ranks' payloads, while the transport path (executor) stages zeros for joined ranks as the
    contract says ('joined ranks contribute zeros'); e.g. np=3, rank 0 joined, ranks 1,2 send 2.0 and 3.0: Min
    of 4 floats = 2.0 but Min of 4096 floats = 0.0
    """
    results = run(join_inline_worker, 3, "tcp", timeout=60)
    expected = {"Min": 0.0, "Max": 0.0, "Product": 0.0, "Sum": 5.0}
    for rank in (1, 2):
        got = results[rank]
        assert got["Sum/4"] == got["Sum/4096"] == 5.0
        assert {op: got[f"{op}/4"] for op in expected} == {op: got[f"{op}/4096"] for op in expected} == expected, got


def test_reduce_inline_counts_joined_ranks_as_zeros():
    """Fixed in 0b47057. Was: horovod/engine/negotiation.py reduce_inline() ignores joined ranks:
    Coordinator._respond passes only the active ranks' requests, so Min/Product over the payloads excludes the
    zeros a joined rank contributes
    """
    c = negotiation.Coordinator(3)
    c.add(Request(rank=0, name="join.noname", kind=ops.JOIN))
    for r in (1, 2):
        x = np.full(2, r + 1.0, np.float32)
        c.add(Request(rank=r, name="t", kind=ops.ALLREDUCE, dtype="float32", shape=(2,), op=ops.Min,
                      payload=x.tobytes()))
    (resp,) = c.take_ready()
    assert resp.joined == (0,)
    assert np.frombuffer(resp.payload, np.float32).tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------------------------------ group fusion
def group_fusion_worker() -> dict:
    import numpy as np

    import horovod.numpy as hvd
    from horovod.engine import fusion

    seen = []
    original = fusion.plan

    def recording_plan(ready, *args, **kwargs):
        planned = original(ready, *args, **kwargs)
        seen.append(([list(r.names) for r in ready], [list(r.names) for r in planned]))
        return planned

    fusion.plan = recording_plan  # rank 0 plans; the wrapper only records
    hvd.init()
    a = [np.ones(2048, np.float32) for _ in range(2)]
    b = [np.ones(2048, np.float32) for _ in range(2)]
    h1 = hvd.grouped_allreduce_async(a, name="ga")
    h2 = hvd.grouped_allreduce_async(b, name="gb")
    hvd.synchronize(h1)
    hvd.synchronize(h2)
    hvd.shutdown()
    return {"plans": seen}


def test_disable_group_fusion_keeps_groups_apart():
    """Fixed in 0b47057. Was: HOROVOD_DISABLE_GROUP_FUSION=1 is declared in horovod/engine/config.py but never
    read: fusion.plan() gets no group information (Response has no group field), so two explicit groups ready in
    the same cycle are fused into one buffer; the contract says each group is then fused separately
    """
    results = run(group_fusion_worker, 2, "tcp", timeout=60,
                  env={"HOROVOD_DISABLE_GROUP_FUSION": "1", "HOROVOD_CYCLE_TIME": "300"})
    plans = results[0]["plans"]
    together = [p for p in plans if any(n[0].startswith("grouped_allreduce.ga") for n in p[0])
                and any(n[0].startswith("grouped_allreduce.gb") for n in p[0])]
    if not together:
        pytest.skip(f"the two groups were not ready in the same cycle, nothing to check: {plans}")
    for _, planned in together:
        for names in planned:
            groups = {n.split(".")[1].split("_")[0] for n in names}
            assert len(groups) == 1, f"one fused buffer mixes groups: {names}"


# ------------------------------------------------------------------------------------------------ liveness
def frozen_peer_worker(victim: int, repeat: bool = False) -> dict:
    """Rank ``victim`` stops itself between collectives; the others report what their next allreduce did.
    ``repeat``: every allreduce has one name, so the others wait in a warm round (tests/engine/test_warm_path.py)."""
    import os
    import signal
    import time

    import numpy as np

    import horovod.numpy as hvd
    from horovod.engine import collectives

    rank = int(os.environ["HOROVOD_RANK"])
    hvd.init()
    pids = hvd.allgather_object(os.getpid())
    for i in range(3):
        hvd.allreduce(np.ones(4096, np.float32), name="w" if repeat else f"warmup{i}", op=hvd.Sum)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen between collectives: alive, connected, silent
    start = time.monotonic()
    name = "allreduce.w" if repeat else "allreduce.after_freeze"
    handle = collectives.allreduce_async([np.ones(4096, np.float32)], [name], op=hvd.Sum)
    try:
        handle.wait(timeout=12)  # six times HOROVOD_GLOO_TIMEOUT_SECONDS
        outcome = ("completed", "")
    except TimeoutError:
        outcome = ("hang", f"no error after {time.monotonic() - start:.0f} s")
    except hvd.HorovodInternalError as exc:
        outcome = ("HorovodInternalError", str(exc))
    try:
        os.kill(pids[victim], signal.SIGKILL)  # release the harness
    except ProcessLookupError:
        pass  # the other survivor was first
    hvd.shutdown()
    return {"outcome": outcome}


def test_frozen_peer_becomes_an_error_not_a_hang():
    """Fixed in 0b47057. Was: no liveness check on the control plane: a rank that stops responding between
    collectives (SIGSTOP, frozen host, network partition without RST) leaves every other rank blocked in
    synchronize() forever; HOROVOD_GLOO_TIMEOUT_SECONDS only bounds data-plane waits (horovod/transport/*),
    while the coordinator waits for requests and workers wait for responses (horovod/engine/runtime.py
    _run/select with no timeout, Handle.wait() without timeout) with no heartbeat. The original's Gloo
    controller negotiates with Gloo collectives, which time out. Same hang when rank 0 (the coordinator) is the
    frozen one
    """
    results = run(frozen_peer_worker, 3, "tcp", args=(1,), env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "2"}, timeout=90,
                  expect_failure=True)
    outcomes = {rank: value["outcome"] for rank, (status, value) in enumerate(results) if status == "ok"}
    assert set(outcomes) == {0, 2}, results
    assert all(kind == "HorovodInternalError" for kind, _ in outcomes.values()), outcomes


def alone_back_to_back_worker(seconds: float) -> int:
    import time

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    x = np.ones(4, np.float32)
    calls, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        hvd.allreduce(x, name="x", op=hvd.Sum)
        calls += 1
    hvd.shutdown()
    return calls


def test_a_job_of_one_process_never_hangs_between_its_caller_and_the_idle_poll():
    """Fixed in session 8. Was: at np = 1 the background thread's idle poll (once a second) could take the drive
    lock while a call's entry was in flight; it then drove "until nothing is in flight", but a job of one process
    runs its entries in the calling thread, which waited for that lock: back-to-back calls hung within seconds."""
    calls = run(alone_back_to_back_worker, 1, "tcp", args=(4.0,), timeout=60)
    assert calls[0] > 100, calls


# ------------------------------------------------------------------------------------------------ open bugs
def disjoint_sets_worker(named: bool) -> dict:
    import os

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    evens, odds = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
    hvd.init(process_sets=[evens, odds])
    mine = evens if rank % 2 == 0 else odds
    name = "grad" if named else None  # unnamed: both sets number their ops from 0, so names coincide too
    # Ranks 0 and 1 submit first and ranks 2 and 3 only after the global "gate", so the name is pending on both
    # sets at the same time -- as it is whenever two groups of a model-parallel job reduce concurrently.
    try:
        if rank < 2:
            handle = hvd.allreduce_async(np.full(3, rank + 1.0), op=hvd.Sum, name=name, process_set=mine)
            hvd.allreduce(np.ones(1), name="gate")
        else:
            hvd.allreduce(np.ones(1), name="gate")
            handle = hvd.allreduce_async(np.full(3, rank + 1.0), op=hvd.Sum, name=name, process_set=mine)
        outcome = ("ok", hvd.synchronize(handle).tolist())
    except hvd.HorovodInternalError as exc:
        outcome = ("HorovodInternalError", str(exc))
    hvd.barrier()
    hvd.shutdown()
    return {"outcome": outcome}


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_disjoint_process_sets_may_use_the_same_name_concurrently(named):
    results = run(disjoint_sets_worker, 4, "tcp", args=(named,), timeout=60)
    sums = {0: 4.0, 2: 4.0, 1: 6.0, 3: 6.0}  # 1 + 3 on the evens, 2 + 4 on the odds
    for rank, out in enumerate(results):
        assert out["outcome"] == ("ok", [sums[rank]] * 3), (rank, out["outcome"])


# ------------------------------------------------------------------------------------------------ progress hand-off
def async_while_driving_worker() -> dict:
    import os
    import time

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    hvd.init()
    size = hvd.size()
    out = {}
    if rank == 0:
        # "b" must complete before rank 0 even submits "a": rank 1's request for "b" has to leave while its
        # background thread is blocked waiting for the outcome of "a".
        time.sleep(0.3)
        hb = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="b")
        t0 = time.monotonic()
        out["b"] = hvd.synchronize(hb).tolist()
        out["b_seconds"] = time.monotonic() - t0
        out["a"] = hvd.allreduce(np.ones(2), op=hvd.Sum, name="a").tolist()
    else:
        ha = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="a")
        time.sleep(0.1)   # the background thread is now driving "a", blocked in select
        hb = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="b")
        out["b"] = hvd.synchronize(hb).tolist()
        out["a"] = hvd.synchronize(ha).tolist()
    hvd.shutdown()
    out["size"] = size
    return out


def test_async_request_leaves_while_the_background_thread_waits():
    """Fixed before release. Was: an asynchronous request queued while the background thread was blocked in
    select waited there until unrelated control traffic (a heartbeat, seconds later) woke the thread.
    """
    for out in run(async_while_driving_worker, 2, "tcp", env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "60"}):
        assert out["a"] == out["b"] == [2.0, 2.0]
        if "b_seconds" in out:
            assert out["b_seconds"] < 2.0, f"'b' took {out['b_seconds']:.1f} s: the request sat in a queue"


def driver_handover_worker() -> dict:
    import os
    import threading
    import time

    import numpy as np

    import horovod.numpy as hvd
    from horovod.engine import collectives

    rank = int(os.environ["HOROVOD_RANK"])
    hvd.init()
    out = {}
    # 1. A wait that times out while this thread drives leaves the collective to the background thread,
    #    which completes it once the late rank arrives.
    if rank == 1:
        time.sleep(0.5)
    handle = collectives.allreduce_async([np.ones(3)], ["late"], op=hvd.Sum)
    try:
        handle.wait(timeout=0.1 if rank == 0 else 10)
        out["timed_out"] = False
    except TimeoutError:
        out["timed_out"] = True
    out["late"] = handle.wait(timeout=10).tolist()
    # 2. shutdown() from another thread while this thread drives a collective no other rank will submit.
    hvd.allreduce(np.ones(1), name="before_shutdown")
    if rank == 0:
        threading.Timer(0.3, hvd.shutdown).start()
        t0 = time.monotonic()
        try:
            hvd.allreduce(np.ones(3), name="never_matched")
            out["orphan"] = "returned"
        except hvd.HorovodInternalError as exc:
            out["orphan"] = type(exc).__name__
        out["orphan_seconds"] = time.monotonic() - t0
    else:
        time.sleep(1.0)
        try:
            hvd.shutdown()
        except Exception as exc:  # noqa: BLE001
            out["shutdown"] = repr(exc)
    return out


def test_a_driving_caller_hands_over_on_timeout_and_leaves_on_shutdown():
    """Checks the leader/follower hand-over: a caller that stops driving (timeout) or is interrupted (shutdown
    from another thread) must neither strand the collective nor hang."""
    results = run(driver_handover_worker, 2, "tcp", timeout=60)
    assert results[0]["timed_out"] is True and results[1]["timed_out"] is False, results
    assert all(r["late"] == [2.0, 2.0, 2.0] for r in results), results
    assert results[0]["orphan"] == "ShutdownError" and results[0]["orphan_seconds"] < 5, results
    assert "shutdown" not in results[1], results


# ------------------------------------------------------------------------------- unnamed ops of disjoint sets
def disjoint_unnamed_worker() -> dict:
    import time

    import numpy as np

    import horovod.numpy as hvd

    hvd.init(process_sets="dynamic")
    rank, size = hvd.rank(), hvd.size()
    out = {}
    try:
        hvd.add_process_set([])
        out["empty set"] = "accepted"
    except ValueError as exc:
        out["empty set"] = "at least one rank" in str(exc)
    even = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odd = hvd.add_process_set([r for r in range(size) if r % 2 == 1])
    mine = even if rank % 2 == 0 else odd
    for rnd in range(3):
        if rank == 0:
            time.sleep(0.3)  # the others reach the global barrier below while rank 0 is still in its set's
        hvd.barrier(process_set=mine)
        # unnamed: numbered per set, so the set's n-th and the global set's n-th must not be taken for one op
        got = hvd.allreduce(np.full(3, rank + 1.0), op=hvd.Sum, process_set=mine)
        out[f"set sum {rnd}"] = float(got[0])
        hvd.barrier()
        out[f"global sum {rnd}"] = float(hvd.allreduce(np.ones(2), op=hvd.Sum)[0])
    hvd.shutdown()
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_unnamed_ops_on_disjoint_sets_do_not_collide_with_the_global_set(np_):
    """Was: hvd.barrier(process_set=...) on a subset failed with "Mismatched process sets" while other ranks
    waited in a global barrier: every barrier was named "barrier.noname", and unnamed ops of different sets
    share numbers (each set counts its own), so the coordinator took them for one op on the wrong set."""
    results = run(disjoint_unnamed_worker, np_, "tcp", timeout=90)
    for rank, out in enumerate(results):
        assert out["empty set"] is True, out  # hvd.add_process_set([]) is refused with a clear message
        members = [r for r in range(np_) if r % 2 == rank % 2]
        for rnd in range(3):
            assert out[f"set sum {rnd}"] == sum(r + 1.0 for r in members), (rank, out)
            assert out[f"global sum {rnd}"] == float(np_), (rank, out)


# ------------------------------------------------------------------------------------- join, then unnamed ops
def join_then_unnamed_worker() -> dict:
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {"errors": [], "rets": [], "gathered": [], "sums": []}
    for first in range(size):
        if rank == first:
            ret = hvd.join()
        else:
            try:
                hvd.allgather(np.ones((2, 3)))  # unnamed; not supported while a rank has joined
                out["errors"].append("no error")
            except RuntimeError as exc:
                out["errors"].append("HorovodInternalError" if isinstance(exc, hvd.HorovodInternalError)
                                     else type(exc).__name__)
            # unnamed allreduce: the joined rank contributes zeros and never issued this op itself
            out["sums"].append(float(hvd.allreduce(np.ones(4), op=hvd.Sum)[0]))
            ret = hvd.join()
        out["rets"].append(ret)
        # after the join every rank's next unnamed op must carry the same number again
        out["gathered"].append(hvd.allgather_object(ret))
    hvd.shutdown()
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_join_then_unnamed_ops_neither_hang_nor_drift(np_):
    """Was: after a rank joined, the others' unnamed allgather failed (as it should) but the next unnamed op
    (allgather_object) hung on every rank: the joined rank had not issued the failed or zero-contributed ops, so
    its per-set counter of unnamed ops lagged behind and the names no longer matched."""
    results = run(join_then_unnamed_worker, np_, "tcp", timeout=90)
    for rank, out in enumerate(results):
        others = [first for first in range(np_) if first != rank]
        assert out["errors"] == ["HorovodInternalError"] * len(others), out
        assert out["sums"] == [float(np_ - 1)] * len(others), out
        for first, ret, gathered in zip(range(np_), out["rets"], out["gathered"]):
            assert ret != first and gathered == [ret] * np_, out
