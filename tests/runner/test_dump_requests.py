"""``horovodrun --dump-flight-recorder PID`` (SIGUSR1 to the launcher) when it cannot be served at once: the ranks
have not reached ``hvd.init()`` yet (it says so, then serves it once they have), or the job runs under mpirun (it
says why, and the launcher does not die of the signal).  Requests served at once: tests/doctor/test_dump_triggers.py.
"""
from __future__ import annotations

import importlib.util
import queue
import shutil
import subprocess
import sys
import threading
import time

import pytest

from runner_helpers import REPO, child_env, launcher_argv

WAIT_S = 90

# Each rank says it runs, waits for the test's "go" before hvd.init(), then for "done" before it ends.
WORKER = """
import os, sys, time
where = sys.argv[1]
rank = os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")

def wait_for(name):
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(where, name)):
        assert time.monotonic() < deadline, f"rank {rank}: no {name} file within 90 s"
        time.sleep(0.05)

open(os.path.join(where, "started." + rank), "w").close()
wait_for("go")
import numpy as np
import horovod.numpy as hvd
hvd.init()
hvd.allreduce(np.ones(4), name="x")
print("INITIALISED", hvd.rank(), flush=True)
wait_for("done")
hvd.shutdown()
"""


class Launcher:
    """horovodrun in the background, its merged output read line by line."""

    def __init__(self, args, tmp_path):
        self.proc = subprocess.Popen(launcher_argv(args), env=child_env(OMPI_ALLOW_RUN_AS_ROOT="1",
                                                                       OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"),
                                     cwd=str(REPO), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.seen = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()

    def wait_for(self, text: str) -> str:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                said = "".join(self.seen)[-4000:]
                raise AssertionError(f"no line with {text!r} within {WAIT_S} s:\n{said}") from None
            self.seen.append(line)
            if text in line:
                return line

    def ask_for_dump(self) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "horovod.runner", "--dump-flight-recorder", str(self.proc.pid)],
                              env=child_env(), capture_output=True, text=True, timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _wait_files(paths):
    deadline = time.monotonic() + WAIT_S
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"the workers did not start within {WAIT_S} s"
        time.sleep(0.05)


def test_a_request_before_init_says_so_and_is_served_once_the_ranks_are_up(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    job = Launcher(["-np", "2", sys.executable, str(worker), str(tmp_path)], tmp_path)
    try:
        _wait_files([tmp_path / "started.0", tmp_path / "started.1"])
        ask = job.ask_for_dump()
        assert ask.returncode == 0 and "or why it cannot give one yet" in ask.stdout, ask.stdout + ask.stderr
        said = job.wait_for("cannot be served yet")
        assert "rank(s) 0-1 of 2 have not reached hvd.init()" in said, said
        (tmp_path / "go").touch()
        verdict = job.wait_for("served once every rank reached hvd.init()")
        assert "rerun: python -m horovod.doctor" in verdict, verdict
        assert any("Horovod doctor (2 of 2 ranks dumped" in line for line in job.seen), "".join(job.seen)[-4000:]
        (tmp_path / "done").touch()
        assert job.proc.wait(WAIT_S) == 0, "".join(job.seen)[-4000:]
    finally:
        (tmp_path / "go").touch()
        (tmp_path / "done").touch()
        job.stop()


HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None


@pytest.mark.skipif(not HAVE_MPI, reason="mpirun and mpi4py are not installed")
def test_a_request_under_mpi_says_why_it_is_not_served_and_the_job_lives_on(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    job = Launcher(["--mpi", "-np", "2", sys.executable, str(worker), str(tmp_path)], tmp_path)
    try:
        _wait_files([tmp_path / "started.0", tmp_path / "started.1"])
        assert job.ask_for_dump().returncode == 0
        said = job.wait_for("cannot be served")
        assert "under --mpi the ranks collect by themselves" in said, said
        (tmp_path / "go").touch()
        (tmp_path / "done").touch()
        assert job.proc.wait(WAIT_S) == 0, "".join(job.seen)[-4000:]   # SIGUSR1's default action would kill it
    finally:
        (tmp_path / "go").touch()
        (tmp_path / "done").touch()
        job.stop()
