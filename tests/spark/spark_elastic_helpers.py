"""The scenario the ``horovod.spark.run_elastic`` tests share, whatever framework trains (a helper, not a test).

A two-rank job trains ``steps`` steps, committing after each.  When rank 1 reaches ``kill_at`` it writes which
Spark Python worker runs its task (that worker's pid and its own) to ``victim`` in the log directory and waits; a
thread of the test kills that Python worker, and the job must go on, the survivor resuming from its last commit.

Each test keeps only its training function (which calls :func:`log_event` on entering training and
:func:`park_if_victim` before every step, and returns :func:`result`) and its own assertions beyond
:func:`check_resumed_from_last_commit`.  The functions the executors run are shipped by value, so executors do
not need this folder on their path.
"""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import cloudpickle
import numpy as np

import horovod.spark

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: How long the victim waits to be killed, and how long the test's killer waits for a victim (seconds).
PARK_S = 120.0
KILLER_WAIT_S = 240.0


def log_event(log_dir: str, **event: Any) -> None:
    """Append ``event`` (with this process's pid and its parent's, the Spark Python worker) to ``events``."""
    event.update(pid=os.getpid(), task_pid=os.getppid())
    with open(os.path.join(log_dir, "events"), "a") as handle:
        handle.write(json.dumps(event) + "\n")


def park_if_victim(log_dir: str, rank: int, step: int, kill_at: int) -> None:
    """On rank 1 at step ``kill_at`` (once per test): name this task's Spark Python worker, wait to be killed."""
    victim = os.path.join(log_dir, "victim")
    if rank != 1 or step != kill_at or os.path.exists(victim):
        return
    with open(victim + ".tmp", "w") as handle:
        handle.write(f"{os.getppid()} {os.getpid()}")
    os.rename(victim + ".tmp", victim)   # atomic: the killer never reads half a line
    time.sleep(PARK_S)


def result(rank: int, step: int, w: Sequence[float], sizes: Sequence[int]) -> Dict[str, Any]:
    """What a training function returns: what :func:`check_resumed_from_last_commit` reads."""
    return dict(step=step, w=[float(v) for v in w], sizes=list(sizes), rank=rank, pid=os.getpid())


def _kill_victim(log_dir: str, killed: List[int], timeout: float = KILLER_WAIT_S) -> None:
    path = os.path.join(log_dir, "victim")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as handle:
                task_pid, worker_pid = map(int, handle.read().split())
            os.kill(task_pid, signal.SIGKILL)   # the executor's Python worker running rank 1's task
            killed.extend([task_pid, worker_pid])
            return
        time.sleep(0.1)


def run_killing_rank_1(train: Callable[[str], Dict[str, Any]], log_dir: str) -> Tuple[List[dict], List[int]]:
    """Run ``train(log_dir)`` under ``run_elastic`` on 2 ranks (1 at least) while rank 1's Python worker is
    killed; returns the results of the last ranks and ``[killed Python worker pid, rank 1's pid]``."""
    killed: List[int] = []
    killer = threading.Thread(target=_kill_victim, args=(log_dir, killed), daemon=True)
    killer.start()
    results = horovod.spark.run_elastic(train, args=(log_dir,), num_proc=2, min_num_proc=1, max_num_proc=2,
                                        start_timeout=120, elastic_timeout=120, verbose=0,
                                        stdout=io.StringIO(), stderr=io.StringIO())
    killer.join(5)
    assert killed, "rank 1 never reached the step where its Spark task is killed"
    return results, killed


def joins(log_dir: str) -> List[dict]:
    """The ``join`` events every training function logged on entering training, in order."""
    with open(os.path.join(log_dir, "events")) as handle:
        events = [json.loads(line) for line in handle.read().splitlines()]
    return [e for e in events if e["ev"] == "join"]


def check_resumed_from_last_commit(results: List[dict], killed: List[int], log_dir: str, steps: int,
                                   kill_at: int) -> None:
    """Every rank of the last epoch finished with a state consistent with the sizes it trained at, and the
    survivor resumed from its last commit, not from scratch; the killed task's rank is gone."""
    assert results and [r["rank"] for r in results] == list(range(len(results)))
    for r in results:
        assert r["step"] == steps and len(r["sizes"]) == steps
        np.testing.assert_allclose(r["w"], [sum(r["sizes"])] * 2)   # every step added the size it trained at
    # Before the kill both ranks trained together.
    assert results[0]["sizes"][:kill_at] == [2] * kill_at

    joined = joins(log_dir)
    survivor = [e for e in joined if e["step"] == 0 and e["rank"] == 0][0]["pid"]
    resumed = [e for e in joined if e["pid"] == survivor and e["step"] > 0]
    assert resumed and resumed[0]["step"] == kill_at, joined
    assert survivor in [r["pid"] for r in results]
    # The killed task's rank went with its Python worker; the retried task (a new host) may have joined.
    _, worker_pid = killed
    assert worker_pid not in [r["pid"] for r in results]
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker_pid}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{worker_pid}"), f"rank 1 (pid {worker_pid}) outlived its Python worker"
