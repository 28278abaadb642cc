"""Helpers of the elastic fault-injection tests: run a real ``horovodrun`` elastic job and read its training log.

:class:`ElasticJob` starts the launcher with a discovery script that prints a file the test rewrites, so a
test adds and removes "hosts" while the job runs ("localhost", "127.0.0.1" and this machine's host name are
three host names for this one machine).  The workers run ``elastic_worker.py``, which logs every join, commit
and the final state; :func:`check_training` verifies from that log that no committed step was lost and that
the final model equals the one recomputed from the committed sequence of (step, size).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "elastic_worker.py"

#: Ceiling for any single wait of a test (seconds).
WAIT_S = 60.0
#: Ceiling for all the waits of one job together; the conftest's hard per-test timeout sits above it, so a slow
#: or stuck job fails with its output instead of killing the test run.
JOB_BUDGET_S = 120.0


def third_host() -> Optional[str]:
    """A third name of this machine (its host name), if it differs from localhost and 127.0.0.1."""
    name = socket.gethostname()
    return name if name not in ("localhost", "127.0.0.1", "") else None


def child_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_") and k != "_HOROVOD_SECRET_KEY"}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


class ElasticJob:
    """One ``horovodrun`` elastic job of ``elastic_worker.py`` in ``directory``.

    Args:
        directory: where the host list, the discovery script, the logs and the stop file live.
        hosts: initial discovery output lines (``host:slots``).
        args: ``horovodrun`` arguments before the discovery script (``-np``, ``--min-np``, ...).
        faults: ``[{"id": worker id, "step": s}]``: those workers raise once at step ``s``.
        min_steps: the job trains at least this many steps.
        step_delay: seconds each worker sleeps after a step.
        worker: the training script (``elastic_worker.py``; ``torch_worker.py`` logs the same way).
        wrap: argv the launcher runs under (e.g. ``ip netns exec <driver namespace>``).
        env: more variables for the launcher (and through it, the workers).
    """

    def __init__(self, directory: Path, hosts: Sequence[str], args: Sequence[str],
                 faults: Sequence[dict] = (), min_steps: int = 0, step_delay: float = 0.05,
                 worker: Path = WORKER, wrap: Sequence[str] = (), env: Optional[Dict[str, str]] = None):
        self.dir = Path(directory)
        self.hosts_file = self.dir / "hosts.txt"
        self.set_hosts(hosts)
        script = self.dir / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat '{self.hosts_file}'\n")
        script.chmod(0o755)
        self.log = self.dir / "train.log"
        self.stop_file = self.dir / "stop"
        self.stdout_path, self.stderr_path = self.dir / "launcher.out", self.dir / "launcher.err"
        launcher_env = child_env(ELASTIC_TEST_LOG=str(self.log), ELASTIC_TEST_STOP=str(self.stop_file),
                                 ELASTIC_TEST_MIN_STEPS=str(min_steps), ELASTIC_TEST_STEP_DELAY=str(step_delay),
                                 ELASTIC_TEST_FAULTS=json.dumps(list(faults)))
        launcher_env.update(env or {})
        env = launcher_env
        command = [*wrap, sys.executable, "-m", "horovod.runner", "--verbose", *args, "--host-discovery-script",
                   str(script), sys.executable, str(worker)]
        self.deadline = time.monotonic() + JOB_BUDGET_S
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                         cwd=str(self.dir), start_new_session=True)

    # -- control ----------------------------------------------------------------------------------------
    def set_hosts(self, hosts: Sequence[str]) -> None:
        """Rewrite the discovery output atomically (the driver may read it at any moment)."""
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{h}\n" for h in hosts))
        os.replace(tmp, self.hosts_file)

    def pid(self, wid: str) -> int:
        """The pid of the newest process of worker ``wid``."""
        starts = [e for e in self.events("start") if e["id"] == wid]
        assert starts, f"worker {wid} never started\n{self.diagnose()}"
        return starts[-1]["pid"]

    def alive(self, wid: str) -> bool:
        """Whether the newest process of ``wid`` still exists."""
        try:
            os.kill(self.pid(wid), 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self, *wids: str, sig: int = signal.SIGKILL) -> None:
        pids = [self.pid(w) for w in wids]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass   # the driver stopped it already (its host was blacklisted by the first kill)

    def finish(self, timeout: float = WAIT_S) -> int:
        """Ask the job to stop training and wait for the launcher; returns its exit status."""
        self.stop_file.touch()
        return self.wait(timeout)

    def _bounded(self, timeout: float) -> float:
        """``timeout``, cut to what is left of the job's budget."""
        return max(0.0, min(timeout, self.deadline - time.monotonic()))

    def wait(self, timeout: float = WAIT_S) -> int:
        timeout = self._bounded(timeout)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"the launcher did not exit within {timeout:.0f} s (hang)\n{self.diagnose()}") from e

    def cleanup(self) -> None:
        """Stop the launcher (it stops its workers) and kill any worker left behind."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for event in self.events("start"):
            try:
                os.killpg(event["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    # -- observation ----------------------------------------------------------------------------------
    def events(self, kind: Optional[str] = None) -> List[dict]:
        try:
            lines = self.log.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue   # a line being written right now
            if kind is None or event["ev"] == kind:
                out.append(event)
        return out

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_for(self, what: str, predicate: Callable[[List[dict]], bool], timeout: float = WAIT_S) -> None:
        """Block until ``predicate(events)`` holds; fail (with the job's output) on timeout or early exit."""
        timeout = self._bounded(timeout)
        deadline = time.monotonic() + timeout
        while True:
            if predicate(self.events()):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the job exited ({self.proc.returncode}) before: {what}\n{self.diagnose()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for: {what}\n{self.diagnose()}")
            time.sleep(0.1)

    def wait_for_output(self, text: str, timeout: float = WAIT_S) -> None:
        """Block until the launcher's standard error contains ``text``."""
        deadline = time.monotonic() + self._bounded(timeout)
        while text not in self.stderr():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"launcher never printed {text!r}\n{self.diagnose()}")
            time.sleep(0.1)

    def wait_for_commits(self, count: int, size: int, min_epoch: int = 0, timeout: float = WAIT_S) -> None:
        """Block until ``count`` steps were committed at ``size`` ranks in epochs >= ``min_epoch`` (seen on rank 0)."""
        def enough(events: List[dict]) -> bool:
            return sum(1 for e in events if e["ev"] == "commit" and e["size"] == size and e["rank"] == 0
                       and e["epoch"] >= min_epoch) >= count

        self.wait_for(f"{count} commits at size {size} from epoch {min_epoch} on", enough, timeout)

    def diagnose(self) -> str:
        lines = self.log.read_text().splitlines() if self.log.exists() else ["(no log)"]
        tail = "\n".join([line for line in lines if '"commit"' not in line][-80:] + lines[-5:])
        return (f"--- launcher stderr ---\n{self.stderr()[-6000:]}\n--- launcher stdout ---\n{self.stdout()[-3000:]}"
                f"\n--- training log (all but commits, then the last lines) ---\n{tail}")


# -- analysis --------------------------------------------------------------------------------------------
def joined(size: int, epoch_at_least: int = 1) -> Callable[[List[dict]], bool]:
    """Predicate for :meth:`ElasticJob.wait_for`: rank 0 of an epoch >= ``epoch_at_least`` joined with ``size``
    ranks."""
    def check(events: List[dict]) -> bool:
        return any(e["ev"] == "join" and e["size"] == size and e["rank"] == 0 and e["epoch"] >= epoch_at_least
                   for e in events)
    return check



@dataclass
class Epoch:
    number: int
    size: int
    resume_step: int
    ranks: Dict[str, int] = field(default_factory=dict)        # worker id -> rank (workers that joined)
    last_commit: Dict[str, int] = field(default_factory=dict)  # worker id -> last step it committed


def epochs(events: List[dict]) -> List[Epoch]:
    """The epochs that trained, in order, with who joined at which step and what each committed."""
    by_number: Dict[int, Epoch] = {}
    for e in events:
        if e["ev"] == "join":
            ep = by_number.setdefault(e["epoch"], Epoch(e["epoch"], e["size"], e["step"]))
            assert (ep.size, ep.resume_step) == (e["size"], e["step"]), \
                f"ranks of epoch {ep.number} disagree after the sync: {e} vs size {ep.size} step {ep.resume_step}"
            assert e["id"] not in ep.ranks, f"{e['id']} joined epoch {ep.number} twice"
            ep.ranks[e["id"]] = e["rank"]
        elif e["ev"] == "commit":
            ep = by_number[e["epoch"]]
            ep.last_commit[e["id"]] = max(ep.last_commit.get(e["id"], -1), e["step"])
    out = [by_number[n] for n in sorted(by_number)]
    for ep in out:
        assert sorted(ep.ranks.values()) == sorted(set(ep.ranks.values())), f"duplicate ranks in {ep}"
        assert all(0 <= r < ep.size for r in ep.ranks.values()), f"rank out of range in {ep}"
    return out


def expected_model(history: Sequence[Sequence[int]]) -> np.ndarray:
    """Replay the committed (step, size) sequence exactly as the workers compute it."""
    w = np.zeros(4)
    for step, size in history:
        total = sum(np.array([step % 5 + r, 1.0, (step * r) % 3, r], dtype=np.float64) for r in range(size))
        w = w - 0.5 * (total / size)
    return w


def check_training(events: List[dict], sizes: Optional[Sequence[int]] = None,
                   resets: Optional[int] = None, finished: bool = True) -> List[Epoch]:
    """Verify the training log of a finished job; returns its epochs.

    - no worker failed unexpectedly (only injected failures and kills);
    - every epoch's ranks agree on size and resume step, ranks are distinct;
    - nothing committed is lost: each epoch resumes exactly at the newest step its surviving workers had
      committed (or resumed at) in the previous epoch;
    - when ``finished`` (a finished ``elastic_worker.py`` job): the final history is the steps 0..N-1, each
      once, and the final model equals the one recomputed from it;
    - optionally: the sizes of the epochs in order, and the number of resets.
    """
    crashes = [e for e in events if e["ev"] == "crash"]
    assert not crashes, f"workers failed unexpectedly: {crashes}"
    eps = epochs(events)
    assert eps, "no epoch trained"
    for before, after in zip(eps, eps[1:]):
        survivors = set(before.ranks) & set(after.ranks)
        assert survivors, f"epoch {after.number} has no survivor of epoch {before.number}: state would be lost"
        newest = max(max(before.resume_step, before.last_commit.get(w, -1)) for w in survivors)
        assert after.resume_step == newest, (
            f"epoch {after.number} resumed at step {after.resume_step}, but its survivors {sorted(survivors)} "
            f"had committed up to step {newest} in epoch {before.number}")
    if finished:
        done = [e for e in events if e["ev"] == "done"]
        assert len(done) == 1, f"expected one final report, got {len(done)}"
        history = done[0]["history"]
        assert [s for s, _ in history] == list(range(done[0]["step"])), "committed steps are not 0..N-1 once each"
        np.testing.assert_array_equal(np.array(done[0]["w"]), expected_model(history))
        if "same_on_every_rank" in done[0]:
            assert done[0]["same_on_every_rank"], "the final model differs between ranks"
    if sizes is not None:
        assert [e.size for e in eps] == list(sizes), f"epoch sizes {[e.size for e in eps]}, expected {list(sizes)}"
    if resets is not None:
        assert eps[-1].number == resets, f"{eps[-1].number} resets, expected {resets}: {eps}"
    return eps
