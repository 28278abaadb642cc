"""Under mpirun, a rank that fails after ``hvd.init()`` ends the whole job at once, while another rank is busy
outside Horovod (as the original: its ``test_failed_run`` wants the job over in well under a minute).

Without the abort, the failed rank's exit runs ``MPI_Finalize``, which waits for the busy rank to finalize too.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time

import pytest

from runner_helpers import REPO, child_env

HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None
pytestmark = pytest.mark.skipif(not HAVE_MPI, reason="mpirun and mpi4py are not installed")

BUSY_S = 60        # how long the healthy rank would stay busy outside Horovod
PROMPT_S = 30      # the job must be over well before that

SCRIPT = r"""
import time
import numpy as np
import horovod.numpy as hvd

hvd.init()
hvd.allreduce(np.ones(2), name="warm")       # both ranks are in the job
if hvd.rank() == 1:
    raise ArithmeticError("rank one is unhappy")
time.sleep(%d)                                 # busy outside Horovod
""" % BUSY_S

API_DRIVER = r"""
import os, time
from horovod.runner import run

def fails_on_rank_one():
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    hvd.allreduce(np.ones(2), name="warm")
    if hvd.rank() == 1:
        raise ArithmeticError("rank one is unhappy")
    time.sleep(%d)
    return "fine"

start = time.monotonic()
try:
    run(fails_on_rank_one, num_proc=2, use_mpi=True)
except RuntimeError as exc:
    print("ERROR", repr(str(exc)))
print("ELAPSED", time.monotonic() - start)
""" % BUSY_S


def _env() -> dict:
    return child_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def test_uncaught_exception_under_mpirun_ends_the_job(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(SCRIPT)
    start = time.monotonic()
    proc = subprocess.run(["mpirun", "-np", "2", "--bind-to", "none", sys.executable, str(worker)],
                          capture_output=True, text=True, timeout=BUSY_S + 60, env=_env(), cwd=str(REPO),
                          stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "ArithmeticError: rank one is unhappy" in proc.stderr, proc.stderr
    assert elapsed < PROMPT_S, f"the job took {elapsed:.0f} s after rank 1 failed:\n{proc.stderr}"


def test_failed_function_under_horovod_run_use_mpi_ends_the_job(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(API_DRIVER)   # functions of __main__ travel by value
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=BUSY_S + 60,
                          env=_env(), cwd=str(tmp_path), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    error = next(line for line in proc.stdout.splitlines() if line.startswith("ERROR"))
    assert "rank 1 raised:" in error and "ArithmeticError: rank one is unhappy" in error, error
    elapsed = float(next(line for line in proc.stdout.splitlines() if line.startswith("ELAPSED")).split()[1])
    assert elapsed < PROMPT_S, f"horovod.run took {elapsed:.0f} s after rank 1 failed:\n{proc.stderr}"
