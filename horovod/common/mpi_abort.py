"""Under ``mpirun``, a rank that fails ends the whole job at once.

A rank that initialised MPI and then ends with an uncaught exception would otherwise run mpi4py's exit handler,
``MPI_Finalize``, which waits for every other rank to finalize too: a job whose other ranks are busy outside
Horovod (computing, sleeping, reading data) then lingers until they finish, although it has already failed.  The
original's C++ ranks aborted the job.  So, in a process whose MPI is initialised, an uncaught exception (see
:func:`install_excepthook`) or a failed :func:`horovod.run` function (``horovod.runner.run_task``) calls
``MPI_Abort`` on ``COMM_WORLD`` after the traceback was written: ``mpirun`` then ends every rank within seconds,
as horovodrun's own launcher does.  Processes without MPI (horovodrun's tcp/shm jobs) are not affected.
"""
from __future__ import annotations

import sys
import time
from types import ModuleType
from typing import Optional

_MARK = "_horovod_mpi_abort"
#: A collective that failed (a stall error, a mismatch) fails every rank at about the same moment, and each rank
#: then writes its flight-recorder dump (docs/debugging.md): the job is aborted this much later, so that the
#: other ranks' dumps are not cut off.
DUMP_GRACE_SECONDS = 2.0


def _initialized_mpi() -> Optional[ModuleType]:
    """``mpi4py.MPI`` when this process imported it and MPI is initialised and not finalised, else None."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        return None
    try:
        return MPI if MPI.Is_initialized() and not MPI.Is_finalized() else None
    except Exception:   # noqa: BLE001 - a broken MPI must not hide the original failure
        return None


def abort(exitcode: int = 1) -> None:
    """``MPI_Abort(COMM_WORLD, exitcode)`` when this process initialised MPI; returns (does nothing) otherwise."""
    MPI = _initialized_mpi()
    if MPI is None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # noqa: BLE001
            pass
    MPI.COMM_WORLD.Abort(exitcode)


def install_excepthook() -> None:
    """Make an uncaught exception abort the MPI job (after the usual traceback).  Idempotent; the previous hook
    still runs first."""
    if getattr(sys.excepthook, _MARK, False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        try:
            previous(exc_type, exc, tb)
        finally:
            from horovod.engine.errors import HorovodInternalError

            if isinstance(exc, HorovodInternalError) and _initialized_mpi() is not None:
                time.sleep(DUMP_GRACE_SECONDS)
            abort(1)

    setattr(hook, _MARK, True)
    sys.excepthook = hook
