"""The hang doctor under a plain ``mpirun`` (no launcher of ours): the ranks write into one directory per job named
after Open MPI's job id, and rank 0 — which sees the stall — signals the ranks on its host, collects their dumps
and prints the doctor's verdict itself."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from test_planted_hangs import PLANTED, REPO, marker_line

pytestmark = pytest.mark.slow


def mpirun() -> str:
    found = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(found):
        pytest.skip("mpirun is not installed")
    return found


@pytest.mark.parametrize("scenario", ["sleep", "sigstop"])
def test_rank0_prints_the_verdict_over_the_jobs_own_directory(tmp_path, scenario):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_") and k != "_HOROVOD_SECRET_KEY"}
    env.update({"PYTHONPATH": str(REPO), "HOROVOD_STALL_CHECK_TIME_SECONDS": "2",
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "6", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    argv = [mpirun(), "-np", "2", "--oversubscribe", "-x", f"TMPDIR={tmp_path}"]
    for name in ("PYTHONPATH", "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"):
        argv += ["-x", name]
    proc = subprocess.run(argv + [sys.executable, str(PLANTED), scenario], env=env, capture_output=True,
                          timeout=120)
    output = (proc.stdout + proc.stderr).decode(errors="replace")
    jobs = list((tmp_path / "horovod-flight-recorder").glob("mpirun-*"))
    assert len(jobs) == 1, f"expected one job directory under {tmp_path}, found {jobs}:\n{output[-3000:]}"
    assert (jobs[0] / "launcher.json").exists(), "rank 0 did not record the ranks' processes"
    waiter = marker_line(scenario, "waiter")
    if scenario == "sleep":
        expected = ["Horovod doctor (2 of 2 ranks dumped", "rank 1 never submitted allreduce 'grad.fc1.bias'",
                    f"it is in {marker_line('sleep', 'culprit')}", f"rank 0 waits in it ({waiter})"]
    else:
        expected = ["Horovod doctor (1 of 2 ranks dumped", "rank 1 (host ", "is stopped (SIGSTOP or a debugger)",
                    f"rank 0 waits in allreduce 'grad.fc1.bias' ({waiter})"]
    expected.append(f"dumps: {jobs[0]} (collected in ")
    for piece in expected:
        assert piece in output, f"{piece!r} not in rank 0's output:\n{output[-4000:]}"
