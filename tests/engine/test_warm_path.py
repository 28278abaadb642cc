"""The warm path (horovod/engine/rounds.py): repeated collectives agreed by one AND of cache-hit bits per round.

The bookkeeping is checked directly (two ranks' states against each other); everything else on real processes over
the shm transport, comparing every result with numpy and reading how many tensors each rank ran warm, so that a
warm path that silently never engages (or disagrees between ranks) fails. Mismatches after a tensor went warm must
still reach every rank with the coordinator's message. Also issue 28's hangs: a named collective against a barrier,
and a process-set mismatch on the fast lane.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from engine_helpers import assert_no_failures, capture_horovod_logs, run, transport_skip_reason

from horovod.engine import ops
from horovod.engine.messages import ControlMessage, Request, Response
from horovod.engine.rounds import DEMOTE_AFTER_S, RoundState, SlotTable


def _shm_or_skip():
    reason = transport_skip_reason("shm")
    if reason:
        pytest.skip(reason)


# ------------------------------------------------------------------------------------------- the bookkeeping
def _req(rank, name, shape=(4,)):
    return Request(rank=rank, name=name, kind=ops.ALLREDUCE, dtype="float32", shape=shape)


def _cold_message(table, names, shape=(4,)):
    responses = [Response(ops.ALLREDUCE, [n], 0, shapes=[shape], slots=[table.assign((0, n))]) for n in names]
    return ControlMessage(responses=responses)


def _and(*vectors):
    out = vectors[0].copy()
    for v in vectors[1:]:
        np.bitwise_and(out, v, out=out)
    return out


def test_tensors_every_rank_hit_run_in_slot_order_and_the_rest_wait():
    table = SlotTable(8)
    names = [f"t{i}" for i in range(5)]
    states = [RoundState(8), RoundState(8)]
    msg = _cold_message(table, names)
    for rank, state in enumerate(states):
        state.apply(msg.invalidate, msg.responses, {n: _req(rank, n) for n in names})
    # rank 0 issued all five (in reverse), rank 1 only t3 and t1
    for n in reversed(names):
        assert states[0].take(_req(0, n), 0.0)
    for n in ("t3", "t1"):
        assert states[1].take(_req(1, n), 0.0)
    anded = _and(*(s.vector().copy() for s in states))
    runs = [[r.names[0] for r in s.finish(anded)] for s in states]
    assert runs == [["t1", "t3"], ["t1", "t3"]]
    assert sorted(states[0].hits) == [0, 2, 4] and not states[1].hits
    # a changed signature misses the cache: it goes to the coordinator
    assert not states[1].take(_req(1, "t0", shape=(5,)), 0.0)


def test_a_round_posted_with_different_cache_versions_runs_nothing():
    table = SlotTable(8)
    states = [RoundState(8), RoundState(8)]
    msg = _cold_message(table, ["a"])
    for rank, state in enumerate(states):
        state.apply([], msg.responses, {"a": _req(rank, "a")})
    for rank, state in enumerate(states):
        assert state.take(_req(rank, "a"), 0.0)
    v0 = states[0].vector().copy()
    # rank 1 applies a later message (slot 0 reassigned) before it posts: bit 0 means another tensor there
    later = _cold_message(table, ["b", "c", "d", "e", "f", "g", "h", "i"])
    states[1].apply([], later.responses, {})
    assert states[1].stale(0.0) == [_req(1, "a")]
    v1 = states[1].vector().copy()
    anded = _and(v0, v1)
    assert states[0].finish(anded) == [] and states[1].finish(anded) == []
    assert states[0].void == states[1].void == 1


def test_a_hit_that_waits_too_long_or_whose_slot_is_dropped_goes_to_the_coordinator():
    table = SlotTable(4)
    state = RoundState(4)
    msg = _cold_message(table, ["a", "b"])
    state.apply([], msg.responses, {"a": _req(0, "a"), "b": _req(0, "b")})
    assert state.take(_req(0, "a"), 10.0) and state.take(_req(0, "b"), 10.0)
    assert state.stale(10.0 + DEMOTE_AFTER_S / 2) == []
    state.apply([table.invalidate((0, "b"))], [], {})
    assert state.stale(10.0 + DEMOTE_AFTER_S / 2) == [_req(0, "b")]
    assert state.stale(10.0 + DEMOTE_AFTER_S) == [_req(0, "a")]
    assert not state.hits


def test_slots_are_reused_least_recently_assigned_first():
    table = SlotTable(2)
    a, b = table.assign((0, "a")), table.assign((0, "b"))
    assert {a, b} == {0, 1} and table.assign((0, "a")) == a
    assert table.assign((0, "c")) == b   # b was assigned longest ago
    assert table.invalidate((0, "b")) is None and table.invalidate((0, "c")) == b
    assert table.assign((0, "d")) == b


# ------------------------------------------------------------------------------------------- real processes
def warm_worker(scenario: str, steps: int) -> dict:
    import os
    import time

    import numpy as np

    import horovod.numpy as hvd
    from checks import Checks
    from horovod.common import basics
    from horovod.engine.rounds import DEMOTE_AFTER_S

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = Checks(rank, rtol=1e-5)
    rng = np.random.default_rng(100 + rank)   # every rank issues the tensors in its own order
    dtypes = ("float32", "float64", "int32", "float16", "int64")
    sizes = (1, 3, 200, 5000, 70000, 16, 1024, 7)
    others = hvd.add_process_set([0, 1]) if scenario == "process_sets" else None
    errors = []

    def value(i, r, step, dtype, n):
        return ((np.arange(n) + r * 3 + i + step) % 7).astype(dtype)

    for step in range(steps):
        if scenario == "join" and rank == size - 1 and step == 3:
            break
        if scenario == "late" and rank == 1 and step == 4:
            time.sleep(DEMOTE_AFTER_S + 0.5)   # the others' hits wait, then go to the coordinator
        members = list(range(size)) if scenario != "join" or step < 3 else list(range(size - 1))
        handles = {}
        cold_at = rng.integers(0, len(sizes) * 2)
        for k, i in enumerate(rng.permutation(len(sizes) * 2)):
            if k == cold_at:   # an unnamed op is new every step: cold, between warm ones, at another place per rank
                cold = hvd.allreduce_async(np.full(300, float(rank + step)), op=hvd.Sum)
            dtype, n = dtypes[i % len(dtypes)], sizes[i % len(sizes)]
            x = value(i, rank, step, dtype, n)
            op = hvd.Sum if dtype.startswith("int") else hvd.Average
            handles[i] = (hvd.allreduce_async(x, name=f"g{i}", op=op), dtype, n, op)
        if scenario == "process_sets" and rank in (0, 1):
            got = hvd.allreduce(np.full(3, float(rank + step)), name="pair", op=hvd.Sum, process_set=others)
            checks.close(got, np.full(3, float(1 + 2 * step)), f"step {step} pair set")
        if scenario == "join":   # allgather and broadcast refuse joined ranks
            pass
        else:
            gathered = hvd.allgather(np.full((2, 3), rank + step, np.int32), name="gather")
            checks.equal(gathered, np.repeat(np.arange(size) + step, 2)[:, None].repeat(3, 1).astype(np.int32),
                         f"step {step} allgather")
            bcast = hvd.broadcast(np.full(5, float(rank * 10 + step)), root_rank=size - 1, name="bcast")
            checks.close(bcast, np.full(5, float((size - 1) * 10 + step)), f"step {step} broadcast")
        checks.close(hvd.synchronize(cold), np.full(300, float(sum(members) + len(members) * step)),
                     f"step {step} unnamed")
        for i, (handle, dtype, n, op) in handles.items():
            got = hvd.synchronize(handle)
            total = sum(value(i, r, step, "float64", n) for r in members)
            want = (total if op == hvd.Sum else total / size).astype(dtype)
            checks.close(got, want, f"step {step} g{i} {dtype}[{n}]")
        if scenario == "mismatch" and step == steps // 2:
            try:
                # g1 is float64[3] with Average: a hit everywhere but on the last rank, whose shape changed
                hvd.allreduce(value(1, rank, step, "float64", 4 if rank == size - 1 else 3), name="g1",
                              op=hvd.Average)
                errors.append("no error")
            except hvd.HorovodInternalError as exc:
                errors.append(str(exc))
    if scenario == "join":
        hvd.join()
    after = hvd.allreduce(np.ones(2), name="after", op=hvd.Sum)
    checks.close(after, np.full(2, float(size)), "after")
    warm = basics.runtime().state.warm
    stats = None if warm is None else (warm.state.rounds, warm.state.warm, warm.state.void)
    hvd.shutdown()
    return {"checks": checks.report(), "stats": stats, "errors": errors,
            "capacity": os.environ.get("HOROVOD_CACHE_CAPACITY")}



def two_hosts(np_):
    """Host names that split ``np_`` ranks over two "hosts" of this machine (a job that spans hosts: its rounds run
    over TCP, horovod/engine/tcp_round_board.py)."""
    return ["localhost"] * ((np_ + 1) // 2) + ["127.0.0.1"] * (np_ // 2)


def _run(worker, np_, transport, **kwargs):
    """``run`` with "tcp" meaning the tcp transport on two hosts of this machine (rounds over TCP)."""
    if transport_skip_reason(transport):
        pytest.skip(transport_skip_reason(transport))
    if transport == "tcp" and kwargs.get("hosts") is None:
        kwargs["hosts"] = two_hosts(np_)
    return run(worker, np_, transport, **kwargs)


def _run_warm(scenario, np_, steps=12, env=None, timeout=240, transport="shm", **kwargs):
    results = _run(warm_worker, np_, transport, args=(scenario, steps), timeout=timeout,
                   env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1", **(env or {})}, **kwargs)
    assert_no_failures([r["checks"] for r in results])
    return results


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_repeated_collectives_in_any_order_run_warm_and_stay_right(np_):
    _assert_ran_warm(_run_warm("train", np_))


# Across hosts the rounds run over TCP (horovod/engine/tcp_round_board.py): the tcp and the hierarchical transport
# with two host names on this machine (its ranks still reach rank 0 over Unix sockets; the fences of a real second
# host are exercised by tests/runner/test_ssh_hosts.py's network-namespace hosts).
@pytest.mark.parametrize("np_,hosts", [(2, None), (3, None), (4, None),
                                       (4, ["localhost", "localhost", "127.0.0.1", "127.0.0.1"]),
                                       (3, ["localhost", "localhost", "127.0.0.1"])])
def test_repeated_collectives_run_warm_over_tcp_rounds(np_, hosts):
    transport = "tcp" if hosts is None else "hierarchical"
    _assert_ran_warm(_run_warm("train", np_, transport=transport, hosts=hosts))


@pytest.mark.parametrize("transport", ["tcp", "mpi"])
def test_a_job_of_one_host_without_shared_memory_keeps_the_coordinator(transport):
    # There a lone tiny allreduce is one round trip to rank 0; rounds over TCP would add a second synchronisation.
    if transport == "mpi" and not shutil.which("mpirun"):
        pytest.skip("mpirun is not installed")
    results = run(warm_worker, 2, transport, args=("train", 3), timeout=120,
                  launcher="mpirun" if transport == "mpi" else "subprocess")
    assert_no_failures([r["checks"] for r in results])
    assert all(r["stats"] is None for r in results)


def _assert_ran_warm(results):
    stats = [r["stats"] for r in results]
    # every rank finished the same rounds and ran the same tensors warm
    assert all(s == stats[0] for s in stats), stats
    rounds, warm, void = stats[0]
    # 16 gradients + allgather + broadcast per step; the first step is cold
    assert warm >= 0.9 * 18 * 11, f"only {warm} tensors of {18 * 11} repeated ones ran warm ({rounds} rounds)"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_mismatch_after_a_tensor_went_warm_reaches_every_rank(transport):
    results = _run_warm("mismatch", 3, transport=transport)
    for rank, r in enumerate(results):
        assert len(r["errors"]) == 1 and "Mismatched ALLREDUCE tensor shapes" in r["errors"][0], (rank, r["errors"])
        assert "rank" in r["errors"][0]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_join_while_the_others_repeat_warm_tensors(transport):
    results = _run_warm("join", 3, steps=8, transport=transport)
    assert results[0]["stats"][1] > 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_process_sets_between_warm_rounds(transport):
    _run_warm("process_sets", 3, transport=transport)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_late_rank_sends_the_waiting_hits_to_the_coordinator_and_results_stay_right(transport):
    results = _run_warm("late", 2, steps=7, transport=transport)
    assert results[0]["stats"][1] > 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_small_cache_evicts_and_stays_right(transport):
    results = _run_warm("train", 3, steps=8, env={"HOROVOD_CACHE_CAPACITY": "5"}, transport=transport)
    assert all(r["stats"] is not None for r in results)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cache_capacity_zero_turns_the_warm_path_off(transport):
    results = _run_warm("train", 2, steps=4, env={"HOROVOD_CACHE_CAPACITY": "0"}, transport=transport)
    assert all(r["stats"] is None for r in results)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sixteen_ranks_on_this_machine(transport):
    results = _run_warm("train", 16, steps=6, timeout=600, transport=transport)
    stats = [r["stats"] for r in results]
    assert all(s == stats[0] for s in stats), stats
    assert stats[0][1] >= 0.9 * 18 * 5


# ------------------------------------------------------------------------------------------- issue 28, 1 and 2
def barrier_worker(warm_first: bool) -> dict:
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank = hvd.rank()
    out = {}
    if warm_first:
        for _ in range(3):
            hvd.allreduce(np.ones(4, np.float32), name="x")
    try:
        if rank == 0:
            hvd.allreduce(np.ones(4, np.float32), name="x")
        else:
            hvd.barrier()
        out["error"] = None
    except hvd.HorovodInternalError as exc:
        out["error"] = str(exc)
    out["after"] = hvd.allreduce(np.ones(2), name="after", op=hvd.Sum).tolist()
    hvd.shutdown()
    return out


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("warm_first", [False, True])
def test_a_named_collective_against_a_barrier_fails_every_rank(transport, np_, warm_first):
    if transport_skip_reason(transport):
        pytest.skip(transport_skip_reason(transport))
    results = run(barrier_worker, np_, transport, args=(warm_first,), timeout=60)
    for rank, r in enumerate(results):
        error = r["error"] or ""
        assert "barrier" in error and "allreduce.x" in error and "rank 0 called allreduce" in error, (rank, error)
        assert r["after"] == [float(np_)] * 2


def lane_set_worker(elements: int) -> dict:
    import numpy as np

    import horovod.numpy as hvd

    pair = hvd.ProcessSet([0, 1])   # the global set at np = 2, a subset at np = 3
    hvd.init(process_sets=[pair])
    rank = hvd.rank()
    out = {}
    try:
        hvd.allreduce(np.ones(elements, np.float32), name="tiny", op=hvd.Sum,
                      process_set=pair if rank == 0 else hvd.global_process_set)
        out["error"] = None
    except hvd.HorovodInternalError as exc:
        out["error"] = str(exc)
    out["after"] = hvd.allreduce(np.ones(2, np.float32), name="after", op=hvd.Sum).tolist()
    hvd.shutdown()
    return out


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("elements", [4, 256, 1024])
def test_a_process_set_mismatch_on_a_tiny_allreduce_fails_every_rank(elements, np_):
    _shm_or_skip()
    results = run(lane_set_worker, np_, "shm", args=(elements,), timeout=60)
    for rank, r in enumerate(results):
        assert r["error"] and "Mismatched process sets" in r["error"], (rank, r["error"])
        assert r["after"] == [float(np_)] * 2


def arrive_second_worker(path: str) -> float:
    """Rank 0 always arrives second at a warm allreduce, then tells rank 1 through a file that it returned: a rank
    whose round finished before it waited must return at once (it once slept until the next heartbeat)."""
    import os
    import time

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    rank = hvd.rank()
    x = np.ones(1024, np.float32)
    start = time.monotonic()
    for i in range(20):
        if rank == 0:
            time.sleep(0.005)   # rank 1 has posted its round by now
        hvd.allreduce_(x, name="w", op=hvd.Sum)
        if rank == 0:
            with open(f"{path}.{i}", "w"):
                pass
        else:
            while not os.path.exists(f"{path}.{i}"):   # nothing of Horovod's runs meanwhile
                time.sleep(0.0005)
    took = time.monotonic() - start
    hvd.shutdown()
    return took


def test_a_rank_whose_round_finished_first_returns_at_once(tmp_path):
    _shm_or_skip()
    took = run(arrive_second_worker, 2, "shm", args=(str(tmp_path / "done"),), timeout=120)
    assert max(took) < 5.0, f"20 warm allreduces took {max(took):.1f} s"


def warm_stall_worker() -> dict:
    import os

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    logs = capture_horovod_logs(wanted="allreduce.stalled_tensor")
    hvd.init()
    for _ in range(3):   # both tensors go warm
        hvd.allreduce(np.ones(3), name="stalled_tensor", op=hvd.Sum)
        hvd.allreduce(np.ones(2000), name="go", op=hvd.Sum)
    out = {}
    if rank == 0:
        h = hvd.allreduce_async(np.ones(3), name="stalled_tensor", op=hvd.Sum)
        out["warned"] = logs.event.wait(60)  # the others only submit after "go", which needs rank 0
        hvd.allreduce(np.ones(2000), name="go", op=hvd.Sum)
        out["result"] = hvd.synchronize(h).tolist()
    else:
        hvd.allreduce(np.ones(2000), name="go", op=hvd.Sum)
        out["result"] = hvd.allreduce(np.ones(3), name="stalled_tensor", op=hvd.Sum).tolist()
    out["log"] = logs.text
    hvd.shutdown()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_stall_inspector_names_the_ranks_missing_for_a_warm_tensor(transport):
    results = _run(warm_stall_worker, 3, transport, env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"}, timeout=90)
    assert results[0]["warned"], results[0]["log"]
    line = next(ln for ln in results[0]["log"].splitlines() if "allreduce.stalled_tensor" in ln)
    assert "[1, 2]" in line, line
    assert all(r["result"] == [3.0] * 3 for r in results)


def warm_kill_worker() -> dict:
    import os
    import signal

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    hvd.init()
    x = np.ones(5000, np.float32)
    for _ in range(3):
        hvd.allreduce_(x, name="w", op=hvd.Sum)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)   # the others wait in a round for this rank
    try:
        hvd.allreduce_(x, name="w", op=hvd.Sum)
        return {"error": None}
    except Exception as exc:  # noqa: BLE001
        return {"error": (type(exc).__name__, isinstance(exc, hvd.HorovodInternalError), str(exc))}
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_killed_while_the_others_wait_in_a_round_fails_them_naming_it(transport):
    results = _run(warm_kill_worker, 3, transport, env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "5"}, timeout=60,
                  expect_failure=True)
    assert results[2][0] == "died", results[2]
    for rank in (0, 1):
        status, out = results[rank]
        assert status == "ok", out
        name, internal, text = out["error"]
        assert internal and "rank 2" in text, (rank, name, text)


def test_a_frozen_rank_while_the_others_wait_in_a_round_over_tcp_is_named():
    from test_engine_regressions import frozen_peer_worker

    results = _run(frozen_peer_worker, 3, "tcp", args=(2, True), env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "3"},
                   timeout=90, expect_failure=True)
    outcomes = {rank: value["outcome"] for rank, (status, value) in enumerate(results) if status == "ok"}
    assert set(outcomes) == {0, 1}, results
    for rank, (kind, text) in outcomes.items():
        assert kind == "HorovodInternalError" and "rank 2" in text, (rank, kind, text)



def test_the_drivers_deadline_reads_hits_under_the_lock_user_threads_add_them_with():
    # Regression: a TF1 graph at np = 3 runs many kernels at once; one thread's take() added hits while another,
    # driving, iterated them for its select timeout: "dictionary changed size during iteration" failed a rank.
    import threading

    from horovod.engine.warm import WarmPath

    names = [f"t{i}" for i in range(512)]
    warm = WarmPath(None, 512)   # the board is not used by taking hits or by the deadline
    msg = _cold_message(SlotTable(512), names)
    warm.apply(msg, {n: _req(0, n) for n in names})
    requests = [_req(0, n) for n in names]
    stop, errors = threading.Event(), []

    def churn():
        while not stop.is_set():
            warm.take(requests, 0.0)
            with warm.lock:
                warm.state.hits.clear()

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        for _ in range(3000):
            try:
                warm.next_deadline()
            except RuntimeError as exc:
                errors.append(exc)
                break
    finally:
        stop.set()
        thread.join(10)
    assert not errors, errors
