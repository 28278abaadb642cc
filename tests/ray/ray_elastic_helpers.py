"""The driver side of the elastic Ray tests (a helper, not a test): a job running in the background, and the checks
of what its workers logged (ray_elastic_worker.py writes the log; any framework's ``train`` of that file's shape
runs here)."""
from __future__ import annotations

import functools
import json
import os
import threading
from typing import Callable

import numpy as np

from ray_elastic_worker import replay
from ray_helpers import pid_alive, wait_until

#: Generous: Ray notices a dead node through missed health checks, and the machine is shared.
PHASE_TIMEOUT = 120


class Job:
    """An elastic job running ``train(log, stop, min_steps)`` in a background thread, and what its workers logged.

    ``train`` must be importable by the actors (a module of this folder), as ``ray_elastic_worker.train`` is.
    """

    def __init__(self, executor, tmp_path, train: Callable, min_steps=0):
        self.executor = executor
        self.train = train
        self.log = str(tmp_path / "events.jsonl")
        self.stop = str(tmp_path / "stop")
        self.result = None
        self.error = None
        self.logged = []   # what rank 0 sent through ray_logger, received by the callback
        self.min_steps = min_steps
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            # Both executors' run() take a function of no arguments.
            self.result = self.executor.run(functools.partial(self.train, self.log, self.stop, self.min_steps),
                                            callbacks=[self.logged.append])
        except BaseException as exc:   # noqa: BLE001 - re-raised in finish()
            self.error = exc

    def start(self):
        self.executor.start()
        self.thread.start()
        return self

    def events(self, kind=None):
        if not os.path.exists(self.log):
            return []
        with open(self.log) as handle:
            events = [json.loads(line) for line in handle if line.strip()]
        return [e for e in events if kind is None or e["ev"] == kind]

    def wait_for_commits(self, size, after_epoch=-1, count=3):
        """Wait until ``count`` steps were committed at ``size`` in an epoch after ``after_epoch``; its epoch."""
        def found():
            if self.error is not None:
                raise AssertionError(f"the job failed: {self.error!r}")
            hits = [e for e in self.events("commit") if e["size"] == size and e["epoch"] > after_epoch
                    and e["rank"] == 0]
            return hits[count - 1]["epoch"] + 1 if len(hits) >= count else None
        return wait_until(found, PHASE_TIMEOUT, f"{count} commits at size {size} after epoch {after_epoch}") - 1

    def finish(self):
        open(self.stop, "w").close()
        self.thread.join(PHASE_TIMEOUT)
        assert not self.thread.is_alive(), "the job did not end after the stop file appeared"
        if self.error is not None:
            raise self.error
        return self.result


def check_no_workers_left(job):
    pids = {e["pid"] for e in job.events()}
    wait_until(lambda: not any(pid_alive(p) for p in pids), 60, f"worker processes {sorted(pids)} to exit")


def check_continuity(job, results):
    """One unbroken run of steps, the model exact, and every reset resumed from the newest commit."""
    final = results[0]
    assert [r["rank"] for r in results] == list(range(len(results)))
    steps = [s for s, _ in final["history"]]
    assert steps == list(range(final["step"])), "a step was skipped or trained twice"
    np.testing.assert_array_equal(np.array(final["w"]), replay(final["history"]))
    for r in results:
        assert r["w"] == final["w"] and r["step"] == final["step"]
    commits = job.events("commit")
    joins = job.events("join")
    for join in joins:
        if join["epoch"] == 0:
            assert join["step"] == 0
            continue
        # Whatever the members of this epoch had committed before it began is kept: it resumes from the newest
        # commit among them (a worker that died meanwhile may have logged a step it never saved).
        members = {(j["id"], j["pid"]) for j in joins if j["epoch"] == join["epoch"]}
        before = [c["step"] for c in commits if c["epoch"] < join["epoch"] and (c["id"], c["pid"]) in members]
        assert join["step"] == max(before, default=0), (join, max(before, default=0))


def kill_an_actor_mid_training(tmp_path, train: Callable, min_workers: int, max_workers: int) -> Job:
    """A ``RayExecutor`` elastic job of ``train`` at ``max_workers`` ranks; once it committed at that size, one
    actor is killed; a new actor takes the dead one's slot (its node still has room) and training goes on at the
    same size.  Checks what every such job must show and returns the finished job for more."""
    import ray

    from horovod.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=min_workers,
                           max_workers=max_workers, cpus_per_worker=1, elastic_timeout=120)
    job = Job(executor, tmp_path, train).start()
    try:
        first = job.wait_for_commits(size=max_workers)
        victim = executor.driver.current_members()[-1]
        ray.kill(executor.driver.worker_actors()[victim], no_restart=True)
        job.wait_for_commits(size=max_workers, after_epoch=first)
        results = job.finish()
    finally:
        executor.shutdown()
    assert len(results) == max_workers
    check_continuity(job, results)
    assert max(e["epoch"] for e in job.events("join")) >= 1, "the kill must have caused a reset"
    assert executor.driver._resets >= 1
    # Rank 0's ray_logger entries reached the caller's callback, all at the job's one size.
    assert job.logged and {entry["size"] for entry in job.logged} == {max_workers}, job.logged[-3:]
    check_no_workers_left(job)
    return job
