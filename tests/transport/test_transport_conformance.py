"""Transport conformance: every collective of every transport against numpy, at np = 1 to 4.

Each case (``transport_cases.CASES``: a collective over every op x dtype, sizes on both sides of each switch point,
and every option variant of the transport) is a test of its own, parametrised over (transport, np):
``test_allreduce[shm-np3]``, so ``-k allreduce`` or ``-k "tcp and np4"`` selects what to run.  Starting ranks is
what costs time, so the first test of a (transport, np) runs one job with every case selected for it, on every
variant of the transport's options (``transport_data.VARIANTS``), and the other tests read their case's reports
from it.

How the ranks start: tcp and shm fork from the test process (fast); mpi runs under ``mpirun``; hierarchical runs in
fresh interpreters (nothing may rely on fork) and fakes its hosts by the host name each rank gives the transport.
What only one transport has (failure detection, segment cleanup, authentication, MPI's setup) is tested in that
transport's own file (test_tcp.py, test_shm.py, test_mpi.py, test_hierarchical.py).
"""
from __future__ import annotations

import importlib.util
import shutil
from typing import Dict, List, Optional, Tuple

import pytest

from checks import JobPerCombination, assert_no_failures
from multiproc import run_ranks
from transport_cases import CASES, transport_job

LAUNCHER = {"tcp": "fork", "shm": "fork", "mpi": "mpirun", "hierarchical": "subprocess"}
COMBOS: List[Tuple[str, int]] = [(t, n) for t in LAUNCHER for n in (1, 2, 3, 4)]
JOB_TIMEOUT = 300.0
# One thread per rank: numpy's BLAS pool is not used by the transports, and 4 ranks share 2 cores here.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Transport bugs found by this suite and not fixed yet: (case, transport) -> (why, the world sizes it shows at),
# run as strict xfails (once fixed, the test passes and says so). Empty since session 8 fixed the three it found
# (tcp's float16 overflow warning, tcp's late op check, hierarchical allgatherv's late buffer check).
KNOWN_BUGS: Dict[Tuple[str, str], Tuple[str, Tuple[int, ...]]] = {}



def _skip_reason(transport: str) -> Optional[str]:
    if transport == "mpi":
        if shutil.which("mpirun") is None:
            return "mpirun is not on PATH (install Open MPI)"
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install mpi4py)"
    if transport in ("shm", "hierarchical"):
        from horovod.transport.shm import _MEMORY_ORDER_OK

        if not _MEMORY_ORDER_OK:
            return "the shm transport needs an x86 (TSO) CPU"
    return None


def _combo_id(combo: Tuple[str, int]) -> str:
    return f"{combo[0]}-np{combo[1]}"


_jobs = JobPerCombination(_combo_id)   # one job per combination; each test reads its case's reports


def _selected_cases(session, combo) -> List[str]:
    """The cases of ``combo`` this pytest run selected, in catalogue order (the order they run in)."""
    wanted = JobPerCombination.selected(session, combo)
    return [name for name in CASES if name in wanted]


def _reports(request, combo, case: str) -> List[dict]:
    transport, np_ = combo

    def start() -> List[dict]:
        names = _selected_cases(request.session, combo) or [case]
        return run_ranks(transport_job, np_, args=(transport, names), env=WORKER_ENV, launcher=LAUNCHER[transport],
                         linger=LAUNCHER[transport] != "mpirun", timeout=JOB_TIMEOUT)
    return _jobs.reports(combo, case, start)


def _params(case: str) -> list:
    def marks(combo):
        why, sizes = KNOWN_BUGS.get((case, combo[0]), ("", ()))
        return [pytest.mark.xfail(reason=why, strict=True)] if combo[1] in sizes else []

    return [pytest.param(combo, id=_combo_id(combo), marks=marks(combo)) for combo in COMBOS]


def _make_test(case: str):
    @pytest.mark.parametrize("combo", _params(case))
    def test(combo, request):
        reason = _skip_reason(combo[0])
        if reason:
            pytest.skip(reason)
        reports = _reports(request, combo, case)
        assert_no_failures(reports)
        # Results that must be bitwise identical everywhere (non-integer sums) travel back as digests.
        differ = [what for what, d in reports[0]["agree"].items() if any(r["agree"].get(what) != d for r in reports)]
        assert not differ, f"ranks disagree bit for bit on: {differ[:10]}"

    test.__name__ = test.__qualname__ = f"test_{case}"
    test.__doc__ = (CASES[case].__doc__ or "").split("\n")[0] + " (against numpy, on every option variant)"
    return test


for _case in CASES:
    globals()[f"test_{_case}"] = _make_test(_case)
