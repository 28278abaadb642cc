"""The flight recorder's records and the doctor's verdict as pure functions (the planted hangs across real
processes are in test_planted_hangs.py)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from horovod.doctor import diagnose, load, report
from horovod.doctor.dumps import LAUNCHER_FILE, DumpDirectoryError, Job
from horovod.doctor.trace import events
from horovod.doctor.verdict import display_name, ranks_text, where
from horovod.engine import ops
from horovod.engine.flight_recorder import FlightRecorder
from horovod.engine.messages import ERROR, Request, Response


# -- the recorder ----------------------------------------------------------------------------------------------

def issued(*requests: Request) -> list:
    """The entries of ``requests`` as the intake hands them to the recorder (it reads each one's request)."""
    return [SimpleNamespace(request=r) for r in requests]


def test_recorder_follows_a_collective_through_its_states():
    rec = FlightRecorder(10)
    a = Request(0, "allreduce.a", ops.ALLREDUCE, "float32", (4, 2))
    b = Request(0, "allgather.b", ops.ALLGATHER, "int64", (3,), process_set=2, device=1)
    c = Request(0, "allreduce.c", ops.ALLREDUCE, "float16", (8,))
    rec.enqueued(issued(a, b))
    rec.enqueued(issued(c))
    resp_a = Response(ops.ALLREDUCE, ["allreduce.a"])
    rec.negotiated()
    rec.started(resp_a)
    rec.finished(resp_a)
    rec.failed(Response(ERROR, ["allreduce.c"], error="Stalled collective", error_kind="stall"))
    records = rec.snapshot()
    assert [r["seq"] for r in records] == [1, 2, 3]
    first, second, third = records
    assert first["state"] == "done" and first["bytes"] == 4 * 2 * 4 and first["shape"] == [4, 2]
    assert first["enqueued"] <= first["negotiated"] <= first["started"] <= first["finished"]
    assert second["state"] == "enqueued" and second["process_set"] == 2 and second["device"] == 1
    assert second["kind"] == "allgather" and second["bytes"] == 24 and second["negotiated"] is None
    assert third["state"] == "failed" and third["error"].startswith("stall")
    json.dumps(records)   # plain data


def test_recorder_keeps_only_its_capacity_and_counts_everything():
    rec = FlightRecorder(5)
    for i in range(50):
        req = Request(0, f"allreduce.t{i}", ops.ALLREDUCE, "float32", (1,))
        rec.enqueued(issued(req))
        resp = Response(ops.ALLREDUCE, [req.name])
        rec.negotiated()
        rec.started(resp)
        rec.finished(resp)
    records = rec.snapshot()
    assert rec.count == 50
    assert [r["seq"] for r in records] == [46, 47, 48, 49, 50]
    assert all(r["state"] == "done" for r in records)


def test_recorder_finishes_what_completes_without_running():
    """Joins and process-set changes complete without a data-plane run: they must not look pending."""
    rec = FlightRecorder(4)
    req = Request(0, "add_process_set.x", ops.ADD_PROCESS_SET, "uint8", ())
    rec.enqueued(issued(req))
    rec.negotiated()
    rec.finished(Response(ops.ADD_PROCESS_SET, [req.name]))
    (only,) = rec.snapshot()
    assert only["state"] == "done" and only["kind"] == "add_process_set" and only["started"] is None
    assert only["negotiated"] is not None


def test_recorder_lane_and_disabled_and_bad_capacity():
    rec = FlightRecorder(3)
    req = Request(0, "allreduce.x", ops.ALLREDUCE, "float32", (2,))
    rec.enqueued(issued(req))
    rec.lane_done(req)
    (only,) = rec.snapshot()
    assert only["state"] == "done" and only["negotiated"] == only["started"] == only["finished"]
    off = FlightRecorder(0)
    off.enqueued(issued(req))
    assert off.snapshot() == [] and off.count == 0
    with pytest.raises(ValueError, match="HOROVOD_FLIGHT_RECORDER_SIZE"):
        FlightRecorder(-1)


# -- dumps as the engine writes them, built by hand ------------------------------------------------------------

LIB = "/usr/lib/python3/site-packages/horovod/engine/handles.py"


def frames(*user_lines, lib_tail=True):
    out = [["/job/train.py", line, "main", code, False] for line, code in user_lines]
    if lib_tail:
        out.append([LIB, 86, "wait", "raise self.error", True])
    return out


def coll(seq, name, kind="allreduce", state="done", pset=0, t=100.0):
    return {"seq": seq, "name": name, "kind": kind, "process_set": pset, "dtype": "float32", "shape": [4],
            "bytes": 16, "device": -1, "enqueued": t + seq, "negotiated": None if state == "enqueued" else t + seq,
            "started": t + seq if state in ("started", "done") else None,
            "finished": t + seq if state == "done" else None, "state": state}


def dump(rank, size, collectives, stack, *, wall=1000.0, mono=200.0, sets=None, role="rank", generation=0, pid=None):
    return {"format": 1, "reason": "test", "job": "j", "generation": generation, "rank": rank, "size": size,
            "host": "h", "pid": pid or 100 + rank, "role": role, "wall_time": wall, "monotonic": mono,
            "process_sets": sets or {"0": list(range(size))}, "collectives_enqueued": len(collectives),
            "collectives": collectives, "coordinator": None,
            "threads": [{"name": "MainThread", "main": True, "frames": stack},
                        {"name": "horovod-background", "main": False, "frames": [[LIB, 1, "run", "", True]]}]}


def history(n=3):
    """n healthy steps of (a, b) on every rank: collectives 1 .. 2n."""
    out = []
    for step in range(n):
        out += [coll(2 * step + 1, "allreduce.grad.a"), coll(2 * step + 2, "allreduce.grad.b")]
    return out


def test_a_rank_in_user_code_is_named_with_its_line_and_the_waiters():
    n = len(history())
    job = Job(size=3, ranks={
        0: dump(0, 3, history() + [coll(n + 1, "allreduce.grad.a", state="negotiated")],
                frames((30, "hvd.allreduce(g, name='grad.a')"))),
        1: dump(1, 3, history() + [coll(n + 1, "allreduce.grad.a", state="enqueued")],
                frames((30, "hvd.allreduce(g, name='grad.a')"))),
        2: dump(2, 3, history(), frames((88, "batch = next(loader)"), lib_tail=False)),
    })
    (finding,) = diagnose(job)
    assert finding.startswith(f"rank 2 never submitted allreduce 'grad.a' (its collective #{n + 1}): it is in "
                              f"train.py:88 (`batch = next(loader)`) (no collective for ")
    assert "ranks 0 and 1 wait in it (train.py:30 (`hvd.allreduce(g, name='grad.a')`))" in finding


def test_a_forked_child_that_dumped_is_named():
    job = Job(size=2, ranks={
        0: dump(0, 2, [coll(1, "allreduce.x", state="enqueued")], frames((5, "hvd.allreduce(x)"))),
        1: dump(1, 2, [], frames((9, "conn.recv()"), lib_tail=False)),
    }, children={1: [dump(1, 2, [], frames((40, "time.sleep(600)"), lib_tail=False), role="child", pid=4251)]})
    (finding,) = diagnose(job)
    assert "rank 1 never submitted allreduce 'x'" in finding
    assert "its child process (pid 4251, a data loader worker?) in train.py:40 (`time.sleep(600)`)" in finding


def test_opposite_orders_without_history_and_skip_with_it():
    crossed = Job(size=2, ranks={
        0: dump(0, 2, [coll(1, "allgather.a", "allgather", "enqueued")], frames((10, "hvd.allgather(x, name='a')"))),
        1: dump(1, 2, [coll(1, "allreduce.b", "allreduce", "enqueued")], frames((20, "hvd.allreduce(y, name='b')"))),
    })
    (finding,) = diagnose(crossed)
    assert finding.startswith("ranks 0 and 1 issued allgather 'a' and allreduce 'b' in opposite orders")
    assert "rank 0 waits in allgather 'a' at train.py:10" in finding
    assert "rank 1 waits in allreduce 'b' at train.py:20" in finding

    n = len(history())
    skipped = Job(size=3, ranks={
        0: dump(0, 3, history() + [coll(n + 1, "allreduce.grad.a", state="enqueued")], frames((30, "a"))),
        1: dump(1, 3, history() + [coll(n + 1, "allreduce.grad.a", state="enqueued")], frames((30, "a"))),
        2: dump(2, 3, history() + [coll(n + 1, "allreduce.grad.b", state="enqueued")], frames((31, "b"))),
    })
    (finding,) = diagnose(skipped)
    assert finding.startswith(f"rank 2 skipped allreduce 'grad.a' (the others' collective #{n + 1}) and went on to "
                              f"allreduce 'grad.b', the collective that followed it in earlier steps")
    assert "train.py:31" in finding and "ranks 0 and 1 wait in it (train.py:30" in finding


def test_process_set_mismatch_in_flight_and_completed():
    sets = {"0": [0, 1, 2], "1": [1, 2]}
    in_flight = Job(size=3, ranks={
        r: dump(r, 3, [coll(1, "allreduce.noname.0", state="enqueued")], frames((7, "hvd.allreduce(x)")), sets=sets)
        for r in (0, 2)})
    in_flight.ranks[1] = dump(1, 3, [coll(1, "allreduce.noname.0.set1", state="enqueued", pset=1)],
                              frames((8, "hvd.allreduce(x, process_set=ps)")), sets=sets)
    (finding,) = diagnose(in_flight)
    assert finding.startswith("process-set mismatch: ranks 0, 2 issued an unnamed allreduce ('allreduce.noname.0') "
                              "(collective #1) on the global process set, but rank 1 issued")
    assert "on process set 1 (ranks [1, 2]) at train.py:8" in finding

    solo = {"0": [0, 1], "1": [1]}
    completed = Job(size=2, ranks={
        0: dump(0, 2, [coll(1, "allreduce.noname.0", state="enqueued")], frames((7, "hvd.allreduce(x)")), sets=solo),
        1: dump(1, 2, [coll(1, "allreduce.noname.0.set1", pset=1)], frames((9, "time.sleep(600)"), lib_tail=False),
                sets=solo)})
    (finding,) = diagnose(completed)
    assert finding.startswith("process-set mismatch: rank 0 issued an unnamed allreduce ('allreduce.noname.0')")
    assert "on process set 1 (ranks [1]) instead; it is now in train.py:9 (`time.sleep(600)`)" in finding


@pytest.mark.parametrize("launcher,expected", [
    ({"host": "b", "pid": 4242, "state": "stopped"}, "rank 1 (host b, pid 4242) is stopped (SIGSTOP"),
    ({"host": "b", "pid": 4242, "state": "exited", "returncode": -9, "signal": "SIGKILL"},
     "rank 1 (host b, pid 4242) was killed by SIGKILL"),
    ({"host": "b", "pid": 4242, "state": "exited", "returncode": 3}, "rank 1 (host b, pid 4242) exited with code 3"),
    (None, "rank 1 is stopped/not responding (it wrote no dump"),
])
def test_a_rank_without_a_dump(launcher, expected):
    job = Job(size=2, ranks={0: dump(0, 2, history(1) + [coll(3, "allreduce.grad.c", state="enqueued")],
                                     frames((12, "hvd.allreduce(c, name='grad.c')")))},
              launcher={1: launcher} if launcher else {})
    (finding,) = diagnose(job)
    assert finding.startswith(expected)
    assert "its last completed collective was allreduce 'grad.b' (#2 on rank 0)" in finding
    assert finding.endswith("rank 0 waits in allreduce 'grad.c' (train.py:12 (`hvd.allreduce(c, name='grad.c')`))")


def test_nothing_waiting():
    job = Job(size=2, ranks={r: dump(r, 2, history(1), frames((50, "train()"), lib_tail=False)) for r in (0, 1)})
    assert diagnose(job) == ["no collective is waiting on any rank (all completed): rank 0 in train.py:50 "
                             "(`train()`); rank 1 in train.py:50 (`train()`)"]


def test_text_helpers():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([1, 0]) == "ranks 0 and 1"
    assert ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0–2, 5, 7, 8"
    assert display_name("allreduce.grad.fc1.weight") == "grad.fc1.weight"
    assert display_name("allreduce.noname.4") == "allreduce.noname.4"
    assert where(dump(0, 1, [], [])) == "an unknown place (no Python stack)"
    only_lib = dump(0, 1, [], [[LIB, 86, "wait", "x", True]])
    assert where(only_lib) == "handles.py:86 (`x`)"
    shipped = dump(0, 1, [], [["<dynamic-code>", 12, "train_fn", "", False]])
    assert where(shipped) == "train_fn() at <dynamic-code>:12"


# -- the directory ----------------------------------------------------------------------------------------------

def _write(directory, name, data):
    with open(os.path.join(directory, name), "w") as handle:
        json.dump(data, handle)


def test_load_picks_the_newest_generation_and_each_ranks_first_dump(tmp_path):
    d = str(tmp_path)
    _write(d, "g0-rank0-1-1.json", dump(0, 2, [], frames((1, "old")), generation=0, wall=10.0))
    _write(d, "g1-rank0-1-2.json", dump(0, 2, [], frames((2, "first")), generation=1, wall=20.0))
    _write(d, "g1-rank0-1-3.json", dump(0, 2, [], frames((3, "second")), generation=1, wall=30.0))
    _write(d, "g1-rank1-2-4.json", dump(1, 2, [], frames((4, "one")), generation=1, wall=25.0))
    _write(d, "g1-rank1-9-5.json", dump(1, 2, [], frames((5, "kid")), generation=1, wall=26.0, role="child"))
    _write(d, LAUNCHER_FILE, {"ranks": {"1": {"host": "h", "pid": 2, "state": "running"}}})
    _write(d, "unrelated.json", {"hello": 1})
    job = load(d)
    assert job.generation == 1 and job.size == 2 and sorted(job.ranks) == [0, 1]
    assert where(job.ranks[0]) == "train.py:2 (`first`)"
    assert where(load(d, latest=True).ranks[0]) == "train.py:3 (`second`)"
    assert [where(c) for c in job.children[1]] == ["train.py:5 (`kid`)"]
    assert job.launcher[1]["pid"] == 2
    lines = report(d)
    assert lines[0] == "Horovod doctor (2 of 2 ranks dumped, generation 1):"
    trace = json.load(open(os.path.join(d, "trace.json")))
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}


def test_load_refuses_an_empty_or_missing_directory(tmp_path):
    with pytest.raises(DumpDirectoryError, match="no Horovod flight recorder dumps"):
        load(str(tmp_path))
    with pytest.raises(DumpDirectoryError, match="not a directory"):
        load(str(tmp_path / "nope"))


def test_trace_has_a_slice_per_collective_on_the_wall_clock():
    d = dump(0, 1, [coll(1, "allreduce.a"), coll(2, "allreduce.b", state="enqueued")], frames((1, "x")),
             wall=1000.0, mono=200.0)
    evs = [e for e in events(Job(size=1, ranks={0: d})) if e["ph"] == "X" and e["name"].startswith("allreduce")]
    assert [e["name"] for e in evs] == ["allreduce allreduce.a", "allreduce allreduce.b"]
    # enqueued at monotonic 101 = 99 s before the dump at wall 1000
    assert evs[0]["ts"] == pytest.approx((1000.0 - 99.0) * 1e6)
    assert evs[1]["dur"] == pytest.approx((200.0 - 102.0) * 1e6)   # still waiting: up to the dump
    assert np.isfinite([e["ts"] for e in evs]).all()
