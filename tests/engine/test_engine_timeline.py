"""Timeline: Chrome-trace JSON written by rank 0 (HOROVOD_TIMELINE=path, or DYNAMIC + start/stop_timeline).

Also the place where tensor fusion becomes visible from outside: a fused response shows
MEMCPY_IN_FUSION_BUFFER activities, and HOROVOD_FUSION_THRESHOLD=0 makes them disappear.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from engine_helpers import run

OPS_AND_NAMES = {
    "ALLREDUCE": "allreduce.tl_ar",
    "ALLGATHER": "allgather.tl_ag",
    "BROADCAST": "broadcast.tl_bc",
    "ALLTOALL": "alltoall.tl_a2a",
    "REDUCESCATTER": "reducescatter.tl_rs",
    "BARRIER": "barrier.noname.0",  # unnamed: numbered like every unnamed op of its set
}


def timeline_ops(path: str) -> dict:
    """A little of everything; rank 0 also checks that the file is valid JSON while the job runs."""
    import json
    import os
    import time

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    out = {}
    hvd.init()
    size = hvd.size()
    hvd.allreduce(np.ones((5, 3), np.float32), name="tl_ar")
    # members above the inline limit go through the data plane and are fused
    hvd.grouped_allreduce([np.ones(2048, np.float32), np.ones(1500, np.float32)], name="tl_grp")
    hvd.allgather(np.ones((rank + 1, 2)), name="tl_ag")
    hvd.broadcast(np.ones(4, np.int32), 0, name="tl_bc")
    hvd.alltoall(np.ones(2 * size), name="tl_a2a")
    hvd.reducescatter(np.ones((4, 2)), name="tl_rs")
    hvd.barrier()
    if rank == 0:
        # Valid JSON mid-run, between the writer thread's flushes (a read racing a flush may see it half done).
        for _ in range(100):
            try:
                with open(path) as f:
                    json.load(f)
                break
            except json.JSONDecodeError:
                time.sleep(0.02)
        else:
            raise AssertionError("the timeline is not valid JSON between flushes")
        out["mid_run_valid"] = True
    hvd.shutdown()
    out["other_rank_file_exists"] = os.path.exists(path + ".rank1")
    return out


def _load(path):
    with open(path) as f:
        return json.load(f)


def _pid_names(events):
    return {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})}


def _events_by_name(events):
    pids = _pid_names(events)
    by = defaultdict(list)
    for e in events:
        if e.get("ph") in ("B", "E", "X") and e.get("pid") in pids:
            by[pids[e["pid"]]].append(e)
    return by


@pytest.mark.parametrize("threshold", [None, "0"])
def test_timeline_file_is_valid_chrome_trace(tmp_path, threshold):
    path = str(tmp_path / "timeline.json")
    env = {"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    if threshold is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = threshold
    results = run(timeline_ops, 2, "tcp", args=(path,), env=env, timeout=60,
                  rank_env_overrides={1: {"HOROVOD_TIMELINE": path + ".rank1"}})
    assert results[0]["mid_run_valid"]
    assert not results[1]["other_rank_file_exists"], "only rank 0 writes a timeline"
    events = _load(path)
    assert isinstance(events, list) and events
    head = events[0]
    assert head["name"] == "process_name" and head["ph"] == "M" and head["pid"] == 0
    assert isinstance(head["args"]["start_time_since_epoch_in_micros"], int)
    assert events[1] == {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}

    names = Counter(e.get("name") for e in events)
    for op in OPS_AND_NAMES:
        assert names[f"NEGOTIATE_{op}"] >= 1, f"no NEGOTIATE_{op} event"
        assert names[op] >= 1, f"no {op} event"
    assert names["CYCLE_START"] >= 1
    assert all(e.get("s") == "g" for e in events if e.get("name") == "CYCLE_START")
    assert all(e["ph"] == "i" for e in events if e.get("name") == "CYCLE_START")

    pids = _pid_names(events)
    assert set(OPS_AND_NAMES.values()) | {"grouped_allreduce.tl_grp_1of2", "grouped_allreduce.tl_grp_2of2"} \
        <= set(pids.values()), sorted(pids.values())
    assert sorted(pids) == list(range(1, len(pids) + 1)), "tensor pids are 1, 2, ... in first-seen order"

    by = _events_by_name(events)
    for tensor, evs in by.items():
        kinds = Counter(e["ph"] for e in evs)
        assert kinds["B"] == kinds["E"], f"{tensor}: unbalanced B/E {kinds}"
        depth = 0
        for e in evs:  # well nested, in file order
            depth += {"B": 1, "E": -1}.get(e["ph"], 0)
            assert depth >= 0, f"{tensor}: E before its B"
        assert all(e.get("name") != "" for e in evs if e["ph"] == "B")
        assert all("name" not in e for e in evs if e["ph"] == "E"), f"{tensor}: E events carry no name"
    ar = by["allreduce.tl_ar"]
    assert {e["name"] for e in ar if e["ph"] == "X"} == {"0", "1"}, "one tick per rank while negotiating"
    assert all(e.get("dur") == 0 for e in ar if e["ph"] == "X")
    final = [e for e in ar if e["ph"] == "E" and "args" in e][-1]
    assert final["args"] == {"dtype": "float32", "shape": "[5, 3]"}
    assert all(isinstance(e["ts"], int) and e["ts"] >= 0 for e in events if "ts" in e)

    fused = {pids[e["pid"]] for e in events if e.get("name") == "MEMCPY_IN_FUSION_BUFFER"}
    group = {"grouped_allreduce.tl_grp_1of2", "grouped_allreduce.tl_grp_2of2"}
    if threshold == "0":
        assert not fused, f"HOROVOD_FUSION_THRESHOLD=0 must disable fusion, but {fused} were fused"
    else:
        assert group <= fused, f"the group was not fused: {fused}"


def dynamic_worker(path: str) -> dict:
    import json
    import os

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    mine = path if rank == 0 else path + f".rank{rank}"
    out = {}
    hvd.init()
    hvd.allreduce(np.ones(3), name="before_start")
    out["exists_before_start"] = os.path.exists(mine)
    hvd.start_timeline(mine, mark_cycles=False)
    hvd.allreduce(np.ones(3), name="while_on")
    hvd.allgather(np.ones(2), name="while_on_ag")
    hvd.stop_timeline()
    hvd.barrier()  # every rank stopped before the next op
    hvd.allreduce(np.ones(3), name="after_stop")
    if rank == 0:
        with open(mine) as f:
            out["names_after_stop"] = sorted({e["args"]["name"] for e in json.load(f)
                                              if e.get("name") == "process_name" and "name" in e.get("args", {})})
    # a second start / stop writes a fresh file
    hvd.start_timeline(mine + ".2")
    hvd.allreduce(np.ones(3), name="second_window")
    hvd.stop_timeline()
    hvd.shutdown()
    out["other_rank_files"] = os.path.exists(mine) if rank else None
    return out


def test_dynamic_timeline_records_only_between_start_and_stop(tmp_path):
    path = str(tmp_path / "dyn.json")
    results = run(dynamic_worker, 2, "tcp", args=(path,), env={"HOROVOD_TIMELINE": "DYNAMIC"}, timeout=60)
    assert not results[0]["exists_before_start"], "DYNAMIC must not write anything before start_timeline()"
    assert results[1]["other_rank_files"] is False, "only rank 0 writes a timeline"
    names = set(results[0]["names_after_stop"])
    assert {"allreduce.while_on", "allgather.while_on_ag"} <= names, names
    assert "allreduce.before_start" not in names and "allreduce.after_stop" not in names, names
    events = _load(path)
    assert any(e.get("name") == "NEGOTIATE_ALLREDUCE" for e in events)
    second = _pid_names(_load(path + ".2"))
    assert set(second.values()) == {"allreduce.second_window"}, second


def killed_writer_worker() -> int:
    import os
    import signal

    import numpy as np

    import horovod.numpy as hvd

    rank = int(os.environ["HOROVOD_RANK"])
    hvd.init()
    for i in range(200):
        hvd.allreduce(np.ones(10), name=f"k{i}")
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # no shutdown, no flush, no closing bracket written at exit
    try:
        hvd.allreduce(np.ones(10), name="after_kill")
    except hvd.HorovodInternalError:
        pass
    hvd.shutdown()
    return 0


def test_timeline_stays_valid_json_when_rank_0_is_killed(tmp_path):
    path = str(tmp_path / "killed.json")
    results = run(killed_writer_worker, 2, "tcp", env={"HOROVOD_TIMELINE": path}, timeout=60, expect_failure=True)
    assert results[0][0] == "died" and results[1][0] == "ok", results
    names = set(_pid_names(_load(path)).values())
    assert "allreduce.k0" in names
